"""Spans with SGLang's metrics and radix-cache events (``--enable-metrics``, ZMQ KV events):
span requests are counted with their cached positions, and the events carry the span rows'
placeholder ids (>= 2**62) without choking the publisher."""

from __future__ import annotations

import re
import time

import msgspec
import requests
import zmq

from helpers import body, generate, seeded_rows, span, text
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE, placeholder_ids


def _counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def _metrics(server) -> str:
    r = requests.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def _stored_token_ids(sub: zmq.Socket, seconds: float) -> list[list[int]]:
    """``token_ids`` of every BlockStored event received within ``seconds``."""
    found, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)
        for event in batch[1]:
            if isinstance(event, dict) and event.get("type") == "BlockStored":
                found.append(event["token_ids"])
    return found


def test_span_requests_are_counted_and_published_with_their_placeholders(qwen_server):
    rows = seeded_rows(1501, 12)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{qwen_server.kv_events_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.5)  # a SUB socket sees only what is published after it joined
        before = _metrics(qwen_server)
        first = generate(qwen_server, body([text("Look:"), span(rows), text(" first")], 2))
        second = generate(qwen_server, body([text("Look:"), span(rows), text(" second")], 2))
        assert second["meta_info"]["cached_tokens"] >= 12
        stored = _stored_token_ids(sub, 5.0)
    finally:
        sub.close(linger=0)
    prompt = first["meta_info"]["prompt_tokens"] + second["meta_info"]["prompt_tokens"]
    cached = second["meta_info"]["cached_tokens"] + first["meta_info"]["cached_tokens"]
    deadline = time.monotonic() + 10
    while True:  # the scheduler's counters may land just after the response
        after = _metrics(qwen_server)
        counted = (_counter(after, "sglang:prompt_tokens_total") - _counter(before, "sglang:prompt_tokens_total"),
                   _counter(after, "sglang:cached_tokens_total") - _counter(before, "sglang:cached_tokens_total"))
        if counted == (prompt, cached) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counted == (prompt, cached)
    expected = placeholder_ids(rows)  # float32 model: the rows as sent
    published = [t for ids in stored for t in ids]
    assert all(p in published for p in expected), "the span's placeholder ids are in the stored blocks"
    assert {t for t in published if t >= PLACEHOLDER_BASE} == set(expected)  # no other row ids, none lost
    assert generate(qwen_server, body([text("still serving")], 2))["meta_info"]["prompt_tokens"] > 0
