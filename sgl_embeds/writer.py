"""The span writer: span prompts -> the fields of a ``/generate`` body, for one server.

``SpanWriter`` writes every span the client sends, once per request: its width against the
server's hidden size (its values too, unless checked where the span entered), its wire encoding,
by handle once this server holds it (``HeldSpans``; ``forget`` when it no longer does), and the
routing hint ``keys.routing_text``. ``encode_prompt``: every span inline (docs/architecture.md,
step 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import xxhash

from sgl_embeds_protocol import keys
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol import wire
from sgl_embeds_protocol.lru import LRU


@dataclass(frozen=True)
class HeldSpan:
    """What the client knows of a span a server holds for it."""

    handle: str  # keys.content_key of the rows as the server decodes them: the API's handle
    route: str  # keys.route_rows: the span's part of the routing hint


class HeldSpans(LRU[HeldSpan]):
    """The spans this client has sent one server (or gateway) with ``keep_spans``, by content, at
    most ``max_entries`` (the least recently used dropped first). A lookup hashes the rows with
    xxh3 (``wire_hash``: about 0.5 ms for 4096 rows of 576 floats); the handle
    (``keys.content_key``) is computed once, on the first send."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        super().__init__(max_entries)

    @staticmethod
    def wire_hash(rows: torch.Tensor) -> tuple:
        """The lookup of rows in the wire dtype (``wire.as_wire_tensor``): an xxh3 of their
        bytes with their dtype and shape; never sent."""
        return str(rows.dtype), tuple(rows.shape), xxhash.xxh3_128_hexdigest(keys.raw_bytes(rows))


@dataclass(frozen=True)
class WrittenSpan:
    """One span as a body carries it."""

    embeds: Any  # the body's "embeds" field: the encoded rows (a tensor for a binary body), or
    # {"handle": ...}
    route: str  # keys.route_rows of the rows in the wire dtype
    inline: bool  # the rows are in the body (not a handle)


