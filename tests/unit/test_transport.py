"""The rows' trip to the scheduler (srt/transport.py), without a server: SGLang's socket is a
pickle round trip, the scheduler's ``reconstruct`` call is made as SGLang makes it."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.embed_types import PositionalEmbeds

from sgl_embeds_srt import scheduler, transport
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE
from sgl_embeds_srt.prompts import ModelSpec, build_ids
from sgl_embeds_protocol.segments import Span
from sgl_embeds_srt.transport import PromptRows, RowsOnTheWire, RowsTransport, SchedulerRows

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
    prompt_rows = PromptRows.from_spans([r for r, _ in spans], [h for _, h in spans], positions)
    return SimpleNamespace(positional_embed_overrides=prompt_rows)


@pytest.fixture
def held(monkeypatch) -> SchedulerRows:
    """The scheduler process's store, fresh for each test."""
    monkeypatch.setattr(transport, "_SCHEDULER_ROWS", SchedulerRows())
    return transport._SCHEDULER_ROWS


class Link:
    """One HTTP process's transport and a scheduler, joined by a pickling 'socket'."""

    def __init__(self, budget: int = 1 << 30) -> None:
        self.http = RowsTransport(StockTransport(), on=True, budget=budget)
        self.wire_bytes: list[int] = []

    def send(self, *reqs: SimpleNamespace) -> list:
        """Dispatch ``reqs`` as one message; the scheduler's view of each request's overrides."""
        self.http.prepare_for_dispatch(reqs)
        raw = pickle.dumps([r.positional_embed_overrides for r in reqs], protocol=pickle.HIGHEST_PROTOCOL)
        self.wire_bytes.append(len(raw))
        arrived = pickle.loads(raw)
        for prompt_rows in arrived:
            prompt_rows.reconstruct(0)  # as the scheduler does, first thing
        return arrived


def test_a_held_span_crosses_once_then_goes_by_handle(held):
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


SPEC = ModelSpec(hidden_size=HIDDEN, dtype=torch.float32, vocab_size=1000, context_len=4096, tokenizer=None)


def inline(t: torch.Tensor) -> SimpleNamespace:
    """A request of one span sent inline (not kept), as the HTTP process builds it."""
    return SimpleNamespace(positional_embed_overrides=build_ids([Span(t)], SPEC)[1])


def test_a_span_sent_inline_again_crosses_once(held, monkeypatch):
    """Not kept by handle, a span still has a content key (the same hash of its rows as sent), so
    the same rows inline again, from any client, do not cross again."""
    link = Link()
    monkeypatch.setattr(transport, "_TRANSPORTS", [link.http])
    a = rows(64, 21)
    assert torch.equal(link.send(inline(a))[0].embeds, a)
    assert torch.equal(link.send(inline(a.clone()))[0].embeds, a)
    assert link.wire_bytes[1] < link.wire_bytes[0] / 5
    other = a.clone()
    other[5, 3] += 1
    assert torch.equal(link.send(inline(other))[0].embeds, other)
    assert link.http.stats()["rows_sent"] == 128 and link.http.stats()["rows_left_out"] == 64


def test_rows_whose_cast_is_exact_cross_as_sent(held, monkeypatch):
    """bfloat16 rows to a float32 model cross as bfloat16 (half the bytes; SGLang's model runner
    casts the rows it runs) and the scheduler holds them so, alone or beside float32 rows."""
    link = Link()
    monkeypatch.setattr(transport, "_TRANSPORTS", [link.http])
    a, b = rows(256, 22).bfloat16(), rows(256, 23)
    crossed = link.send(inline(a))[0].embeds
    assert crossed.dtype == torch.bfloat16 and torch.equal(crossed, a)
    assert link.wire_bytes[0] < 256 * HIDDEN * 2 + 1024 and held.sizes() == (1, 256 * HIDDEN * 2)
    both = SimpleNamespace(positional_embed_overrides=build_ids([Span(a), Span(b)], SPEC)[1])
    mixed = link.send(both)[0].embeds  # a from the scheduler, b crossed: promoted, exactly
    assert mixed.dtype == torch.float32 and torch.equal(mixed, torch.cat([a.float(), b]))


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
    assert held.sizes()[0] == 2 and link.http.stats()["held_bytes"] == link.http.budget  # span-1 and span-0
    for h in ["span-2", "span-0", "span-1", "span-2"]:  # every order keeps both sides in step
        assert torch.equal(link.send(request([(spans[h], h)]))[0].embeds, spans[h])
    assert held.sizes()[0] == 2  # exactly what the HTTP side keeps: the budget


