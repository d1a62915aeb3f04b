"""Upload a span once, refer to it by handle: ``POST /sgl_embeds/spans`` and the ``SpanStore``.

``SpanStore`` keeps spans by content key (``keys.content_key``) with their row digests, bounded in
bytes (``SGLANG_EMBEDS_HANDLE_BYTES``, LRU); ``upload`` validates and stores one. A request naming a
handle the store does not hold gets ``UnknownSpanHandle`` (HTTP 400, the handle in ``"param"``),
and a client resends the span inline. Each tenant has its own (docs/reliability.md, "Tenants").
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from sgl_embeds_protocol import keys, wire
from sgl_embeds_protocol.environment import setting
from sgl_embeds_protocol.lru import LRU, rows_to_hold, nbytes
from sgl_embeds_protocol.segments import Span
from sgl_embeds_srt import tenants

PATH = "/sgl_embeds/spans"


BUDGET_VAR = "SGLANG_EMBEDS_HANDLE_BYTES"  # the bytes the handle store holds


def budget_bytes() -> int:
    return int(setting(BUDGET_VAR, 1 << 30))


class UnknownSpanHandle(wire.WireError):
    """A handle this server does not hold (never sent here, deleted, or evicted)."""

    def __init__(self, handle: Any) -> None:
        self.handle = str(handle)[:80]
        super().__init__(f"unknown span handle {self.handle!r}: never uploaded to this server, "
                         "deleted, or evicted; send the span's rows instead")


def _weight(span: Span) -> int:
    """What a held span holds: its rows' whole buffer (``put`` may keep a view) and digests."""
    return span.rows.untyped_storage().nbytes() + len(span.row_digests or b"")


# A span whose buffer holds at most this much more than its rows is held without a copy (a span
# decoded from base64, or the one span of a binary body: the buffer is the request's, with its
# head); any other is copied (lru.rows_to_hold).
_OWN_BUFFER_SLACK = 1 / 16


class SpanStore:
    """Held spans by content key (each a ``Span`` with its rows, content key and row digests),
    least recently used evicted first, at most ``budget`` bytes (rows and digests). With tenants
    (``tenants.py``) each tenant has its own handles and an equal share of the budget: one
    tenant's uploads never evict, and its handles never name, another's."""

    def __init__(self, budget: int, shares: int = 1) -> None:
        self.budget = budget // shares
        self._lrus: dict[str | None, LRU[Span]] = {}
        self._lock = threading.Lock()

    @property
    def _lru(self) -> LRU[Span]:
        """The current tenant's handles."""
        tenant = tenants.current()
        with self._lock:
            if tenant not in self._lrus:
                self._lrus[tenant] = LRU(self.budget, _weight)
            return self._lrus[tenant]

    def put(self, span: Span) -> Span:
        """Hold ``span`` (``keys.keyed``: its rows decoded from a request, nobody writes to them; a
        copy where they view a larger buffer, ``lru.rows_to_hold``) under its content key. The span
        as held: the same rows again give the same handle and refresh the held span."""
        t = span.rows.detach().contiguous()
        size = nbytes(t) + keys.ROW_DIGEST_BYTES * t.shape[0]
        if size > self.budget:
            raise ValueError(f"a span of {size} bytes exceeds the handle store's budget of "
                             f"{self.budget} bytes (the server's {BUDGET_VAR}, per tenant where "
                             "there are tenants)")
        span = keys.keyed(span)
        held = self._lru.get(span.content_key)
        if held is None:
            held = Span(rows_to_hold(t, _OWN_BUFFER_SLACK), span.content_key, span.row_digests)
            self._lru.put(span.content_key, held)
        return held

    def get(self, handle: Any) -> Span:
        held = self._lru.get(handle) if isinstance(handle, str) else None
        if held is None:
            raise UnknownSpanHandle(handle)
        return held

    def delete(self, handle: str) -> bool:
        return self._lru.pop(handle) is not None

    def stats(self) -> dict:
        count, size = self._lru.sizes()
        return {"count": count, "bytes": size, "budget": self.budget}


def upload(body: dict, store: SpanStore, check_width: Callable[[torch.Tensor], None]) -> dict:
    """Hold the span of an upload body; ``check_width``: the served model's check of its shape
    (``prompts.ModelSpec.check_width``)."""
    if set(body) != {"embeds"}:
        raise ValueError('upload a span as {"embeds": <tensor>}')
    t = wire.decode_tensor(body["embeds"], store.budget)
    check_width(t)
    handle = store.put(Span(t, row_digests=keys.finite_row_digests(t))).content_key
    return {"handle": handle, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "bytes": t.numel() * t.element_size()}