class SpanWriter:
    """Writes span prompts for one server: its ``hidden_size``, one wire format and dtype (see
    ``wire.encode_tensor``) and, with ``held``, the spans the server holds for this client.
    Without ``held`` every span goes inline and no body asks the server to hold one."""

    def __init__(self, hidden_size: int, wire_format: str = "base64", wire_dtype: str | None = None,
                 held: HeldSpans | None = None, served_dtype: str | None = None) -> None:
        self.hidden_size = hidden_size
        self.wire_format, self.wire_dtype = wire_format, wire_dtype
        self.held = held
        # rows wider than the served model's dtype go narrowed to it (the server casts them so
        # anyway: the same answer for fewer bytes); without a wire_dtype, others as they are
        self.served_dtype = served_dtype if served_dtype in wire.DTYPES else None

    def dtype_for(self, x: Any) -> str | None:
        """The wire dtype of the rows ``x``: ``wire_dtype`` where given; else the served dtype for
        rows wider than it; else None (their own)."""
        if self.wire_dtype is not None or self.served_dtype is None:
            return self.wire_dtype
        own = x.dtype if isinstance(x, torch.Tensor) else torch.float32
        served = wire.DTYPES[self.served_dtype]
        return self.served_dtype if own.is_floating_point and own.itemsize > served.itemsize else None

    def fields(self, field: str, prompts: list, batch: bool, check_values: bool = True,
               raw_rows: bool = False) -> dict:
        """The body fields of ``prompts`` (each a ``Prompt`` or a list of segments: ``Text``,
        ``Ids``, ``Span`` or wire dicts, which pass as they are): ``field`` (``input_segments``,
        or ``input_embeds`` for prompts that are one span each; a list of them when ``batch``),
        the routing hint ``text`` of the first prompt, and ``keep_spans`` when a span goes inline
        and the server holds spans for this client. ``check_values=False``: the spans' values were
        checked where they entered; only their width is checked here. ``raw_rows``: a span's
        rows stay a tensor (in the wire dtype), for a binary body (``binary_body.encode_body``)."""
        wired, routes, inline = [], [], False
        for i, prompt in enumerate(prompts):
            out, route = [], []
            for j, s in enumerate(prompt.segments if isinstance(prompt, seg.Prompt) else prompt):
                if isinstance(s, seg.Span):
                    where = f"prompt {i}: " if field == "input_embeds" else f"segment {j}: "
                    span = self._span(s.rows, check_values, where, raw_rows)
                    inline |= span.inline
                    out.append({"type": "embeds", "embeds": span.embeds})
                    if s.grid is not None:
                        out[-1].update(s.grid.fields())
                    if s.bidirectional:
                        out[-1][seg.ATTENTION] = seg.BIDIRECTIONAL
                    route.append(span.route + keys.route_grid(s.grid))
                else:
                    out.append(_plain_segment(s, j))
                    route.append(s)
            wired.append(out if field == "input_segments" else out[0]["embeds"])
            routes.append(keys.routing_text(route))
        body: dict[str, Any] = {field: wired if batch else wired[0], "text": routes[0]}
        if inline and self.held is not None:
            body["keep_spans"] = True
        return body

    def forget(self, spans: Iterable[Any]) -> None:
        """Stop naming ``spans`` by handle: the server answered that it does not hold one of them,
        so the request sent again carries their rows inline (and asks for them to be held)."""
        if self.held is None:
            return
        for x in spans:
            self.held.pop(HeldSpans.wire_hash(self._wire_tensor(x)))

    def _span(self, x: Any, check_values: bool, where: str, raw_rows: bool) -> WrittenSpan:
        if self.held is None:
            rows = self._wire_tensor(self._as_rows(x, check_values, where))
            return WrittenSpan(self._encode(rows, raw_rows), keys.route_rows(rows), inline=True)
        rows = self._wire_tensor(self._as_rows(x, False, where))
        wire_hash = HeldSpans.wire_hash(rows)
        held = self.held.get(wire_hash)
        if held is not None:  # these very bytes were checked when they were first sent
            return WrittenSpan({"handle": held.handle}, held.route, inline=False)
        # one read of the rows for the handle, the routing hint and the values check (on the
        # rows as the server decodes them: a cast to the wire dtype that overflows is caught too)
        digests, first_bad = keys.digests_and_first_non_finite(rows)
        if check_values and first_bad is not None:
            raise ValueError(f"{where}embeddings contain NaN or Inf as sent, in "
                             f"{wire.DTYPE_NAMES[rows.dtype]} (first in row {first_bad})")
        held = HeldSpan(keys.content_key(rows, digests), keys.route_rows(rows, digests))
        self.held.put(wire_hash, held)
        return WrittenSpan(self._encode(rows, raw_rows), held.route, inline=True)

    def _as_rows(self, x: Any, check_values: bool, where: str) -> torch.Tensor:
        """A span as a tensor, its shape checked against the server's hidden size, and its values
        with ``check_values``; an error names the span (``where``)."""
        t = wire.as_2d_tensor(x)
        try:
            (wire.check_tensor if check_values else wire.check_shape)(t, self.hidden_size)
        except wire.WireError as e:
            raise ValueError(f"{where}{e}") from None
        return t

    def _wire_tensor(self, x: Any) -> torch.Tensor:
        """The rows as the server decodes them (their handle is the server's): wire dtype, CPU."""
        return wire.as_wire_tensor(x, self.wire_format, self.dtype_for(x))

    def _encode(self, rows: torch.Tensor, raw_rows: bool) -> Any:
        """Inline rows as the body's "embeds": the wire form, or the rows themselves."""
        return rows if raw_rows else wire.encode_tensor(rows, self.wire_format, self.dtype_for(rows))


def _plain_segment(s: Any, j: int) -> dict:
    """A segment that is not a span, on the wire."""
    if isinstance(s, dict):
        return s
    if isinstance(s, seg.Text):
        return {"type": "text", "text": s.text}
    if isinstance(s, seg.Ids):
        return {"type": "input_ids", "input_ids": list(s.ids)}
    raise ValueError(f"segment {j}: expected Text, Ids, Span or a wire dict, "
                     f"got {type(s).__name__}")


def encode_prompt(prompt: seg.Prompt | list, hidden_size: int, wire_format: str = "base64",
                  wire_dtype: str | None = None, check_values: bool = True) -> list[dict]:
    """Wire segments of a prompt, every span inline, for clients that build request bodies
    themselves. Each span is checked here, once: its shape, its width against the server's
    ``hidden_size`` and its values (only the width with ``check_values=False``, for spans checked
    where they were made). Wire dicts pass as they are; the server checks them."""
    writer = SpanWriter(hidden_size, wire_format, wire_dtype)
    return writer.fields("input_segments", [prompt], False, check_values)["input_segments"]
