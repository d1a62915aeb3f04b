"""Gemma 4 (the E2B / E4B layout) served by ``python -m sgl_embeds serve`` as users launch it:
split, the tower and ``embed_vision`` on the client (``sgl_embeds.connect``), the LLM half in
SGLang as its ``Gemma4ForCausalLM`` with the plugin: images as plain (causal) spans of as many rows
as the image's size gives, per-layer inputs (looked up at the span rows by the pad id, as HF's VLM
does at image positions), the last layers reading earlier layers' keys, sliding layers of 48
positions. Greedy tokens and logprobs equal HF ``Gemma4ForConditionalGeneration`` (float32,
eager) for one image at a time (three sizes), two images, a box and a mask, with images cut by
16-position prefill chunks, and a cached repeat. HF's own answer changes when the per-layer inputs
of the image positions come from the id the server's placeholders are masked to (0) instead of
the pad id, so a server that dropped the pad lookup would fail (tests/sabotage/gemma4_pad_dropped.patch).
"""

from __future__ import annotations

import functools

import pytest
import sglang as sgl

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds.vision import mask_image
from sgl_embeds_testing.encoders import scene_disc_mask, synthetic_scene
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir

MAX_TOKENS, MIN_COMPARED = helpers.IMAGE_ANSWER_TOKENS, 8
SERVER, CHUNK = "gemma4_vlm", 16
# the id the scheduler writes over a span row's placeholder before the embedding lookup
# (scheduler.prepare_for_extend): what the per-layer lookup would read without the pad
MASKED_ID = 0
pytestmark = pytest.mark.pooled(SERVER)


def _checkpoint():
    return tiny_gemma4_dir("e2b")


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


ask = helpers.ask_images  # MAX_TOKENS greedy tokens


def _segments(server, question: str, images: list) -> list:
    """The segments ``ask`` sends for ``question`` about ``images``."""
    return helpers.image_segments(_backend(server.url), question, images)


def _ask(server, question: str, images: list, program: bool = True) -> tuple[dict, str]:
    """The answer to ``question`` about ``images`` sent once by ``EmbedsEndpoint.run`` (and, with
    ``program``, as the program ``ask``, checked equal), and the chat text HF is given."""
    backend = _backend(server.url)
    encoder = backend.vision_encoder
    chat = helpers.image_chat(backend, question, len(images))
    segments = _segments(server, question, images)
    spans = [s for s in segments if isinstance(s, sgl_embeds.Span)]
    assert len(spans) == len(images) and not any(s.bidirectional for s in spans), (
        "each image one causal span (E2B / E4B attend images causally)")
    out = backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    if program:
        state = ask.run(text=encoder.prompt_text(chat, len(images)), images=images,
                        image_token=encoder.image_token, backend=backend)
        assert state["answer"] == out["text"]
    return out, chat


def _check(out: dict, chat: str, pixels: list, context: str) -> ref.Greedy:
    """``out`` equal to HF's answer, which must differ from HF's answer with the per-layer inputs
    of the image positions looked up by ``MASKED_ID`` instead of the pad id."""
    checkpoint = _checkpoint()
    model, _ = ref.hf_gemma4(str(checkpoint))
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.gemma4_greedy(checkpoint, chat, pixels, MAX_TOKENS, prefix),
        ref.eos_ids(model), context, MIN_COMPARED, min_distinct=2)
    masked = ref.gemma4_greedy(checkpoint, chat, pixels, MAX_TOKENS, image_layer_ids=MASKED_ID)
    assert masked.tokens != reference.tokens or max(
        abs(a - b) for a, b in zip(masked.logprobs, reference.logprobs)) > 100 * ref.LOGPROB_TOL, (
        f"{context}HF's answer must change with the ids of the image positions' per-layer inputs")
    return reference


def _images():
    # 64, 63 and 70 rows (the image's size sets the count)
    return [synthetic_scene(), helpers.random_image(40, 40, seed=5), helpers.random_image(50, 30, seed=3)]


def test_one_image_at_a_time_matches_hf_gemma4(servers):
    server = servers.get(SERVER)[0]
    encoder = _backend(server.url).vision_encoder
    answers, counts = [], set()
    for i, image in enumerate(_images()):
        counts.add(encoder.rows_for(*image.size))
        out, chat = _ask(server, "What is in the image?", [image])
        answers.append(tuple(_check(out, chat, [image], f"image {i}: ").tokens))
    assert len(counts) > 1, f"the images must give different row counts: {counts}"
    assert len(set(answers)) > 1, f"the image must change the answer: {answers}"


def test_two_images_and_a_box_match_hf_gemma4(servers):
    server = servers.get(SERVER)[0]
    a, b, _ = _images()
    out, chat = _ask(server, "Which one is brighter?", [a, b])
    _check(out, chat, [a, b], "two images: ")
    assert out["meta_info"]["prompt_tokens"] > 2 * CHUNK, "prefill chunks must cut the images"
    box = (4, 4, 40, 36)
    out, chat = _ask(server, "What is in the image?", [sgl.region(box, a)])
    _check(out, chat, [a.crop(box)], "a box: ")


def test_a_mask_matches_hf_gemma4_on_the_masked_crop(servers):
    """``sgl.region(mask)``: HF on the mask's bounding box with the outside in the encoder's mean
    colour (``sgl_embeds.vision.region_image``); HF's answer on the box alone differs."""
    server = servers.get(SERVER)[0]
    scene, mask = synthetic_scene(), scene_disc_mask()
    shown = mask_image(scene, mask, _backend(server.url).vision_encoder.mean_color)
    assert shown.size == (29, 29)
    out, chat = _ask(server, "What is in the image?", [sgl.region(mask, scene)])
    reference = _check(out, chat, [shown], "a mask: ")
    boxed = ref.gemma4_greedy(_checkpoint(), chat, [scene.crop((56, 34, 85, 63))], MAX_TOKENS)
    assert boxed.tokens != reference.tokens, "masking the box's corners must change HF's answer"


def test_a_cached_repeat_matches_hf_gemma4(servers):
    """A repeat hits all but its last position (span rows' per-layer inputs included in what the
    cache holds) and still gives HF's answer."""
    server = servers.get(SERVER)[0]
    image = helpers.random_image(48, 48, seed=21)
    first, chat = _ask(server, "What is in the image?", [image], program=False)
    repeat, _ = _ask(server, "What is in the image?", [image], program=False)
    assert repeat["meta_info"]["cached_tokens"] == repeat["meta_info"]["prompt_tokens"] - 1
    assert repeat["output_ids"] == first["output_ids"]
    _check(repeat, chat, [image], "cached repeat: ")


def test_the_chat_route_and_the_gateway_answer_as_hf_gemma4(servers):
    """The chat route renders an ``input_embeds`` part as ``Gemma4Processor`` writes an image
    (its begin token, the rows as a causal span, its end token): HF's tokens and logprobs, directly
    and through smg, and a program's binary body through smg (``helpers.assert_image_chat_route``)."""
    server = servers.get(SERVER)[0]
    image, question = helpers.random_image(40, 40, seed=31), "What is in the image?"
    backend = _backend(server.url)
    chat = helpers.image_chat(backend, question, 1)
    helpers.assert_image_chat_route(
        server, backend.vision_encoder(image), question, _segments(server, question, [image]),
        lambda out, context: _check(out, chat, [image], context), backend.vision_encoder.image_token,
        MAX_TOKENS)
