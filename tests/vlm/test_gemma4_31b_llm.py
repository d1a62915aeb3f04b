"""The LLM half of the tiny Gemma 4 26B / 31B layout (experts beside the MLP, full layers with
keys equal to values and one KV head) served by SGLang's ``Gemma4ForCausalLM`` with the plugin,
as a text LLM: text prompts and image rows as plain (causal) spans give HF
``Gemma4ForConditionalGeneration``'s tokens and logprobs with the images attended causally
(``split`` refuses this layout: HF attends its images as blocks on the sliding layers only).
HF's answer changes without the router's scale, which SGLang's CPU norm dropped
(``model_runner.router_scaled``; tests/sabotage/gemma4_router_unscaled.patch)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn
from transformers.models.gemma4 import modeling_gemma4

import helpers
import sgl_embeds
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.vlm import load_encoder, render_chat
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir, tiny_gemma4_llm_half_dir

MAX_TOKENS, MIN_COMPARED = 10, 8
SERVER = "gemma4_31b_llm"
TEXTS = ["hello there",
         "<|turn>user\nWhat is the color of the object on the table near the window<turn|>\n<|turn>model\n"]
pytestmark = pytest.mark.pooled(SERVER)


@contextlib.contextmanager
def _router_unscaled():
    """HF's Gemma 4 router without its learned scale and hidden**-0.5 (what SGLang's CPU norm
    computed before ``router_scaled``)."""
    scaled = modeling_gemma4.Gemma4TextRouter.forward

    def forward(self, hidden_states):
        probabilities = nn.functional.softmax(self.proj(self.norm(hidden_states)), dim=-1,
                                              dtype=torch.float32)
        weights, index = torch.topk(probabilities, k=self.config.top_k_experts, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return probabilities, weights * self.per_expert_scale[index], index

    modeling_gemma4.Gemma4TextRouter.forward = forward
    try:
        yield
    finally:
        modeling_gemma4.Gemma4TextRouter.forward = scaled


def _check(out: dict, text: str, images: list, context: str) -> None:
    checkpoint = tiny_gemma4_dir("31b")
    model, _ = ref.hf_gemma4(str(checkpoint))
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.gemma4_greedy(checkpoint, text, images, MAX_TOKENS, prefix,
                                                 causal_images=True),
        ref.eos_ids(model), context, MIN_COMPARED, min_distinct=2)
    with _router_unscaled():
        unscaled = ref.gemma4_greedy(checkpoint, text, images, MAX_TOKENS, causal_images=True)
    assert unscaled.tokens != reference.tokens, f"{context}HF's answer must change with the router's scale"


def test_text_and_causal_image_spans_match_hf_gemma4_31b(servers):
    server = servers.get(SERVER)[0]
    endpoint = EmbedsEndpoint(server.url)
    _, processor = ref.hf_gemma4(str(tiny_gemma4_dir("31b")))
    for i, text in enumerate(TEXTS):
        ids = processor.tokenizer(text)["input_ids"]
        out = endpoint.run(input_segments=[sgl_embeds.Ids(ids)], return_logprob=True,
                           top_logprobs_num=ref.TOP_K,
                           sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
        _check(out, text, [], f"text {i}: ")
    vision = tiny_gemma4_llm_half_dir("31b") / "vision"
    encoder = load_encoder(vision, device="cpu")
    images = [synthetic_scene(), helpers.random_image(40, 40, seed=5)]
    chat = render_chat(vision, [{"role": "user", "content": [{"type": "image"}] * 2 + [
        {"type": "text", "text": "Which one is brighter?"}]}])
    # the spans causal, as a text LLM attends them (the 31B encoder writes each image as a block)
    segments = [dataclasses.replace(s, bidirectional=False) if isinstance(s, sgl_embeds.Span) else s
                for s in encoder.prompt_segments([encoder(image) for image in images], chat).segments]
    assert sum(isinstance(s, sgl_embeds.Span) for s in segments) == 2
    out = endpoint.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                       sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    _check(out, chat, images, "two causal images: ")