def test_a_span_over_the_budget_is_still_held_alone(held):
    link = Link(budget=4 * HIDDEN * 4)  # one span of 4 rows
    big = rows(8, 11)
    link.send(request([(big, "span-big")]))
    assert (link.http.stats()["held_spans"], link.http.stats()["held_bytes"]) == (1, 8 * HIDDEN * 4)
    assert torch.equal(link.send(request([(big, "span-big")]))[0].embeds, big)
    assert link.http.stats()["rows_left_out"] == 8
    link.send(request([(rows(1, 12), "span-small")]))  # the big one makes way, on both sides
    assert link.http.stats()["held_spans"] == 1 and held.sizes() == (1, 1 * HIDDEN * 4)


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
    prompt_rows = link.send(request([(a, "span-a")]))[0]
    assert prompt_rows.embeds is None and prompt_rows.missing == "span-a"
    req = scheduler_req(prompt_rows, [PLACEHOLDER_BASE] * 4)
    assert req.positional_embed_overrides is None and "without its rows" in req.aborted


def scheduler_req(overrides, ids: list[int]) -> SimpleNamespace:
    """SGLang's ``Req`` as ``scheduler.req_init`` finds it after the stock ``__init__``."""
    req = SimpleNamespace(positional_embed_overrides=overrides, origin_input_ids=ids, vocab_size=100,
                          input_embeds=None, bootstrap_host=None, skip_radix_cache_insert=True,
                          aborted=None)
    req.set_finish_with_abort = lambda message: setattr(req, "aborted", message)
    scheduler.req_init(lambda self: None, req)
    return req


def test_a_span_prompt_is_one_whose_every_override_position_holds_a_placeholder(held):
    """Recorded on the request's own carrier (a new one: requests may share what arrived), also
    when the rows came as SGLang's own ``PositionalEmbeds`` (transport off); only then does the
    request keep the radix cache."""
    a = rows(2, 10)
    spans = Link().send(request([(a, "span-a")]))[0]
    stock = PositionalEmbeds(a, [1, 2])
    for arrived, positions in [(spans, [0, 1]), (stock, [1, 2])]:
        ids = [5, 6, 7]
        for p in positions:
            ids[p] = PLACEHOLDER_BASE + p
        req = scheduler_req(arrived, ids)
        assert scheduler.is_span_prompt(req) and not req.skip_radix_cache_insert
        assert req.aborted is None and req.positional_embed_overrides is not arrived
        assert torch.equal(req.positional_embed_overrides.embeds, a)
        stock_prompt = scheduler_req(arrived, [5, 6, 7])  # overrides over tokens: stock, uncached
        assert not scheduler.is_span_prompt(stock_prompt) and stock_prompt.skip_radix_cache_insert
        assert stock_prompt.positional_embed_overrides is arrived and scheduler.is_span_prompt(req)
        ids[positions[1]] = 3  # one override position holds a token: no span prompt, and its
        mixed = scheduler_req(arrived, ids)  # placeholder id cannot be looked up
        assert not scheduler.is_span_prompt(mixed) and "outside the vocabulary" in mixed.aborted


def test_off_or_without_keys_the_rows_go_as_stock_overrides():
    a = rows(3, 9)
    off = RowsTransport(StockTransport(), on=False, budget=1 << 20)
    req = request([(a, "span-a")])
    off.prepare_for_dispatch([req])
    arrived = pickle.loads(pickle.dumps(req.positional_embed_overrides))
    assert type(arrived) is PositionalEmbeds and torch.equal(arrived.embeds, a)
    on = RowsTransport(StockTransport(), on=True, budget=1 << 20)
    req = request([(a, None)])
    on.prepare_for_dispatch([req])
    assert type(req.positional_embed_overrides) is PositionalEmbeds
    assert req.positional_embed_overrides.embeds.rows is a  # not copied before the socket


def test_rows_cross_as_their_bytes_and_arrive_as_a_tensor():
    for t in (rows(5, 30), rows(3, 31).bfloat16(), rows(4, 32)[:, :3], torch.zeros(0, HIDDEN)):
        for protocol in (4, 5):  # SGLang's socket pickles with the default (4 on Python 3.11)
            wire_form = pickle.dumps(RowsOnTheWire(t), protocol=protocol)
            assert len(wire_form) < t.numel() * t.element_size() + 300  # the bytes and a little
            back = pickle.loads(wire_form)
            assert isinstance(back, torch.Tensor) and back.dtype == t.dtype and torch.equal(back, t)
    back = pickle.loads(pickle.dumps(RowsOnTheWire(rows(2, 33))))
    back += 1  # writable, as SGLang's own overrides are
    cuda_like = SimpleNamespace(is_cuda=True)
    assert RowsOnTheWire.wrap(cuda_like) is cuda_like  # not a CPU tensor: SGLang's CUDA IPC takes it


def test_the_scheduler_keeps_rows_that_crossed_alone_without_a_copy(held):
    """One span's rows arrive as a tensor of their own: kept as they are. Two spans in one
    message share the message's storage: each is kept as a copy of its own rows only."""
    link = Link()
    a, b, c = rows(40, 41), rows(7, 42), rows(9, 43)
    arrived = link.send(request([(a, "span-a")]))[0]
    assert held._rows["span-a"].data_ptr() == arrived.embeds.data_ptr()
    link.send(request([(b, "span-b"), (c, "span-c")]))
    for key, t in (("span-b", b), ("span-c", c)):
        kept = held._rows[key]
        assert torch.equal(kept, t) and kept.untyped_storage().nbytes() == t.nbytes
