"""Spans in multi-tokenizer mode (``--tokenizer-worker-num 2``): SGLang serves HTTP from several
worker processes that each import the app anew; the plugin installs itself in every one."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import requests

from helpers import body, generate, seeded_rows, span, text
from sgl_embeds.testing.server import Server


@pytest.fixture(scope="module")
def multi_tokenizer_server(llama_dir):
    # On a busy 2-core machine a worker's import can outlast uvicorn's 10 s health check of its
    # workers, which then replaces it: give it time, and wait until both have registered (the
    # server says it is ready once the first one has).
    server = Server(llama_dir, extra_args=["--tokenizer-worker-num", "2", "--enable-cache-report"],
                    env={"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "120"}).start()
    deadline = time.monotonic() + 180
    while "(total: 2)" not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline and server.alive(), server.log_tail()
        time.sleep(0.5)
    yield server
    server.stop()


def test_span_prompts_work_through_every_tokenizer_worker(multi_tokenizer_server, llama_server):
    url = multi_tokenizer_server.url
    pids: set[int] = set()
    for _ in range(20):  # which worker accepts a connection is up to the kernel: ask until both have
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pids |= set(pool.map(lambda _: requests.get(url + "/sgl_embeds/info", timeout=60).json()["http_worker_pid"], range(32)))
        if len(pids) == 2:
            break
        time.sleep(0.5)
    assert len(pids) == 2, f"expected both tokenizer workers to answer with the plugin, saw {pids}"

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
