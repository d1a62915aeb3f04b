"""The rows' trip from the HTTP process to the scheduler: a span's rows cross once.

``RowsTransport`` (HTTP side, around SGLang's ``positional_embeds_transport``) turns a request's
``PromptRows`` into ``CrossingRows``, leaving out the rows of every span the scheduler holds from
this process; ``SchedulerRows`` (scheduler side) holds rows by content key and puts them back.
Both ends move in step over one ordered socket; a span the scheduler should hold but does not
aborts that request alone. Why, its bound and when it is off (``enabled``): docs/architecture.md,
step 8.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import numpy as np
import torch
from sglang.srt.environ import envs
from sglang.srt.managers.embed_types import PositionalEmbeds

from sgl_embeds_srt.handles import budget_bytes
from sgl_embeds_protocol.keys import raw_bytes
from sgl_embeds_protocol.environment import setting
from sgl_embeds_protocol.lru import LRU, rows_to_hold, nbytes
from sgl_embeds_srt.prompt_rows import PromptRows, SpanRows


class CrossingRows(PositionalEmbeds, array_like=True):
    """A prompt's rows as they cross to the scheduler: SGLang's ``PositionalEmbeds`` whose rows
    are a sequence of spans, one ``prompt_rows.SpanRows`` each, in prompt order; ``embeds`` holds the rows
    of the spans sent, back to back. ``sender`` names the HTTP process and ``released`` lists the
    content keys it no longer holds. In the scheduler, ``reconstruct`` puts back the held rows;
    ``missing`` is set, and ``embeds`` is None, when the scheduler does not hold a span it was
    told it holds."""

    spans: list[SpanRows] = []
    sender: str = ""
    released: list[str] = []
    missing: str = ""

    def __post_init__(self) -> None:
        if all(s.sent for s in self.spans):  # PositionalEmbeds' check, once all rows are here
            super().__post_init__()

    def reconstruct(self, target_device: int) -> None:
        _SCHEDULER_ROWS.restore(self)
        super().reconstruct(target_device)


class RowsOnTheWire:
    """CPU rows as they cross: pickled as one flat numpy array of their bytes instead of by
    torch's tensor pickling (a serialization of the storage), and unpickled straight back to a
    tensor, so the scheduler sees rows as SGLang's own overrides have them. At 47 MB, with the
    protocol SGLang's socket uses (pickle's default): 55 + 27 ms against torch's 53 + 61, the
    scheduler's half (the load) more than halved. CUDA rows are left to SGLang's transport."""

    __slots__ = ("rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __reduce__(self) -> tuple:
        t = self.rows
        flat = np.frombuffer(raw_bytes(t), np.uint8)
        return _rows_from_bytes, (flat, str(t.dtype).removeprefix("torch."), tuple(t.shape))

    @staticmethod
    def wrap(rows: Any) -> Any:
        return RowsOnTheWire(rows) if isinstance(rows, torch.Tensor) and not rows.is_cuda else rows


def _rows_from_bytes(flat: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(flat).view(getattr(torch, dtype)).reshape(shape)


class SchedulerRows:
    """Scheduler side: the rows of spans by content key, and which HTTP processes hold each."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}
        self._holders: dict[str, set[str]] = {}

    def restore(self, crossing: CrossingRows) -> None:
        """Put the held rows back into ``crossing`` (in place), hold the rows sent with a content
        key, then let go what the sender let go (after: it may have let go a span this request
        uses)."""
        n_sent = sum(s.sent for s in crossing.spans)
        parts, offset = [], 0
        for span in crossing.spans:
            if span.sent:
                rows = crossing.embeds if n_sent == 1 else crossing.embeds[offset:offset + span.n_rows]
                offset += span.n_rows
                if span.content_key is not None:
                    self._hold(crossing.sender, span.content_key, rows)
            else:
                rows = self._rows.get(span.content_key)
                if rows is None or rows.shape[0] != span.n_rows:
                    crossing.embeds, crossing.missing = None, span.content_key
                    break
            parts.append(rows)
        else:
            crossing.embeds = parts[0] if len(parts) == 1 else torch.cat(parts)
        for content_key in crossing.released:
            self._release(crossing.sender, content_key)

    def _hold(self, sender: str, content_key: str, rows: torch.Tensor) -> None:
        if content_key not in self._rows:
            self._rows[content_key] = rows_to_hold(rows)  # a copy where it shares a message's rows
        self._holders.setdefault(content_key, set()).add(sender)

    def _release(self, sender: str, content_key: str) -> None:
        holders = self._holders.get(content_key)
        if holders is None:
            return
        holders.discard(sender)
        if not holders:
            del self._holders[content_key], self._rows[content_key]

    def sizes(self) -> tuple[int, int]:
        """(spans, bytes) held."""
        return len(self._rows), sum(nbytes(t) for t in self._rows.values())


_SCHEDULER_ROWS = SchedulerRows()  # one per scheduler process


def enabled(server_args: Any) -> bool:
    return (setting("SGLANG_EMBEDS_ROWS_BY_HANDLE", "1") != "0"
            and envs.SGLANG_USE_PICKLE_IPC.get()
            and server_args.dp_size == 1 and server_args.pp_size == 1)


@dataclass(frozen=True)
class _Prepared:
    """What one ``prepare_for_dispatch`` changed, to undo if the send fails."""

    changes: list[tuple[list[str], list[str]]]  # per request: (newly held, released)
    stock: list  # what SGLang's own transport prepared


