"""Spans in multi-tokenizer mode (``--tokenizer-worker-num 2``): SGLang serves HTTP from several
worker processes that each import the app anew; the plugin installs itself in every one."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

import helpers
from helpers import body, generate, seeded_rows, span, text


@pytest.fixture(scope="module")
def multi_tokenizer_server(llama_dir, servers):
    servers.make_room(1)
    server = helpers.start_multi_tokenizer(llama_dir, ["--enable-cache-report"])
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


def test_span_prompts_work_through_every_tokenizer_worker(multi_tokenizer_server, llama_server):
    url = multi_tokenizer_server.url
    _info_by_worker(url)  # both workers answer with the plugin

    prompts = [[text(f"item {i}:"), span(seeded_rows(1601 + i % 4, 6)), text(" is")] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(multi_tokenizer_server, body(p, 6)), prompts))
    # the same prompts on a one-worker server of the same model give the same tokens
    assert [o["output_ids"] for o in outs] == [generate(llama_server, body(p, 6))["output_ids"] for p in prompts]
    chat = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                  {"type": "input_embeds", "input_embeds": span(seeded_rows(1601, 6))["embeds"]}]}]})
    assert chat.status_code == 200, chat.text
    bad = multi_tokenizer_server.generate(body([span(seeded_rows(1, 2, hidden=32))], 2))
    assert bad.status_code == 400 and "hidden size 32" in bad.json()["message"]


def test_a_kept_span_crosses_once_per_worker_to_the_one_scheduler(multi_tokenizer_server, llama_server):
    """Each HTTP worker keeps the span and hands its rows to the shared scheduler once; the
    scheduler's copy serves both (srt/transport.py: one copy, a keeper per worker)."""
    from sgl_embeds_srt import keys

    url, rows = multi_tokenizer_server.url, seeded_rows(1611, 12)
    inline = body([text("the"), span(rows), text(" is")], 6, keep_spans=True)
    by_handle = body([text("the"), {"type": "embeds", "embeds": {"handle": keys.content_key(rows)}}, text(" is")], 6)
    expected = generate(llama_server, body([text("the"), span(rows), text(" is")], 6))["output_ids"]
    before = {pid: info["rows_to_scheduler"] for pid, info in _info_by_worker(url).items()}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        kept = list(pool.map(lambda _: multi_tokenizer_server.generate(inline), range(16)))
        again = list(pool.map(lambda _: multi_tokenizer_server.generate(by_handle), range(16)))
    assert all(r.status_code == 200 and r.json()["output_ids"] == expected for r in kept)
    served = [r for r in again if r.status_code == 200]  # a worker that got no inline request refuses
    assert served and all(r.json()["output_ids"] == expected for r in served)
    assert all(r.json()["type"] == keys.UNKNOWN_HANDLE_TYPE for r in again if r.status_code != 200)
    after = {pid: info["rows_to_scheduler"] for pid, info in _info_by_worker(url).items()}
    sent = {pid: after[pid]["rows_sent"] - before[pid]["rows_sent"] for pid in after}
    left_out = sum(after[pid]["rows_left_out"] - before[pid]["rows_left_out"] for pid in after)
    handled = {pid: sent[pid] + after[pid]["rows_left_out"] - before[pid]["rows_left_out"] for pid in after}
    assert all(rows > 0 for rows in handled.values()), f"both workers must have served span requests: {handled}"
    assert set(sent.values()) <= {0, 12} and sum(sent.values()) >= 12  # once per worker that kept it
    assert left_out == 12 * (len(kept) + len(served)) - sum(sent.values())
