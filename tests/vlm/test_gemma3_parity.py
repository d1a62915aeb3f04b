"""Gemma 3 served by ``python -m sgl_embeds serve`` as users launch it: split, the SigLIP tower and
pooling projector on the client (``sgl_embeds.connect``), the LLM (sliding-window layers of 8
positions beside full ones) in SGLang, each image's rows one bidirectional block. Greedy tokens and
logprobs equal HF ``Gemma3ForConditionalGeneration`` (float32, eager) for one and two images and a
box, with images cut by 10-position prefill chunks, after a cached repeat, and for a second question
about the same image that hits the cache up to the question; the chat route with the image's rows
as a content part, directly and through SGLang's gateway. HF's own answer changes when the
images are attended causally, so a block the server ignored would fail.
"""

from __future__ import annotations

import functools

import pytest
import sglang as sgl

import helpers
import sgl_embeds
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.gemma3 import tiny_gemma3_dir

MAX_TOKENS, MIN_COMPARED = helpers.IMAGE_ANSWER_TOKENS, 8
SERVER, CHUNK = "gemma3_vlm", 10
pytestmark = pytest.mark.pooled(SERVER)


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


ask = helpers.ask_images  # MAX_TOKENS greedy tokens


def _ask(server, question: str, images: list, program: bool = True) -> tuple[dict, str]:
    """The answer to ``question`` about ``images`` sent once by ``EmbedsEndpoint.run`` (and, with
    ``program``, as the program ``ask``, checked equal), and the chat text HF is given."""
    backend = _backend(server.url)
    encoder = backend.vision_encoder
    chat = helpers.image_chat(backend, question, len(images))
    text = encoder.prompt_text(chat, len(images))
    segments = _segments(server, question, images)
    assert sum(getattr(s, "bidirectional", False) for s in segments) == len(images), "each image one block"
    out = backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    if program:
        state = ask.run(text=text, images=images, image_token=encoder.image_token, backend=backend)
        assert state["answer"] == out["text"]
    return out, chat


def _segments(server, question: str, images: list) -> list:
    """The segments ``ask`` sends for ``question`` about ``images``."""
    return helpers.image_segments(_backend(server.url), question, images)


def _blocks(segments: list) -> list[tuple[int, int]]:
    """Where the server places each image span (the first text with the tokenizer's specials)."""
    tokenizer = ref.hf_gemma3(str(tiny_gemma3_dir()))[1].tokenizer
    blocks, pos = [], 0
    for i, s in enumerate(segments):
        if isinstance(s, sgl_embeds.Span):
            blocks.append((pos, pos + len(s)))
            pos += len(s)
        else:
            pos += len(tokenizer.encode(s.text, add_special_tokens=i == 0))
    return blocks


def _check(out: dict, chat: str, pixels: list, context: str, causal_images: bool = False) -> ref.Greedy:
    """``out`` equal to HF's answer (its images attended as blocks, or with ``causal_images``
    causally), which must differ from the answer under the other attention."""
    checkpoint = tiny_gemma3_dir()
    model, _ = ref.hf_gemma3(str(checkpoint))
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.gemma3_greedy(checkpoint, chat, pixels, MAX_TOKENS, prefix, causal_images),
        ref.eos_ids(model), context, MIN_COMPARED, min_distinct=2)
    causal = ref.gemma3_greedy(checkpoint, chat, pixels, MAX_TOKENS, causal_images=not causal_images)
    assert causal.tokens != reference.tokens or max(
        abs(a - b) for a, b in zip(causal.logprobs, reference.logprobs)) > 100 * ref.LOGPROB_TOL, (
        f"{context}HF's answer must change with how the images are attended")
    return reference


def _images():
    return [synthetic_scene(), helpers.random_image(40, 40, seed=5), helpers.random_image(50, 30, seed=3)]


def test_one_image_at_a_time_matches_hf_gemma3(servers):
    server = servers.get(SERVER)[0]
    answers = []
    for i, image in enumerate(_images()):
        out, chat = _ask(server, "What is in the image?", [image])
        answers.append(tuple(_check(out, chat, [image], f"image {i}: ").tokens))
    assert len(set(answers)) > 1, f"the image must change the answer: {answers}"


def test_two_images_and_a_box_match_hf_gemma3(servers):
    server = servers.get(SERVER)[0]
    a, b, _ = _images()
    blocks = _blocks(_segments(server, "Which one is brighter?", [a, b]))
    assert any(start // CHUNK != (end - 1) // CHUNK for start, end in blocks), f"a chunk must cut an image: {blocks}"
    out, chat = _ask(server, "Which one is brighter?", [a, b])
    _check(out, chat, [a, b], "two images: ")
    box = (4, 4, 40, 36)
    out, chat = _ask(server, "What is in the image?", [sgl.region(box, a)])
    _check(out, chat, [a.crop(box)], "a box: ")


def test_a_cached_repeat_and_a_second_question_about_the_same_image(servers):
    """A repeat hits all but its last position; a second question about the same image hits up
    to the question (the image block depends only on what precedes it), both still exact."""
    server = servers.get(SERVER)[0]
    image = helpers.random_image(48, 48, seed=21)
    first, chat = _ask(server, "What is in the image?", [image], program=False)
    image_start = _blocks(_segments(server, "What is in the image?", [image]))[0][0]
    assert first["meta_info"]["cached_tokens"] <= image_start, "a new image: nothing of it is cached"
    repeat, _ = _ask(server, "What is in the image?", [image], program=False)
    assert repeat["meta_info"]["cached_tokens"] == repeat["meta_info"]["prompt_tokens"] - 1
    _check(repeat, chat, [image], "cached repeat: ")
    second, second_chat = _ask(server, "Describe the colors.", [image], program=False)
    image_at = chat.index("<start_of_image>")  # the rendered chats are equal up to the question
    assert second_chat[:image_at] == chat[:image_at]
    image_end = _blocks(_segments(server, "Describe the colors.", [image]))[0][1]
    assert second["meta_info"]["cached_tokens"] >= image_end, "the image block must be reused"
    _check(second, second_chat, [image], "second question: ")


def test_the_chat_route_and_the_gateway_answer_as_hf_gemma3(servers):
    """The chat route renders an ``input_embeds`` part as ``Gemma3Processor`` writes an image
    (``"\\n\\n<start_of_image>"``, the rows as one block, ``"<end_of_image>\\n\\n"``): HF's tokens and
    logprobs, directly and through smg; ``attention: causal`` on the part gives HF's answer with
    the image attended causally (``helpers.assert_image_chat_route``)."""
    server = servers.get(SERVER)[0]
    image, question = helpers.random_image(40, 40, seed=31), "What is in the image?"
    backend = _backend(server.url)
    chat = helpers.image_chat(backend, question, 1)
    helpers.assert_image_chat_route(
        server, backend.vision_encoder(image), question, _segments(server, question, [image]),
        lambda out, context: _check(out, chat, [image], context), "<start_of_image>", MAX_TOKENS,
        causal_check=lambda out, context: _check(out, chat, [image], context, causal_images=True))
