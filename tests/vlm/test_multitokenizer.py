"""Spans in multi-tokenizer mode (``--tokenizer-worker-num 2``): SGLang serves HTTP from several
worker processes that each import the app anew; the plugin installs itself in every one. The one
multi-tokenizer server of the suite serves Qwen3-VL (deepstack rows, interleaved M-RoPE, clips with
their timestamps), whose tokenizer-worker path is the one every family takes, with NaN vision
weights: image and clip spans sent to both workers at once equal HF on the pixels and frames, a
kept span's rows cross once per worker to the one scheduler, and a span of the wrong width is a
400 from either worker.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

import helpers
from conftest import QWEN_VL_ARGS
from qwen_vl_harness import CLIP_FAMILIES, MAX_TOKENS, assert_matches_hf, chat_text, clip_span, grid_span, span_segments
from sgl_embeds_testing.qwen_vl import (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, poisoned_vision_dir, qwen_vl_greedy,
                                       sample_clip, sample_images, tiny_qwen3_vl_dir)
from sgl_embeds_protocol import keys, wire

pytestmark = pytest.mark.server
QUESTIONS = ("what is the color of the object", "describe it in a few words")
# A worker's transport keeps every span it sent for the scheduler: the kept-span test's image must
# be one the test before it never sent
KEPT_IMAGE = "checks"


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_qwen3_vl_dir()


@pytest.fixture(scope="module")
def multi_tokenizer_server(checkpoint, servers):
    servers.make_room(1)
    server = helpers.start_multi_tokenizer(poisoned_vision_dir(checkpoint), [*QWEN_VL_ARGS, "--skip-server-warmup"])
    yield server
    server.stop()


def _info_by_worker(url: str) -> dict[int, dict]:
    """``/sgl_embeds/info`` of both tokenizer workers, by pid. Which worker accepts a connection
    is up to the kernel: ask until both have answered."""
    seen: dict[int, dict] = {}
    for _ in range(20):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for info in pool.map(lambda _: requests.get(url + "/sgl_embeds/info", timeout=60).json(), range(32)):
                seen[info["http_worker_pid"]] = info
        if len(seen) == 2:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"expected both tokenizer workers to answer with the plugin, saw {sorted(seen)}")


def test_span_prompts_work_through_every_tokenizer_worker(multi_tokenizer_server, checkpoint):
    """Both workers answer with the plugin and the vision block; 12 image-span prompts (3 images x
    2 questions, each twice) sent at once equal HF's tokens and logprobs; a chat with an image part
    equals HF; a span without its deepstack rows is a 400 naming the width."""
    infos = _info_by_worker(multi_tokenizer_server.url)
    assert all(info["vision"]["merge_size"] == 2 for info in infos.values()), infos
    pictures = [(name, image) for name, image in sample_images().items() if name != KEPT_IMAGE]
    asked = [(question, name, image) for question in QUESTIONS for name, image in pictures]
    bodies = [helpers.body(span_segments(chat_text(checkpoint, q, 1), [grid_span(checkpoint, image)]), MAX_TOKENS,
                           return_logprob=True) for q, _, image in asked]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda b: helpers.generate(multi_tokenizer_server, b), bodies * 2))
    for i, (question, name, image) in enumerate(asked):
        assert_matches_hf(outs[i], checkpoint, chat_text(checkpoint, question, 1), [image], f"{name}, {question}")
        assert outs[i + len(asked)]["output_ids"] == outs[i]["output_ids"]
    assert len({tuple(o["output_ids"]) for o in outs}) > len(pictures), "the prompts must change the answers"

    image = pictures[0][1]
    span = grid_span(checkpoint, image)
    chat = requests.post(multi_tokenizer_server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "messages": [
            {"role": "user", "content": [{"type": "input_embeds", "input_embeds": span["embeds"],
                                          "image_grid_thw": span["image_grid_thw"]},
                                         {"type": "text", "text": QUESTIONS[0]}]}]})
    assert chat.status_code == 200, chat.text
    text = chat_text(checkpoint, QUESTIONS[0], 1)
    hf_chat = qwen_vl_greedy(checkpoint, text, [image], MAX_TOKENS, add_special_tokens=False).tokens
    assert chat.json()["choices"][0]["response_token_ids"] == hf_chat

    rows = wire.decode_tensor(span["embeds"])
    main_only = {**span, **helpers.span(rows[:, :rows.shape[1] // 3])}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        refused = list(pool.map(lambda _: multi_tokenizer_server.generate(
            helpers.body(span_segments(text, [main_only]), MAX_TOKENS)), range(8)))
    assert all(r.status_code == 400 and "[n, 64 x (1 + 3)] = [n, 256]" in r.json()["message"] for r in refused), (
        [r.text for r in refused])


def test_a_kept_span_crosses_once_per_worker_to_the_one_scheduler(multi_tokenizer_server, checkpoint):
    """Each HTTP worker keeps the image span and hands its rows to the shared scheduler once; the
    scheduler's copy serves both (srt/transport.py: one copy, a keeper per worker); by handle, a
    worker that holds it answers HF's tokens, the other ``UnknownSpanHandle``."""
    url = multi_tokenizer_server.url
    text = chat_text(checkpoint, QUESTIONS[0], 1)
    image = sample_images()[KEPT_IMAGE]
    span = grid_span(checkpoint, image)
    n_rows = wire.decode_tensor(span["embeds"]).shape[0]
    inline = helpers.body(span_segments(text, [span]), MAX_TOKENS, return_logprob=True, keep_spans=True)
    handle = {"type": "embeds", "embeds": {"handle": keys.content_key(wire.decode_tensor(span["embeds"]))},
              "image_grid_thw": span["image_grid_thw"]}
    by_handle = helpers.body(span_segments(text, [handle]), MAX_TOKENS)
    before = {pid: info["rows_to_scheduler"] for pid, info in _info_by_worker(url).items()}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        kept = list(pool.map(lambda _: multi_tokenizer_server.generate(inline), range(16)))
        again = list(pool.map(lambda _: multi_tokenizer_server.generate(by_handle), range(16)))
    assert all(r.status_code == 200 for r in kept), [r.text for r in kept if r.status_code != 200]
    expected = assert_matches_hf(kept[0].json(), checkpoint, text, [image], "kept span")
    assert all(r.json()["output_ids"] == expected for r in kept)
    served = [r for r in again if r.status_code == 200]  # a worker that got no inline request refuses
    assert served and all(r.json()["output_ids"] == expected for r in served)
    assert all(r.json()["type"] == keys.UNKNOWN_HANDLE_TYPE for r in again if r.status_code != 200)
    after = {pid: info["rows_to_scheduler"] for pid, info in _info_by_worker(url).items()}
    sent = {pid: after[pid]["rows_sent"] - before[pid]["rows_sent"] for pid in after}
    left_out = sum(after[pid]["rows_left_out"] - before[pid]["rows_left_out"] for pid in after)
    handled = {pid: sent[pid] + after[pid]["rows_left_out"] - before[pid]["rows_left_out"] for pid in after}
    assert all(rows > 0 for rows in handled.values()), f"both workers must have served span requests: {handled}"
    assert set(sent.values()) <= {0, n_rows} and sum(sent.values()) >= n_rows  # once per worker that kept it
    assert left_out == n_rows * (len(kept) + len(served)) - sum(sent.values())


def test_clips_through_both_workers_equal_hf(multi_tokenizer_server, checkpoint):
    """A Qwen3-VL clip (its frames' rows after their timestamps) sent to both workers at once."""
    _, ((width, height), _), seed = CLIP_FAMILIES["qwen3_vl_spans"]
    text = chat_text(checkpoint, QUESTIONS[0], 1).replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
    frames = sample_clip(4, width, height, seed=seed)
    clip = helpers.body(span_segments(text, [clip_span(checkpoint, frames, 2.0)]), MAX_TOKENS, return_logprob=True)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clips = list(pool.map(lambda _: helpers.generate(multi_tokenizer_server, clip), range(4)))
    assert_matches_hf(clips[0], checkpoint, text, [], "multi-tokenizer, a clip", clips=[(frames, 2.0)])
    assert all(o["output_ids"] == clips[0]["output_ids"] for o in clips)
