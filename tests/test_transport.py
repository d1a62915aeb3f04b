"""The rows' trip to the scheduler (srt/transport.py), without a server: SGLang's socket is a
pickle round trip, the scheduler's ``reconstruct`` call is made as SGLang makes it."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from sgl_embeds_srt import scheduler, transport
from sgl_embeds_srt.transport import HandleTransport, SchedulerRows, SpanEmbeds, span_embeds

HIDDEN = 8


class StockTransport:
    """SGLang's own transport on a CPU machine: does nothing."""

    def __init__(self) -> None:
        self.cancelled = []

    def prepare_for_dispatch(self, objs):
        return []

    def cancel_for_dispatch(self, proxies):
        self.cancelled.append(proxies)


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def request(spans: list[tuple[torch.Tensor, str | None]]) -> SimpleNamespace:
    """A tokenized request whose prompt is its spans back to back."""
    positions = list(range(sum(r.shape[0] for r, _ in spans)))
    return SimpleNamespace(positional_embed_overrides=span_embeds([r for r, _ in spans], positions, [h for _, h in spans]))


@pytest.fixture
def held(monkeypatch) -> SchedulerRows:
    """The scheduler process's store, fresh for each test."""
    monkeypatch.setattr(transport, "_SCHEDULER_ROWS", SchedulerRows())
    return transport._SCHEDULER_ROWS


class Link:
    """One HTTP process's transport and a scheduler, joined by a pickling 'socket'."""

    def __init__(self, budget: int = 1 << 30) -> None:
        self.http = HandleTransport(StockTransport(), on=True, budget=budget)
        self.wire_bytes: list[int] = []

    def send(self, *reqs: SimpleNamespace) -> list:
        """Dispatch ``reqs`` as one message; the scheduler's view of each request's overrides."""
        self.http.prepare_for_dispatch(reqs)
        raw = pickle.dumps([r.positional_embed_overrides for r in reqs], protocol=pickle.HIGHEST_PROTOCOL)
        self.wire_bytes.append(len(raw))
        arrived = pickle.loads(raw)
        for pe in arrived:
            pe.reconstruct(0)  # as the scheduler does, first thing
        return arrived


def test_a_kept_span_crosses_once_then_goes_by_handle(held):
    link = Link()
    a, b = rows(512, 1), rows(3, 2)
    first = link.send(request([(a, "span-a"), (b, None)]))[0]
    assert torch.equal(first.embeds, torch.cat([a, b])) and first.positions == list(range(515))
    second = link.send(request([(a, "span-a"), (b, None)]))[0]
    assert torch.equal(second.embeds, torch.cat([a, b]))  # a from the scheduler, b sent again
    assert link.wire_bytes[1] < link.wire_bytes[0] / 5  # only b's rows crossed
    only_a = link.send(request([(a, "span-a")]))[0]
    assert torch.equal(only_a.embeds, a) and link.wire_bytes[2] < 512 * HIDDEN * 4 / 10
    assert link.http.stats()["rows_left_out"] == 1024 and link.http.stats()["rows_sent"] == 518
    assert held.sizes() == (1, 512 * HIDDEN * 4)


def test_two_requests_in_one_message_and_several_senders(held):
    a = rows(5, 3)
    one, two = Link(), Link()
    x, y = one.send(request([(a, "span-a")]), request([(a, "span-a")]))  # rows in the first only
    assert torch.equal(x.embeds, a) and torch.equal(y.embeds, a)
    assert torch.equal(two.send(request([(a, "span-a")]))[0].embeds, a)  # its own first send
    one.http.release("span-a")
    assert torch.equal(one.send(request([(rows(2, 4), "span-b")]))[0].embeds, rows(2, 4))
    assert held.sizes()[0] == 2  # a is still kept: the second sender holds it
    assert torch.equal(two.send(request([(a, "span-a")]))[0].embeds, a)
    two.http.release("span-a")
    two.send(request([(rows(1, 5), None)]))  # a plain request carries nothing for the scheduler
    assert held.sizes()[0] == 2
    two.send(request([(rows(1, 6), "span-c")]))
    assert held.sizes()[0] == 2  # a released by both (b, c kept)


def test_the_budget_bounds_what_the_scheduler_holds(held):
    link = Link(budget=2 * 4 * HIDDEN * 4)  # two spans of 4 rows
    spans = {h: rows(4, i) for i, h in enumerate(["span-0", "span-1", "span-2"])}
    for h, r in spans.items():
        assert torch.equal(link.send(request([(r, h)]))[0].embeds, r)
    # span-0 was let go when span-2 came; the scheduler drops it with the next send
    out = link.send(request([(spans["span-1"], "span-1"), (spans["span-0"], "span-0")]))[0]
    assert torch.equal(out.embeds, torch.cat([spans["span-1"], spans["span-0"]]))
    assert held.sizes()[0] <= 2 and link.http.stats()["held_bytes"] <= link.http.budget
    for h in ["span-2", "span-0", "span-1", "span-2"]:  # every order keeps both sides in step
        assert torch.equal(link.send(request([(spans[h], h)]))[0].embeds, spans[h])
    assert held.sizes()[0] <= 3


def test_a_failed_send_is_undone(held):
    link = Link()
    a = rows(4, 7)
    lost = request([(a, "span-a")])
    prepared = link.http.prepare_for_dispatch([lost])  # ... and the socket raised
    link.http.cancel_for_dispatch(prepared)
    assert link.http.stats()["held_spans"] == 0 and link.http.stock.cancelled == [[]]
    assert torch.equal(link.send(request([(a, "span-a")]))[0].embeds, a)  # the rows go again


def test_rows_the_scheduler_lacks_abort_that_request_only(held, monkeypatch):
    link = Link()
    a = rows(4, 8)
    link.send(request([(a, "span-a")]))
    monkeypatch.setattr(transport, "_SCHEDULER_ROWS", SchedulerRows())  # a scheduler that lost them (never expected)
    pe = link.send(request([(a, "span-a")]))[0]
    assert pe.embeds is None and pe.missing == "span-a"
    req = SimpleNamespace(positional_embed_overrides=pe, origin_input_ids=[1 << 62] * 4, vocab_size=100,
                          input_embeds=None, bootstrap_host=None, aborted=None)
    req.set_finish_with_abort = lambda message: setattr(req, "aborted", message)
    scheduler.req_init(lambda self: None, req)
    assert req.positional_embed_overrides is None and "without its rows" in req.aborted


def test_off_or_without_handles_the_rows_go_as_stock_overrides():
    from sglang.srt.managers.embed_types import PositionalEmbeds

    a = rows(3, 9)
    off = HandleTransport(StockTransport(), on=False, budget=1 << 20)
    req = request([(a, "span-a")])
    off.prepare_for_dispatch([req])
    assert type(req.positional_embed_overrides) is PositionalEmbeds and torch.equal(req.positional_embed_overrides.embeds, a)
    on = HandleTransport(StockTransport(), on=True, budget=1 << 20)
    req = request([(a, None)])
    on.prepare_for_dispatch([req])
    assert type(req.positional_embed_overrides) is PositionalEmbeds
    assert req.positional_embed_overrides.embeds is a  # not copied
