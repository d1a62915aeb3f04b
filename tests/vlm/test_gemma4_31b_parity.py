"""Gemma 4's 26B / 31B layout served by ``python -m sgl_embeds serve``, split: each image one
bidirectional block on the sliding layers only, as window AND (causal OR block), the full layers
causal (HF's ``create_masks_for_vision_model``); images of 63-70 rows against a sliding window of
48, so the order of window and block matters (tests/sabotage/gemma4_blocks_*.patch); 16-position
prefill chunks (a block is prefilled whole). Greedy tokens and logprobs equal HF ``Gemma4ForConditionalGeneration`` for one image at a
time and two images, through ``run()`` and a program; HF's answer changes with its images causal.
Text prompts, and image rows sent as plain (causal) spans, give HF's answer with the images
attended causally: the LLM's experts, k=v full layers and one KV head as HF computes them, and
HF's answer changes without the router's scale, which SGLang's CPU norm dropped
(``model_runner.router_scaled``; tests/sabotage/gemma4_router_unscaled.patch)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch import nn
from transformers.models.gemma4 import modeling_gemma4

import helpers
import sgl_embeds
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir

MAX_TOKENS, MIN_COMPARED = helpers.IMAGE_ANSWER_TOKENS, 8
SERVER = "gemma4_31b_vlm"
pytestmark = pytest.mark.pooled(SERVER)


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


ask = helpers.ask_images  # MAX_TOKENS greedy tokens


def _segments(server, question: str, images: list) -> list:
    """The segments ``ask`` sends for ``question`` about ``images``."""
    return helpers.image_segments(_backend(server.url), question, images)


def _ask(server, question: str, images: list) -> tuple[dict, str]:
    backend = _backend(server.url)
    encoder = backend.vision_encoder
    chat = helpers.image_chat(backend, question, len(images))
    text = encoder.prompt_text(chat, len(images))
    segments = _segments(server, question, images)
    spans = [s for s in segments if isinstance(s, sgl_embeds.Span)]
    assert len(spans) == len(images) and all(s.bidirectional for s in spans), "each image one block"
    out = backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    state = ask.run(text=text, images=images, image_token=encoder.image_token, backend=backend)
    assert state["answer"] == out["text"]
    return out, chat


def _check(out: dict, chat: str, pixels: list, context: str, causal_images: bool = False) -> ref.Greedy:
    """``out`` equal to HF's answer (its images attended as blocks, or with ``causal_images``
    causally), which must differ from the answer under the other attention."""
    checkpoint = tiny_gemma4_dir("31b")
    model, _ = ref.hf_gemma4(str(checkpoint))
    # HF reads a generated image, video or audio token as such a position at the next step (the
    # server reads it as text): the prompts are chosen so that HF generates none (random_image(40,
    # 40, seed=5) does, and the answers part right after it)
    placeholders = {model.config.image_token_id, model.config.video_token_id, model.config.audio_token_id}
    assert not placeholders & set(out["output_ids"]), f"{context}pick another prompt"
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.gemma4_greedy(checkpoint, chat, pixels, MAX_TOKENS, prefix, causal_images),
        ref.eos_ids(model), context, MIN_COMPARED, min_distinct=2)
    other = ref.gemma4_greedy(checkpoint, chat, pixels, MAX_TOKENS, causal_images=not causal_images)
    assert other.tokens != reference.tokens, f"{context}HF's answer must change with how the images are attended"
    return reference


def test_one_image_at_a_time_matches_hf_gemma4_31b(servers):
    server = servers.get(SERVER)[0]
    images = [synthetic_scene(), helpers.random_image(50, 30, seed=3), helpers.random_image(36, 44, seed=7)]
    answers = [tuple(_check(*_ask(server, "What is in the image?", [image]), [image], f"image {i}: ").tokens)
               for i, image in enumerate(images)]
    assert len(set(answers)) > 1, answers


def test_two_images_match_hf_gemma4_31b(servers):
    server = servers.get(SERVER)[0]
    a, b = synthetic_scene(), helpers.random_image(48, 48, seed=21)
    out, chat = _ask(server, "Which one is brighter?", [a, b])
    _check(out, chat, [a, b], "two images: ")


def test_the_chat_route_and_the_gateway_answer_as_hf_gemma4_31b(servers):
    """The chat route renders an ``input_embeds`` part as ``Gemma4Processor`` writes an image, its
    rows one block on the sliding layers: HF's answer, directly and through smg; ``attention:
    causal`` on the part gives HF's answer with the image attended causally
    (``helpers.assert_image_chat_route``)."""
    server = servers.get(SERVER)[0]
    image, question = synthetic_scene(), "What is in the image?"
    backend = _backend(server.url)
    chat = helpers.image_chat(backend, question, 1)
    helpers.assert_image_chat_route(
        server, backend.vision_encoder(image), question, _segments(server, question, [image]),
        lambda out, context: _check(out, chat, [image], context), backend.vision_encoder.image_token,
        MAX_TOKENS, causal_check=lambda out, context: _check(out, chat, [image], context, causal_images=True))


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


def _check_causal(out: dict, text: str, images: list, context: str) -> None:
    """``out`` equal to HF's answer with the images attended causally, which must change
    without the router's scale."""
    checkpoint = tiny_gemma4_dir("31b")
    model, _ = ref.hf_gemma4(str(checkpoint))
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.gemma4_greedy(checkpoint, text, images, MAX_TOKENS, prefix,
                                                 causal_images=True),
        ref.eos_ids(model), context, MIN_COMPARED, min_distinct=2)
    with _router_unscaled():
        unscaled = ref.gemma4_greedy(checkpoint, text, images, MAX_TOKENS, causal_images=True)
    assert unscaled.tokens != reference.tokens, f"{context}HF's answer must change with the router's scale"


TEXTS = ["hello there",
         "<|turn>user\nWhat is the color of the object on the table near the window<turn|>\n<|turn>model\n"]


def test_text_and_causal_image_spans_match_hf_gemma4_31b(servers):
    """The LLM alone, as a text LLM serves it: text prompts, and the images' rows as plain spans
    (no ``attention``), each HF's answer with causal images."""
    server = servers.get(SERVER)[0]
    endpoint = EmbedsEndpoint(server.url)
    _, processor = ref.hf_gemma4(str(tiny_gemma4_dir("31b")))
    for i, text in enumerate(TEXTS):
        ids = processor.tokenizer(text)["input_ids"]
        out = endpoint.run(input_segments=[sgl_embeds.Ids(ids)], return_logprob=True,
                           top_logprobs_num=ref.TOP_K,
                           sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
        _check_causal(out, text, [], f"text {i}: ")
    images = [synthetic_scene(), helpers.random_image(40, 40, seed=5)]
    question = "Which one is brighter?"
    segments = [dataclasses.replace(s, bidirectional=False) if isinstance(s, sgl_embeds.Span) else s
                for s in _segments(server, question, images)]
    assert sum(isinstance(s, sgl_embeds.Span) for s in segments) == 2
    out = endpoint.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                       sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    _check_causal(out, helpers.image_chat(_backend(server.url), question, 2), images, "two causal images: ")
