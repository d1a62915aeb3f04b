"""Content keys of a span, computed alike on both sides of the wire.

* ``span_handle``: the name a server keeps a span under (``srt/handles.py``): a SHA-256 of its
  dtype, shape and bytes, so equal rows get equal handles and a handle cannot be guessed without
  the rows. The client computes it too, to refer by handle to a span it has sent before.
* ``routing_text``: what a gateway in front of several servers sees of a span prompt. SGLang's
  gateway (smg) routes cache-aware by a prefix tree of a request's ``text``; a span prompt sends
  its text segments as they are and a short content hash per span row, then ``ROUTE_TAG``, so a
  repeated span goes to the worker whose radix cache holds it. (The tag ends the hint: as a
  prefix shared by every span request it would pull short prompts onto one worker.) It is only
  a hint: the server drops it (``is_routing_text``) and keys its cache on hashes it computes
  itself.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import xxhash

from sgl_embeds_srt.segments import Embeds, Ids, Segment, Text

HANDLE_PREFIX = "span-"
# The error "type" of a request naming a handle the server does not hold (the client resends rows)
UNKNOWN_HANDLE_TYPE = "UnknownSpanHandle"
ROUTE_TAG = " <sgl_embeds routing hint>"
ROUTE_CHARS_PER_ROW = 6  # a row weighs about what a 1-2 token word weighs in the gateway's tree


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (on the CPU, contiguous), without a copy where it already is."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def span_handle(t: torch.Tensor) -> str:
    """The handle of a span as the server decodes it (dtype, shape and bytes as sent)."""
    digest = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    digest.update(raw_bytes(t))
    return HANDLE_PREFIX + digest.hexdigest()


def route_rows(t: torch.Tensor) -> str:
    """``ROUTE_CHARS_PER_ROW`` hex characters per row, from a hash of the row's bytes."""
    raw = raw_bytes(t)
    width = raw.nbytes // max(t.shape[0], 1)
    return "".join(xxhash.xxh3_64_hexdigest(raw[i * width:(i + 1) * width])[:ROUTE_CHARS_PER_ROW]
                   for i in range(t.shape[0]))


def route_grid(image_grid_thw: tuple[int, int, int] | None) -> str:
    """A grid span's grid in the routing hint: the same rows under another grid are another
    prefix (they share no KV), so they must not look like one to the gateway."""
    return "" if image_grid_thw is None else "<{}x{}x{}>".format(*image_grid_thw)


def routing_text(segments: Iterable[Segment | str]) -> str:
    """The routing text of a prompt: each segment in order (a ``str`` is a span's ``route_rows``
    already computed), then ``ROUTE_TAG``."""
    parts = []
    for s in segments:
        if isinstance(s, str):
            parts.append(s)
        elif isinstance(s, Text):
            parts.append(s.text)
        elif isinstance(s, Ids):
            parts.append(" ".join(map(str, s.ids)) + " ")
        elif isinstance(s, Embeds):
            parts.append(route_rows(s.tensor) + route_grid(s.image_grid_thw))
    parts.append(ROUTE_TAG)
    return "".join(parts)


def is_routing_text(value: object) -> bool:
    return isinstance(value, str) and value.endswith(ROUTE_TAG)
