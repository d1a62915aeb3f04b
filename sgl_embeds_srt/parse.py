"""Request JSON -> segments, on the server: span decoding, handle lookup, segment lists.

The span fields of a request body are ``input_segments`` (a list of wire segments, or a list of
such lists for a batch) and ``input_embeds`` (one wire tensor for the whole prompt, or a list of
them). Each tensor is decoded and checked here, once (``wire.decode_tensor``, then its values in
the same read as its row digests, ``keys.finite_row_digests``); a
``{"handle": ...}`` in its place is looked up in the server's span store, and with
``"keep_spans": true`` every span sent inline is kept there under its handle. A ``text`` (or, on
``/v1/completions``, a ``prompt``) that is a gateway routing hint (``keys.routing_text``) is
dropped. Shapes are checked against the model later, in ``prompts.build_ids``. Every error is a
``ValueError`` (HTTP 400).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sgl_embeds_srt import wire
from sgl_embeds_srt.keys import finite_row_digests, is_routing_text
from sgl_embeds_srt.segments import Embeds, Ids, Segment, Text, image_grid
from sgl_embeds_srt.handles import SpanStore, UnknownSpanHandle

SPAN_FIELDS = ("input_segments", "input_embeds", "keep_spans")
# Server-side media a multimodal model expands into its own tokens; not combined with spans.
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


def max_span_bytes() -> int:
    """Decoded float32 bytes allowed in one request's spans (``SGL_EMBEDS_MAX_BYTES``)."""
    return int(os.environ.get("SGL_EMBEDS_MAX_BYTES", wire.MAX_SPAN_BYTES))


def has_span_fields(body: dict) -> bool:
    return body.get("input_segments") is not None or body.get("input_embeds") is not None


def keep_spans(body: dict, store: SpanStore | None) -> bool:
    """Whether the request asks to keep its inline spans (``"keep_spans": true``)."""
    keep = body.get("keep_spans", False)
    if not isinstance(keep, bool):
        raise ValueError(f"keep_spans must be true or false, got {keep!r}")
    if keep and store is None:
        raise ValueError("keep_spans is accepted only by the HTTP server (it keeps spans by handle)")
    return keep


def decode_span(obj: Any, max_bytes: int, store: SpanStore | None = None,
                keep: bool = False) -> Embeds:
    """A wire tensor (kept in ``store`` if ``keep``), or ``{"handle": ...}`` looked up there."""
    if isinstance(obj, dict) and "handle" in obj:
        if store is None:
            raise wire.WireError("span handles are accepted only by the HTTP server")
        if len(obj) != 1:
            raise wire.WireError('a span handle is {"handle": "span-..."} with no other keys')
        return dataclasses.replace(store.get(obj["handle"]))  # a copy: the parser sets its grid
    t = wire.decode_tensor(obj, max_bytes)
    digests = finite_row_digests(t)  # its values checked in the read that hashes its rows
    return dataclasses.replace(store.put(t, digests)) if keep else Embeds(t, row_digests=digests)


def image_grid_thw(value: Any, where: str) -> tuple[int, int, int] | None:
    """A span's ``image_grid_thw`` from the wire (``segments.image_grid``), errors naming ``where``
    (whether it fits the rows and the model is checked in ``prompts.build_ids``)."""
    try:
        return image_grid(value)
    except ValueError as e:
        raise wire.WireError(f"{where}{e}") from None


def segments_from_wire(items: Any, max_bytes: int = wire.MAX_SPAN_BYTES,
                       store: SpanStore | None = None, keep: bool = False) -> list[Segment]:
    """Parse and validate a wire segment list (tensors decoded, shapes not yet model-checked)."""
    if not isinstance(items, list) or not items:
        raise wire.WireError("input_segments must be a non-empty list of segment objects")
    out: list[Segment] = []
    budget = max_bytes
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
        elif kind == "embeds":
            if "embeds" not in item:
                raise wire.WireError(f"segment {i}: an embeds segment needs an 'embeds' field")
            try:
                span = decode_span(item["embeds"], budget, store, keep)
            except UnknownSpanHandle:
                raise
            except wire.WireError as e:
                raise wire.WireError(f"segment {i}: {e}") from None
            budget -= span.tensor.numel() * 4
            span.image_grid_thw = image_grid_thw(item.get("image_grid_thw"), f"segment {i}: ")
            out.append(span)
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
                         "gateway routing hint, see sgl_embeds_srt.keys): put the text in "
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
    keep = keep_spans(body, store)
    if body.get("input_segments") is not None:
        items = body["input_segments"]
        if isinstance(items, list) and items and isinstance(items[0], list):
            return [segments_from_wire(p, max_bytes, store, keep) for p in items], True
        return [segments_from_wire(items, max_bytes, store, keep)], False
    embeds = body["input_embeds"]
    if wire.is_tensor_batch(embeds):
        return [[decode_span(e, max_bytes, store, keep)] for e in embeds], True
    return [[decode_span(embeds, max_bytes, store, keep)]], False
