"""A bounded load test on loopback: 64 concurrent clients mixing text, full-prompt embeddings and
interleaved prompts, with streaming and client aborts. Zero 5xx, every completed greedy output
equal to the same request run alone, and the KV pool back to its baseline afterwards."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

from helpers import span, text
from sgl_embeds_protocol import wire

CLIENTS, PER_CLIENT, DISTINCT, NEW_TOKENS, TIME_LIMIT_S = 64, 3, 16, 8, 300


def _prompt(i: int) -> dict:
    rows = torch.randn(4 + i % 5, 64, generator=torch.Generator().manual_seed(900 + i)) * 0.05
    sp = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    kind = i % 3
    if kind == 0:
        return {"text": f"the red fox {i} near the house", "sampling_params": sp}
    if kind == 1:
        return {"input_embeds": wire.encode_tensor(rows, "base64", "float16"), "sampling_params": sp}
    return {"input_segments": [text(f"look {i}"), span(rows), text(" is")], "sampling_params": sp}


def _used_tokens(url: str) -> int:
    loads = requests.get(url + "/v1/loads", params={"include": "core,memory"}, timeout=30).json()["loads"]
    return sum(int(l["num_used_tokens"]) for l in loads)


def _idle(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"]
        if all(l["num_running_reqs"] == 0 and l["num_waiting_reqs"] == 0 for l in loads):
            return
        time.sleep(0.5)
    raise AssertionError("server did not drain")


def _flush(url: str) -> None:
    _idle(url)
    r = requests.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text


def test_mixed_concurrent_load_with_aborts(llama_server):
    url = llama_server.url
    prompts = [_prompt(i) for i in range(DISTINCT)]
    alone = [requests.post(url + "/generate", json=p, timeout=60).json()["output_ids"] for p in prompts]
    _flush(url)
    baseline = _used_tokens(url)
    deadline = time.monotonic() + TIME_LIMIT_S
    statuses, mismatches, aborted = [], [], 0

    def client(c: int) -> int:
        aborts = 0
        for k in range(PER_CLIENT):
            assert time.monotonic() < deadline, "load test exceeded its time limit"
            i = (c * PER_CLIENT + k) % DISTINCT
            mode = (c + k) % 4
            if mode == 3:  # stream, and hang up after the first chunk
                with requests.post(url + "/generate", json={**prompts[i], "stream": True}, stream=True, timeout=60) as r:
                    statuses.append(r.status_code)
                    next(r.iter_lines(), None)
                aborts += 1
            elif mode == 2:  # stream to the end
                with requests.post(url + "/generate", json={**prompts[i], "stream": True}, stream=True, timeout=60) as r:
                    statuses.append(r.status_code)
                    last = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith(b"data: {")][-1]
                if last["output_ids"] != alone[i]:
                    mismatches.append((i, last["output_ids"], alone[i]))
            else:
                r = requests.post(url + "/generate", json=prompts[i], timeout=60)
                statuses.append(r.status_code)
                if r.status_code == 200 and r.json()["output_ids"] != alone[i]:
                    mismatches.append((i, r.json()["output_ids"], alone[i]))
        return aborts

    with ThreadPoolExecutor(CLIENTS) as pool:
        aborted = sum(pool.map(client, range(CLIENTS)))
    assert len(statuses) == CLIENTS * PER_CLIENT and aborted > 0
    assert not [s for s in statuses if s >= 500], statuses
    assert all(s == 200 for s in statuses)
    assert not mismatches, mismatches[:3]
    _flush(url)
    assert _used_tokens(url) == baseline
