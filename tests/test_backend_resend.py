"""EmbedsEndpoint without a server: a span kept by the server goes by handle, and every stock call
that posts to /generate (gen, select's requests, the fork's prefix commit, streaming, run) is sent
again once with the rows inline when the server does not hold the handle."""

from __future__ import annotations

import base64
import functools
import json

import pytest
import torch
from sglang.lang.backend import runtime_endpoint
from sglang.lang.ir import SglSamplingParams

from sgl_embeds import backend as backend_module
from sgl_embeds import lang
from sgl_embeds_srt import keys, wire
from sgl_embeds_srt import segments as seg
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.writer import KeptSpans, SpanWriter

HIDDEN = 8


class FakeServer:
    """Answers like the plugin: a handle it does not hold is a 400 UnknownSpanHandle; inline rows
    with keep_spans are kept. Records every body."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.bodies: list[dict] = []

    def spans(self, body: dict) -> list:
        prompts = body["input_segments"]
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        return [s["embeds"] for p in prompts for s in p if s["type"] == "embeds"]

    def post(self, url, json=None, stream=False, **kwargs):
        self.bodies.append(json)
        for span in self.spans(json):
            if "handle" in span and span["handle"] not in self.held:
                return Reply(400, {"object": "error", "type": "UnknownSpanHandle", "param": span["handle"], "message": "unknown"})
            if "handle" not in span and json.get("keep_spans"):
                t = torch.frombuffer(bytearray(base64.b64decode(span["data"])), dtype=torch.float32)
                self.held.add(keys.span_handle(t.reshape(span["shape"])))
        n = len(json["input_segments"]) if isinstance(json["input_segments"][0], list) else 1
        one = {"text": "ok", "output_ids": [1], "meta_info": {"prompt_tokens": 3, "input_token_logprobs": [[-1.0, 5, "a"]] * 3,
                                                                "output_token_logprobs": [], "cached_tokens": 0}}
        return Reply(200, [one] * n if n > 1 or isinstance(json["input_segments"][0], list) else one, stream)


class Reply:
    def __init__(self, status: int, payload, stream: bool = False) -> None:
        self.status_code, self.payload, self.stream = status, payload, stream

    def json(self):
        return self.payload

    @property
    def text(self) -> str:
        return json.dumps(self.payload)

    def iter_lines(self, decode_unicode=False):
        yield ("data: " + json.dumps(self.payload)).encode()
        yield b"data: [DONE]"


@pytest.fixture
def endpoint(monkeypatch):
    server = FakeServer()
    # the stock calls post through our hook of their module's http_request, around the fake
    monkeypatch.setattr(runtime_endpoint, "http_request", functools.partial(backend_module.post_stock_body, server.post))
    monkeypatch.setattr(backend_module, "http_request", server.post)
    ep = EmbedsEndpoint.__new__(EmbedsEndpoint)  # no server to ask for its info
    ep.base_url, ep.api_key, ep.verify, ep.hidden_size = "http://fake", None, None, HIDDEN
    ep.writer = SpanWriter(HIDDEN, kept=KeptSpans())
    ep.sends_binary = False  # JSON bodies, which the fake reads
    return ep, server


class Executor:
    """The parts of a StreamExecutor the backend reads."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.images_ = []
        self.sgl_embeds_spans = lang.ProgramSpans(table={0: seg.Embeds(rows)})
        self.text_ = "look " + seg.marker(0) + " now"


def _kinds(server: FakeServer, since: int) -> list[str]:
    return ["handle" if "handle" in server.spans(b)[0] else "inline+keep" if b.get("keep_spans") else "inline"
            for b in server.bodies[since:]]