class RowsTransport:
    """HTTP side: wraps SGLang's ``PositionalEmbedsTransport``; a held span's rows cross once.

    The tokenizer manager calls ``prepare_for_dispatch`` right before a send (no await between)
    and ``cancel_for_dispatch`` if the send failed. Which spans the scheduler holds from this
    process is an LRU bounded like the handle store (``SGLANG_EMBEDS_HANDLE_BYTES``): what it lets
    go, the scheduler lets go too, so the scheduler never holds more than that per HTTP process."""

    def __init__(self, stock: Any, on: bool, budget: int) -> None:
        self.stock = stock
        self.on = on
        self.sender = f"{os.getpid()}-{secrets.token_hex(4)}"
        # content key -> bytes the scheduler holds; one span over the budget is still held (alone)
        self._held: LRU[int] = LRU(budget, lambda size: size, keep_oversized=True,
                                   on_evict=lambda key, size: self._released.append(key))
        self._released: list[str] = []  # for the scheduler, on the next send
        self._lock = threading.Lock()
        self.rows_sent = self.rows_left_out = 0  # span rows of dispatched requests

    @property
    def budget(self) -> int:
        return self._held.budget

    def release(self, handle: str) -> None:
        """Let the scheduler drop ``handle``'s rows (deleted from the handle store)."""
        with self._lock:
            if self._held.pop(handle) is not None:
                self._released.append(handle)

    def stats(self) -> dict:
        with self._lock:
            held_spans, held_bytes = self._held.sizes()
            return {"on": self.on, "rows_sent": self.rows_sent,
                    "rows_left_out": self.rows_left_out, "held_spans": held_spans,
                    "held_bytes": held_bytes, "budget": self.budget}

    def prepare_for_dispatch(self, tokenized_objs: Iterable) -> list[_Prepared]:
        objs = list(tokenized_objs)
        changes = []
        with self._lock:
            for obj in objs:
                prompt_rows = obj.positional_embed_overrides
                if isinstance(prompt_rows, PromptRows):
                    obj.positional_embed_overrides, change = self._for_wire(prompt_rows)
                    changes.append(change)
        return [_Prepared(changes, self.stock.prepare_for_dispatch(objs))]

    def cancel_for_dispatch(self, prepared: list[_Prepared]) -> None:
        """The send failed: the scheduler got none of it. What this send would have made it hold
        is released on a later send too (it may have held some of it before)."""
        for p in prepared:
            with self._lock:
                for newly_held, released in p.changes:
                    for content_key in newly_held:
                        self._held.pop(content_key)
                    self._released[:0] = released + newly_held
            self.stock.cancel_for_dispatch(p.stock)

    def _for_wire(self, prompt_rows: PromptRows
                  ) -> tuple[PositionalEmbeds, tuple[list[str], list[str]]]:
        """A new object (requests may share one): rows of spans the scheduler holds left out."""
        if not self.on or not any(s.content_key for s in prompt_rows.spans):
            self.rows_sent += len(prompt_rows.positions)
            rows = RowsOnTheWire.wrap(prompt_rows.embeds)
            return PositionalEmbeds(rows, prompt_rows.positions), ([], [])
        crossing, spans, newly_held, offset = [], [], [], 0
        for span in prompt_rows.spans:
            rows = prompt_rows.embeds[offset:offset + span.n_rows]
            offset += span.n_rows
            # get(): a held span becomes the most recently used
            sent = span.content_key is None or self._held.get(span.content_key) is None
            if sent:
                crossing.append(rows)
                self.rows_sent += span.n_rows
                if span.content_key is not None:
                    self._held.put(span.content_key, nbytes(rows))  # may let go older spans
                    newly_held.append(span.content_key)
            else:
                self.rows_left_out += span.n_rows
            spans.append(replace(span, sent=sent))
        # a span let go and crossing again is held again: not released (the scheduler releases
        # after use)
        released = [h for h in self._released if h not in self._held]
        self._released = []
        # a new tensor of the rows that cross (pickling a view would send the whole storage)
        embeds = (prompt_rows.embeds if all(s.sent for s in spans)
                  else torch.cat(crossing) if crossing else None)
        embeds = None if embeds is None else RowsOnTheWire.wrap(embeds)
        return CrossingRows(embeds, prompt_rows.positions, spans=spans, sender=self.sender,
                            released=released), (newly_held, released)


_TRANSPORTS: list[RowsTransport] = []  # this process's (one per tokenizer manager)


def init_positional_embeds_transport(original: Callable, self: Any, *args: Any,
                                     **kwargs: Any) -> Any:
    """After SGLang sets up its transport in a tokenizer manager: wrap it (AROUND hook)."""
    result = original(self, *args, **kwargs)
    self.positional_embeds_transport = RowsTransport(self.positional_embeds_transport,
                                                     enabled(self.server_args), budget_bytes())
    _TRANSPORTS.append(self.positional_embeds_transport)
    return result


def release(handle: str) -> None:
    """The HTTP process deleted ``handle`` from its span store: the scheduler may let it go."""
    for t in _TRANSPORTS:
        t.release(handle)


def stats() -> dict | None:
    """This process's transport (None before its tokenizer manager exists)."""
    return _TRANSPORTS[-1].stats() if _TRANSPORTS else None
