"""The rows' trip from the HTTP process to the scheduler: a kept span's rows go once, then its handle.

SGLang pickles a request's ``PositionalEmbeds`` to the scheduler with every request: at 4096 rows
of the demo model that is 9.4 MB, pickled, copied and unpickled each time, though a span sent by
handle is the same rows every time and its positions are usually all in the radix cache. Here a
span that the HTTP process keeps by handle (``handles.SpanStore``) crosses once per scheduler:

* HTTP side: ``prompts.build_ids`` makes ``SpanEmbeds`` (SGLang's ``PositionalEmbeds`` plus the
  handle and row count of each span). ``HandleTransport`` wraps SGLang's own dispatch transport
  (``TokenizerManager.positional_embeds_transport``); just before a request is sent it drops
  the rows of every span it has sent before, and notes the spans whose rows now go.
* Scheduler side: SGLang calls ``reconstruct`` on every request's overrides first thing when it
  arrives (``Scheduler.process_input_requests``); ``SpanEmbeds.reconstruct`` keeps the rows that
  came with a handle and puts back the ones that did not come.

Both ends stay in step because requests from one HTTP process reach the scheduler in the order
they were sent, over one socket. The HTTP side bounds what the scheduler holds from it (an LRU of
``SGL_EMBEDS_HANDLE_BYTES``, like the store) and tells it, on its next request, which spans to
let go (evicted there, or deleted from the store). Only
with SGLang's pickle IPC (the default), one data-parallel rank and one pipeline stage (the
scheduler that receives is then the one that serves); otherwise every request carries its rows.
``SGL_EMBEDS_ROWS_BY_HANDLE=0`` turns it off (benchmarks compare). A span the scheduler should
hold but does not (a bug, never expected) aborts that request only: ``scheduler.abort_unlookupable``.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch
from sglang.srt.managers.embed_types import PositionalEmbeds


class SpanEmbeds(PositionalEmbeds, array_like=True):
    """``PositionalEmbeds`` whose rows are a sequence of spans, each kept by handle or not.

    ``handles[i]`` / ``lengths[i]``: span i's handle (None: not kept) and row count, in prompt
    order. On the wire ``sent[i]`` says whether span i's rows are in ``embeds`` (the sent spans'
    rows, concatenated) or held by the scheduler; ``sender`` names the HTTP process and
    ``released`` lists handles it no longer keeps. ``missing`` is set, and ``embeds`` is None,
    when the scheduler does not hold a span it was told it holds."""

    handles: list = []
    lengths: list = []
    sent: list = []
    sender: str = ""
    released: list = []
    missing: str = ""

    def __post_init__(self) -> None:
        if all(self.sent):  # PositionalEmbeds' check of one row per position, once all rows are here
            super().__post_init__()

    def reconstruct(self, target_device: int) -> None:
        if self.sender:
            _SCHEDULER_ROWS.restore(self)
        super().reconstruct(target_device)


def span_embeds(rows: list[torch.Tensor], positions: list[int], handles: list[str | None]) -> SpanEmbeds:
    """The overrides of one prompt: its spans' rows (in the model's dtype) in prompt order."""
    embeds = rows[0] if len(rows) == 1 else torch.cat(rows)  # a kept span's rows are not copied
    return SpanEmbeds(embeds, positions, handles=handles, lengths=[r.shape[0] for r in rows])


class SchedulerRows:
    """Scheduler side: the rows of kept spans by handle, and which HTTP processes keep each."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        self._keepers: dict[str, set[str]] = {}

    def restore(self, pe: SpanEmbeds) -> None:
        """Put the held rows back into ``pe`` (in place), keep the rows that came with a handle,
        then let go what the sender let go (after: it may have let go a span this request uses)."""
        n_sent = sum(pe.sent)
        parts, offset = [], 0
        for handle, length, was_sent in zip(pe.handles, pe.lengths, pe.sent):
            if was_sent:
                part = pe.embeds if n_sent == 1 else pe.embeds[offset:offset + length]
                offset += length
                if handle is not None:
                    self._keep(pe.sender, handle, part)
            else:
                part = self._rows.get(handle)
                if part is None or part.shape[0] != length:
                    pe.embeds, pe.missing = None, handle
                    break
            parts.append(part)
        else:
            pe.embeds = parts[0] if len(parts) == 1 else torch.cat(parts)
        for handle in pe.released:
            self._release(pe.sender, handle)

    def _keep(self, sender: str, handle: str, rows: torch.Tensor) -> None:
        if handle not in self._rows:
            self._rows[handle] = rows if rows._base is None else rows.clone()  # not a view of more
        self._keepers.setdefault(handle, set()).add(sender)

    def _release(self, sender: str, handle: str) -> None:
        keepers = self._keepers.get(handle)
        if keepers is None:
            return
        keepers.discard(sender)
        if not keepers:
            del self._keepers[handle], self._rows[handle]

    def sizes(self) -> tuple[int, int]:
        """(spans, bytes) held."""
        return len(self._rows), sum(t.numel() * t.element_size() for t in self._rows.values())


_SCHEDULER_ROWS = SchedulerRows()  # one per scheduler process


def enabled(server_args: Any) -> bool:
    from sglang.srt.environ import envs

    return (os.environ.get("SGL_EMBEDS_ROWS_BY_HANDLE", "1") != "0" and envs.SGLANG_USE_PICKLE_IPC.get()
            and getattr(server_args, "dp_size", 1) == 1 and getattr(server_args, "pp_size", 1) == 1)


