"""Gemma 4's 26B / 31B layout served by ``python -m sgl_embeds serve``, split: each image one
bidirectional block on the sliding layers only, as window AND (causal OR block), the full layers
causal (HF's ``create_masks_for_vision_model``); images of 63-70 rows against a sliding window of
48, so the order of window and block matters (tests/sabotage/gemma4_blocks_*.patch); 16-position
prefill chunks (a block is prefilled whole). Greedy tokens and logprobs equal HF ``Gemma4ForConditionalGeneration`` for one image at a
time and two images, through ``run()`` and a program; HF's answer changes with its images causal."""

from __future__ import annotations

import functools

import pytest
import sglang as sgl

import helpers
import sgl_embeds
from sgl_embeds.vlm import image_prompt
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir

MAX_TOKENS, MIN_COMPARED = 10, 8
SERVER = "gemma4_31b_vlm"
pytestmark = pytest.mark.pooled(SERVER)


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


@sgl.function
def ask(s, text, images, image_token):
    s += image_prompt(text, images, image_token)
    s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)


def _segments(server, question: str, images: list) -> list:
    """The segments ``ask`` sends for ``question`` about ``images``."""
    backend = _backend(server.url)
    encoder = backend.vision_encoder
    text = encoder.prompt_text(helpers.image_chat(backend, question, len(images)), len(images))
    return sgl_embeds.compile_program(ask, like=backend, text=text, images=images,
                                      image_token=encoder.image_token)[0]


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
