"""Qwen3.5 served on CPU (issue #36 item 1): a hybrid model, three Gated DeltaNet layers (linear
attention with a recurrent state) to one of full attention, whose ops come from the CPU fallback
(``sgl_embeds_srt/cpu/gdn.py``, ``fused.py``). Text prompts' greedy tokens and logprobs equal HF's
``Qwen3_5ForConditionalGeneration`` (float32, its pure-torch recurrent kernels): prompts prefilled
in chunks of 16 positions (the state carried from chunk to chunk), then decoded step by step;
requests batched together (each its own state slot); a repeat served from the prefix cache
(``MambaRadixCache``, which holds the recurrent state) gives the same answer. Image spans (item 2)
as on Qwen3-VL, without deepstack rows: the server's vision weights are NaN, so an answer equal
to HF's on the pixels proves the tower never ran."""

from __future__ import annotations

import concurrent.futures
import functools

import pytest

import helpers
from qwen_vl_harness import MIN_COMPARED, MAX_TOKENS, ask, assert_matches_hf, chat_text, grid_span, span_segments
from sgl_embeds.testing import reference as ref
from sgl_embeds.testing.qwen_vl import (
    IMAGE_PLACEHOLDER,
    VISION_START,
    hf_qwen_vl,
    qwen_vl_greedy,
    qwen_vl_inputs,
    sample_images,
    tiny_qwen3_5_dir,
)

pytestmark = pytest.mark.server
CHUNK = 16  # the server's --chunked-prefill-size
QUESTIONS = [
    "what is the color of the sky",
    "describe the small red car near the tree",
    # long enough for several prefill chunks
    " ".join(["the quick brown fox is near the lazy dog on the road and the cat is under the tree"] * 4)
    + " what is there",
]


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_qwen3_5_dir()


@pytest.fixture
def server(servers):
    return servers.get("qwen3_5")[0]


def _ask(server, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS},
            **helpers.OUTPUT_LOGPROBS, **extra}
    return helpers.generate(server, body)


def _assert_matches_hf(out: dict, checkpoint, text: str, label: str) -> list[int]:
    greedy = functools.partial(qwen_vl_greedy, checkpoint, text, [], MAX_TOKENS)
    eos = ref.eos_ids(hf_qwen_vl(str(checkpoint))[0])
    return ref.assert_vlm_matches_hf(out, greedy, eos, f"{label}: ", MIN_COMPARED).tokens


def test_text_prompts_equal_hf_prefilled_in_chunks(server, checkpoint):
    answers = {}
    for i, question in enumerate(QUESTIONS):
        text = chat_text(checkpoint, question, 0)
        out = _ask(server, text)
        prompt = len(qwen_vl_inputs(checkpoint, text, [])["input_ids"][0])
        assert out["meta_info"]["prompt_tokens"] == prompt
        answers[i] = tuple(_assert_matches_hf(out, checkpoint, text, f"question {i} ({prompt} tokens)"))
    assert prompt > 3 * CHUNK, "the last prompt must take several prefill chunks"
    assert len(set(answers.values())) == len(answers), f"the prompts must change HF's answer: {answers}"


def test_batched_requests_each_equal_hf(server, checkpoint):
    """Three prompts at once: prefilled and decoded in shared batches, each in its own state slot."""
    texts = [chat_text(checkpoint, q, 0) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(lambda t: _ask(server, t), texts))
    for i, (text, out) in enumerate(zip(texts, outs)):
        _assert_matches_hf(out, checkpoint, text, f"batched {i}")


def test_a_repeat_is_served_from_the_cache_with_the_same_answer(server, checkpoint):
    text = chat_text(checkpoint, "which object is at the top left corner of the picture", 0)
    first = _ask(server, text)
    again = _ask(server, text)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0, again["meta_info"]
    _assert_matches_hf(again, checkpoint, text, "repeat")
    # a prompt that shares the repeat's text up to its question: the cache must not lend it the
    # repeat's state past the shared part
    other = chat_text(checkpoint, "which object is at the bottom right corner of the picture", 0)
    _assert_matches_hf(_ask(server, other), checkpoint, other, "other question")


def test_image_spans_equal_hf_on_the_pixels(server, checkpoint):
    text = chat_text(checkpoint, "what is the color of the object", 1)
    answers = {}
    for name, image in list(sample_images().items())[:2]:
        out = ask(server, span_segments(text, [grid_span(checkpoint, image)]))
        assert out["meta_info"]["prompt_tokens"] == len(qwen_vl_inputs(checkpoint, text, [image])["input_ids"][0])
        answers[name] = tuple(assert_matches_hf(out, checkpoint, text, [image], name))
    assert len(set(answers.values())) == len(answers), f"images must change HF's answer: {answers}"


def test_a_repeated_span_is_cached_with_its_state_and_another_image_shares_none(server, checkpoint):
    """The prefix cache holds the recurrent state at the nodes it keeps: a repeat of a span prompt
    hits through the span (its answer HF's); an image of the same grid after the same text
    matches at most the text before it, and its answer is HF's on its own pixels."""
    text = chat_text(checkpoint, "describe it in a few words", 1)
    stripes, checks = sample_images()["stripes"], sample_images()["checks"]  # one grid (1x4x8)
    span = grid_span(checkpoint, stripes)
    first = ask(server, span_segments(text, [span]))
    again = ask(server, span_segments(text, [span]))
    before = len(qwen_vl_inputs(checkpoint, text.split(IMAGE_PLACEHOLDER)[0] + VISION_START, [])["input_ids"][0])
    rows = span["image_grid_thw"][1] * span["image_grid_thw"][2] // 4
    meta = again["meta_info"]
    print(f"repeat: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached "
          f"({before} before the span, {rows} span rows)")
    assert meta["cached_tokens"] >= before + rows, meta
    assert again["output_ids"] == first["output_ids"]
    assert_matches_hf(again, checkpoint, text, [stripes], "repeat")
    other = ask(server, span_segments(text, [grid_span(checkpoint, checks)]))
    assert other["meta_info"]["cached_tokens"] <= before, other["meta_info"]
    assert_matches_hf(other, checkpoint, text, [checks], "another image")
