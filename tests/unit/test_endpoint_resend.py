"""EmbedsEndpoint against a fake plugin worker over HTTP (no SGLang: ``tests/fake_server.py``): a
span held by the server goes by handle, and every stock call that posts to /generate (gen,
select's requests, the fork's prefix commit, streaming, run) is sent again once with the rows
inline when the server does not hold the handle."""

from __future__ import annotations

import pytest
import torch
from sglang.lang.ir import SglSamplingParams

from fake_server import FakePluginServer, kinds, spans_of
from sgl_embeds import lang
from sgl_embeds_protocol import keys, wire
from sgl_embeds_protocol import segments as seg
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.writer import HeldSpans, SpanWriter

HIDDEN = 8


@pytest.fixture
def endpoint():
    """An endpoint sending JSON bodies to a fake plugin worker over HTTP (``tests/fake_server.py``)."""
    with FakePluginServer(HIDDEN) as server:
        yield EmbedsEndpoint(server.url, chat_template_name="chatml", send_binary=False), server


class Executor:
    """The parts of a StreamExecutor the backend reads."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.images_ = []
        self.sgl_embeds_spans = lang.ProgramSpans(table={0: seg.Span(rows)})
        self.text_ = "look " + seg.marker(0) + " now"


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
            ep.run(input_segments=[seg.Text("look"), seg.Span(rows)])

    do()
    assert kinds(server.posts) == ["json: inline + keep"]  # first time: rows inline, kept
    do()
    assert kinds(server.posts[1:]) == ["json: handle"]  # sent before: by handle only
    server.held.clear()  # the server lost it (evicted, or another worker behind a gateway)
    do()
    assert kinds(server.posts[2:]) == ["json: handle", "json: inline + keep"]  # refused once, resent inline
    assert server.posts[-1][1]["text"].endswith(keys.ROUTE_TAG)  # the routing hint rides along


def test_the_resend_carries_every_span_of_the_request_inline(endpoint):
    ep, server = endpoint
    a, b = torch.ones(2, HIDDEN), torch.zeros(1, HIDDEN)
    prompt = [seg.Span(a), seg.Text(" and "), seg.Span(b)]
    ep.run(input_segments=prompt)
    server.held.clear()
    ep.run(input_segments=prompt)
    (_, refused), (_, resent) = server.posts[1:]
    assert [set(span) for span in spans_of(refused)] == [{"handle"}, {"handle"}]
    assert all("data" in s for s in spans_of(resent)) and resent["keep_spans"] is True


def test_other_refusals_are_not_resent():
    with FakePluginServer(HIDDEN, refusal={"object": "error", "type": "BadRequest", "message": "no"}) as server:
        ep = EmbedsEndpoint(server.url, chat_template_name="chatml", send_binary=False)
        with pytest.raises(RuntimeError, match="no"):
            ep.commit_lazy_operations(Executor(torch.ones(1, HIDDEN)))
        assert len(server.posts) == 1


def test_the_memo_of_kept_spans_is_bounded_by_entries():
    kept = HeldSpans(max_entries=2)
    rows = [torch.full((1, HIDDEN), float(i)) for i in range(3)]
    writer = SpanWriter(HIDDEN, held=kept)
    for r in rows:
        writer.fields("input_segments", [[seg.Span(r)]], batch=False)
    assert kept.sizes()[0] == 2 and HeldSpans.wire_hash(rows[0]) not in kept and HeldSpans.wire_hash(rows[2]) in kept


def test_a_first_send_reads_its_rows_once_and_a_repeat_is_not_checked_again(monkeypatch):
    """With kept spans, a span's handle, routing hint and values check come from one native pass
    over its rows as sent (``keys.digests_and_first_non_finite``), whose check runs on the wire dtype too;
    a repeat is the same bytes, checked when first sent: by handle, no pass, no check."""
    passes, checks = [], []
    real_pass, real_check = keys.digests_and_first_non_finite, wire.check_tensor
    monkeypatch.setattr(keys, "digests_and_first_non_finite", lambda t: passes.append(t.shape) or real_pass(t))
    monkeypatch.setattr(wire, "check_tensor", lambda *a: checks.append(1) or real_check(*a))
    writer = SpanWriter(HIDDEN, held=HeldSpans())
    rows = torch.randn(5, HIDDEN)
    first = writer.fields("input_segments", [[seg.Span(rows)]], batch=False)
    again = writer.fields("input_segments", [[seg.Span(rows.clone())]], batch=False)
    assert passes == [(5, HIDDEN)] and checks == []
    assert again["input_segments"][0]["embeds"] == {"handle": keys.content_key(rows)} and first["text"] == again["text"]
    bad = rows.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"segment 0: embeddings contain NaN or Inf as sent, in float32 \(first in row 3\)"):
        writer.fields("input_segments", [[seg.Span(bad)]], batch=False)
    big = rows.clone()
    big[2, 0] = 1e5  # finite, but not in float16: caught on the rows as the server would decode them
    with pytest.raises(ValueError, match=r"NaN or Inf as sent, in float16 \(first in row 2\)"):
        SpanWriter(HIDDEN, wire_dtype="float16", held=HeldSpans()).fields("input_segments", [[seg.Span(big)]], batch=False)