@pytest.mark.parametrize("call", ["generate", "select", "commit", "stream", "run"])
def test_every_call_goes_by_handle_and_is_resent_inline_once_when_refused(endpoint, call):
    ep, server = endpoint
    rows = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    s = Executor(rows)

    def do():
        if call == "generate":
            ep.generate(s, SglSamplingParams(max_new_tokens=1))
        elif call == "select":
            ep._generate_http_request(s, {"text": [s.text_ + c for c in ("a", "b")], "sampling_params": {}})
        elif call == "commit":
            ep.commit_lazy_operations(s)
        elif call == "stream":
            list(ep.generate_stream(s, SglSamplingParams(max_new_tokens=1)))
        else:
            ep.run(input_segments=[seg.Text("look"), seg.Embeds(rows)])

    do()
    assert _kinds(server, 0) == ["inline+keep"]  # first time: rows inline, kept
    do()
    assert _kinds(server, 1) == ["handle"]  # sent before: by handle only
    server.held.clear()  # the server lost it (evicted, or another worker behind a gateway)
    do()
    assert _kinds(server, 2) == ["handle", "inline+keep"]  # refused once, resent inline
    assert server.bodies[-1]["text"].endswith(keys.ROUTE_TAG)  # the routing hint rides along


def test_the_resend_carries_every_span_of_the_request_inline(endpoint):
    ep, server = endpoint
    a, b = torch.ones(2, HIDDEN), torch.zeros(1, HIDDEN)
    prompt = [seg.Embeds(a), seg.Text(" and "), seg.Embeds(b)]
    ep.run(input_segments=prompt)
    server.held.clear()
    ep.run(input_segments=prompt)
    refused, resent = server.bodies[1:]
    assert [set(span) for span in server.spans(refused)] == [{"handle"}, {"handle"}]
    assert all("data" in s for s in server.spans(resent)) and resent["keep_spans"] is True


def test_other_refusals_are_not_resent(endpoint, monkeypatch):
    ep, server = endpoint
    s = Executor(torch.ones(1, HIDDEN))

    def refuse(url, json=None, **kwargs):
        server.bodies.append(json)
        return Reply(400, {"object": "error", "type": "BadRequest", "message": "no"})

    monkeypatch.setattr(runtime_endpoint, "http_request", refuse)
    with pytest.raises(RuntimeError, match="no"):
        ep.commit_lazy_operations(s)
    assert len(server.bodies) == 1


def test_the_memo_of_kept_spans_is_bounded_by_entries():
    kept = KeptSpans(max_entries=2)
    rows = [torch.full((1, HIDDEN), float(i)) for i in range(3)]
    writer = SpanWriter(HIDDEN, kept=kept)
    for r in rows:
        writer.fields("input_segments", [[seg.Embeds(r)]], batch=False)
    assert kept.sizes()[0] == 2 and KeptSpans.key(rows[0]) not in kept and KeptSpans.key(rows[2]) in kept


def test_a_first_send_reads_its_rows_once_and_a_repeat_is_not_checked_again(monkeypatch):
    """With kept spans, a span's handle, routing hint and values check come from one native pass
    over its rows as sent (``keys.checked_row_digests``), whose check runs on the wire dtype too;
    a repeat is the same bytes, checked when first sent: by handle, no pass, no check."""
    passes, checks = [], []
    real_pass, real_check = keys.checked_row_digests, wire.check_tensor
    monkeypatch.setattr(keys, "checked_row_digests", lambda t: passes.append(t.shape) or real_pass(t))
    monkeypatch.setattr(wire, "check_tensor", lambda *a: checks.append(1) or real_check(*a))
    writer = SpanWriter(HIDDEN, kept=KeptSpans())
    rows = torch.randn(5, HIDDEN)
    first = writer.fields("input_segments", [[seg.Embeds(rows)]], batch=False)
    again = writer.fields("input_segments", [[seg.Embeds(rows.clone())]], batch=False)
    assert passes == [(5, HIDDEN)] and checks == []
    assert again["input_segments"][0]["embeds"] == {"handle": keys.span_handle(rows)} and first["text"] == again["text"]
    bad = rows.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"segment 0: embeddings contain NaN or Inf as sent, in float32 \(first in row 3\)"):
        writer.fields("input_segments", [[seg.Embeds(bad)]], batch=False)
    big = rows.clone()
    big[2, 0] = 1e5  # finite, but not in float16: caught on the rows as the server would decode them
    with pytest.raises(ValueError, match=r"NaN or Inf as sent, in float16 \(first in row 2\)"):
        SpanWriter(HIDDEN, wire_dtype="float16", kept=KeptSpans()).fields("input_segments", [[seg.Embeds(big)]], batch=False)