class HandleTransport:
    """HTTP side: wraps SGLang's ``PositionalEmbedsTransport``; sends a kept span's rows once.

    The tokenizer manager calls ``prepare_for_dispatch`` right before a send (no await between)
    and ``cancel_for_dispatch`` if the send failed. Which spans the scheduler holds from this
    process is an LRU bounded like the handle store (``SGL_EMBEDS_HANDLE_BYTES``): what it lets
    go, the scheduler lets go too, so the scheduler never keeps more than that per HTTP process."""

    def __init__(self, stock: Any, on: bool, budget: int) -> None:
        self.stock = stock
        self.on = on
        self.budget = budget
        self.sender = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._held: OrderedDict[str, int] = OrderedDict()  # handle -> bytes the scheduler holds
        self._held_bytes = 0
        self._released: list[str] = []  # for the scheduler, on the next send
        self._lock = threading.Lock()
        self.rows_sent = self.rows_left_out = 0  # span rows of dispatched requests

    def release(self, handle: str) -> None:
        """Let the scheduler drop ``handle``'s rows (deleted from the handle store)."""
        with self._lock:
            self._let_go(handle)

    def stats(self) -> dict:
        with self._lock:
            return {"on": self.on, "rows_sent": self.rows_sent, "rows_left_out": self.rows_left_out,
                    "held_spans": len(self._held), "held_bytes": self._held_bytes, "budget": self.budget}

    def _let_go(self, handle: str) -> None:
        size = self._held.pop(handle, None)
        if size is not None:
            self._held_bytes -= size
            self._released.append(handle)

    def _hold(self, handle: str, size: int) -> None:
        self._held[handle] = size
        self._held_bytes += size
        while self._held_bytes > self.budget and len(self._held) > 1:
            self._let_go(next(iter(self._held)))

    def prepare_for_dispatch(self, tokenized_objs: Iterable) -> list:
        objs = list(tokenized_objs)
        changes = []
        with self._lock:
            for obj in objs:
                pe = obj.positional_embed_overrides
                if isinstance(pe, SpanEmbeds):
                    obj.positional_embed_overrides, change = self._for_wire(pe)
                    changes.append(change)
        return [_Prepared(changes, self.stock.prepare_for_dispatch(objs))]

    def cancel_for_dispatch(self, prepared: list) -> None:
        """The send failed: the scheduler got none of it. What this send would have made it hold
        is released on a later send too (it may have held some of it before)."""
        for p in prepared:
            with self._lock:
                for newly_held, released in p.changes:
                    for handle in newly_held:
                        self._held_bytes -= self._held.pop(handle, 0)
                    self._released[:0] = released + newly_held
            self.stock.cancel_for_dispatch(p.stock)

    def _for_wire(self, pe: SpanEmbeds) -> tuple[PositionalEmbeds, tuple[list[str], list[str]]]:
        """A new object (requests may share one): rows of spans the scheduler holds left out."""
        if not self.on or not any(pe.handles):
            self.rows_sent += len(pe.positions)
            return PositionalEmbeds(pe.embeds, pe.positions), ([], [])
        parts, sent, newly_held, offset = [], [], [], 0
        for handle, length in zip(pe.handles, pe.lengths):
            rows = pe.embeds[offset:offset + length]
            offset += length
            go = handle is None or handle not in self._held
            if go:
                parts.append(rows)
                self.rows_sent += length
                if handle is not None:
                    self._hold(handle, rows.numel() * rows.element_size())
                    newly_held.append(handle)
            else:
                self._held.move_to_end(handle)
                self.rows_left_out += length
            sent.append(go)
        # a span let go and sent again is held again: not released (the scheduler releases after use)
        released = [h for h in self._released if h not in self._held]
        self._released = []
        # a new tensor of the rows that go (pickling a view would send the whole storage)
        embeds = pe.embeds if all(sent) else torch.cat(parts) if parts else None
        return SpanEmbeds(embeds, pe.positions, handles=pe.handles, lengths=pe.lengths, sent=sent,
                          sender=self.sender, released=released), (newly_held, released)


class _Prepared:
    """What one ``prepare_for_dispatch`` changed, to undo if the send fails."""

    def __init__(self, changes: list, stock: list) -> None:
        self.changes, self.stock = changes, stock  # changes: (newly held, released) per request


def init_positional_embeds_transport(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang sets up its transport in a tokenizer manager: wrap it (AROUND hook)."""
    from sgl_embeds_srt.handles import budget_bytes

    result = original(self, *args, **kwargs)
    self.positional_embeds_transport = HandleTransport(self.positional_embeds_transport,
                                                       enabled(self.server_args), budget_bytes())
    _TRANSPORTS.append(self.positional_embeds_transport)
    return result


_TRANSPORTS: list[HandleTransport] = []  # this process's (one per tokenizer manager)


def release(handle: str) -> None:
    """The HTTP process deleted ``handle`` from its span store: the scheduler may let it go."""
    for t in _TRANSPORTS:
        t.release(handle)


def stats() -> dict | None:
    """This process's transport (None before its tokenizer manager exists)."""
    return _TRANSPORTS[-1].stats() if _TRANSPORTS else None
