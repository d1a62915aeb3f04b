"""Request JSON -> segments, on the server: span decoding, handle lookup, segment lists.

``SpanReader`` is the one span decoder (these segment lists and the chat route's parts): each
tensor of ``input_segments`` / ``input_embeds`` is decoded and checked once (``decode_span``:
``wire.decode_tensor``, then its values with its row digests), a ``{"handle": ...}`` looked up, a
span held with ``keep_spans``, a routing hint dropped. Shapes against the model come later
(``prompts.build_ids``); every error is a ``ValueError`` (HTTP 400). docs/architecture.md, step 6.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.environment import setting
from sgl_embeds_protocol.keys import finite_row_digests, is_routing_text, keyed
from sgl_embeds_protocol.segments import Grid, Ids, Segment, Span, Text, bidirectional_of
from sgl_embeds_srt.handles import SpanStore, UnknownSpanHandle

# the top-level fields of a span request, which a stock body must not carry
REQUEST_SPAN_FIELDS = ("input_segments", "input_embeds", "keep_spans")
# Server-side media a multimodal model expands into its own tokens; not combined with spans.
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")
SPAN_TYPE = "embeds"  # a span segment's type, and the field holding its tensor


def max_span_bytes(largest_image_bytes: int) -> int:
    """Decoded float32 bytes allowed in one request's spans: ``SGLANG_EMBEDS_MAX_BYTES`` where set;
    else ``wire.MAX_SPAN_BYTES``, or the served model's largest image (``ModelSpec.
    largest_image_bytes``) where that is more, so that any image its processor makes is served."""
    if (budget := setting(wire.BUDGET_VAR)) is not None:
        return int(budget)
    return max(wire.MAX_SPAN_BYTES, largest_image_bytes)


def has_span_fields(body: dict) -> bool:
    return body.get("input_segments") is not None or body.get("input_embeds") is not None


def wants_held(body: dict, store: SpanStore | None) -> bool:
    """Whether the request asks the server to hold its inline spans (``"keep_spans": true``)."""
    hold = body.get("keep_spans", False)
    if not isinstance(hold, bool):
        raise ValueError(f"keep_spans must be true or false, got {hold!r}")
    if hold and store is None:
        raise ValueError("keep_spans is accepted only by the HTTP server (it holds spans by handle)")
    return hold


def decode_span(obj: Any, max_bytes: int, store: SpanStore | None = None, hold: bool = False) -> Span:
    """A wire tensor (held in ``store`` if ``hold``), or ``{"handle": ...}`` looked up there; the
    span with its row digests and content key (``keys.keyed``)."""
    if isinstance(obj, dict) and "handle" in obj:
        if store is None:
            raise wire.WireError("span handles are accepted only by the HTTP server")
        if len(obj) != 1:
            raise wire.WireError('a span handle is {"handle": "span-..."} with no other keys')
        return store.get(obj["handle"])
    t = wire.decode_tensor(obj, max_bytes)
    span = keyed(Span(t, row_digests=finite_row_digests(t)))  # values checked in the read that hashes the rows
    return store.put(span) if hold else span


def grid_of(fields: Any, where: str) -> Grid | None:
    """The grid written beside a span (``segments.Grid.of_fields`` of a segment or chat part),
    errors naming ``where`` (whether it fits the rows and the model: ``prompts.build_ids``)."""
    try:
        return Grid.of_fields(fields) if isinstance(fields, dict) else None
    except ValueError as e:
        raise wire.WireError(f"{where}{e}") from None


def _bidirectional_of(fields: Any, where: str) -> bool:
    """Whether the span segment ``fields`` asks for its rows to attend both ways."""
    try:
        return bidirectional_of(fields) if isinstance(fields, dict) else False
    except ValueError as e:
        raise wire.WireError(f"{where}{e}") from None


class SpanReader:
    """Reads the spans of one prompt, wherever they stand (a segment list, a chat message's
    content parts, a whole-prompt ``input_embeds``): the one span decoder of every route. One
    budget of decoded float32 bytes for all of the prompt's spans, the store for handles, and
    whether to hold the inline ones."""

    def __init__(self, max_bytes: int = wire.MAX_SPAN_BYTES, store: SpanStore | None = None,
                 hold: bool = False) -> None:
        self.bytes_left, self.store, self.hold = max_bytes, store, hold

    def read(self, value: Any, where: str = "", fields: Any = None) -> Span:
        """The span of the wire value ``value`` with the grid written in ``fields`` (the segment
        or chat part that holds it; none for a plain span); a ``WireError`` that names ``where``,
        except ``UnknownSpanHandle`` (a client resends the span inline on it, whatever its
        place)."""
        try:
            span = decode_span(value, self.bytes_left, self.store, self.hold)
        except UnknownSpanHandle:
            raise
        except wire.WireError as e:
            raise wire.WireError(f"{where}{e}") from None
        self.bytes_left -= span.rows.numel() * 4
        grid = grid_of(fields, where)
        bidirectional = _bidirectional_of(fields, where)
        if grid is None and not bidirectional:
            return span
        return dataclasses.replace(span, grid=grid, bidirectional=bidirectional)


def segments_from_wire(items: Any, max_bytes: int = wire.MAX_SPAN_BYTES,
                       store: SpanStore | None = None, hold: bool = False) -> list[Segment]:
    """Parse and validate a wire segment list (tensors decoded, shapes not yet model-checked)."""
    if not isinstance(items, list) or not items:
        raise wire.WireError("input_segments must be a non-empty list of segment objects")
    out: list[Segment] = []
    reader = SpanReader(max_bytes, store, hold)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise wire.WireError(f"segment {i} must be an object, got {type(item).__name__}")
        kind = item.get("type")
        if kind == "text":
            if not isinstance(item.get("text"), str):
                raise wire.WireError(f"segment {i}: 'text' must be a string")
            out.append(Text(item["text"]))
        elif kind == "input_ids":
            ids = item.get("input_ids")
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise wire.WireError(f"segment {i}: 'input_ids' must be a list of non-negative ints")
            out.append(Ids(ids))
        elif kind == SPAN_TYPE:
            if SPAN_TYPE not in item:
                raise wire.WireError(f"segment {i}: an embeds segment needs an 'embeds' field")
            out.append(reader.read(item[SPAN_TYPE], f"segment {i}: ", item))
        else:
            raise wire.WireError(f"segment {i}: unknown type {kind!r} "
                                 "(use text, input_ids or embeds)")
    return out


def parse_prompts(body: dict, max_bytes: int,
                  store: SpanStore | None = None) -> tuple[list[list[Segment]], bool]:
    """The span prompts of a request body: (one segment list per prompt, is_batch)."""
    if body.get("input_segments") is not None and body.get("input_embeds") is not None:
        raise ValueError("give either input_segments or input_embeds, not both")
    if body.get("text") is not None and not is_routing_text(body["text"]):
        raise ValueError("text cannot be combined with input_segments/input_embeds (except a "
                         "gateway routing hint, see sgl_embeds_protocol.keys): put the text in "
                         "input_segments instead")
    if body.get("input_ids") is not None:
        raise ValueError("input_ids cannot be combined with input_segments/input_embeds: "
                         "put the ids in input_segments instead")
    if body.get("session_params") is not None:
        # A session request is rebuilt in the scheduler from the session's history, without the
        # span rows: the spans would be lost. One span prompt holding the whole conversation
        # gets the same reuse from the radix cache.
        raise ValueError("span prompts cannot continue a session (session_params): send the whole "
                         "conversation as one span prompt; the prefix cache reuses the earlier turns")
    for media in MEDIA_FIELDS:
        if body.get(media) is not None:
            # The multimodal processor rewrites the prompt's ids around its media tokens, which
            # the span rows' positions would not follow (docs/engine.md).
            raise ValueError(f"span prompts cannot be combined with {media}: encode the media into "
                             "a span client-side (sgl.image / sgl.region with a vision encoder) "
                             "instead")
    hold = wants_held(body, store)
    if body.get("input_segments") is not None:
        items = body["input_segments"]
        if isinstance(items, list) and items and isinstance(items[0], list):
            return [segments_from_wire(p, max_bytes, store, hold) for p in items], True
        return [segments_from_wire(items, max_bytes, store, hold)], False
    embeds = body["input_embeds"]
    if wire.is_tensor_batch(embeds):
        return [[SpanReader(max_bytes, store, hold).read(e)] for e in embeds], True
    return [[SpanReader(max_bytes, store, hold).read(embeds)]], False
