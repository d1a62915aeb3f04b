"""Spans in multi-tokenizer mode (``--tokenizer-worker-num 2``): SGLang serves HTTP from several
worker processes that each import the app anew; the plugin installs itself in every one."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from helpers import body, generate, seeded_rows, span, text
from sgl_embeds.testing.server import Server


@pytest.fixture(scope="module")
def multi_tokenizer_server(llama_dir):
    server = Server(llama_dir, extra_args=["--tokenizer-worker-num", "2", "--enable-cache-report"]).start()
    yield server
    server.stop()


def test_span_prompts_work_through_every_tokenizer_worker(multi_tokenizer_server, llama_server):
    url = multi_tokenizer_server.url
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pids = set(pool.map(lambda _: requests.get(url + "/sgl_embeds/info", timeout=60).json()["http_worker_pid"], range(64)))
    assert len(pids) == 2, f"expected both tokenizer workers to answer, saw {pids}"

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
