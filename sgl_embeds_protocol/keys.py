"""Content keys of a span, computed alike on both sides of the wire (``KEY_SCHEME``).

``row_digests``: a keyed BLAKE3 per row (a key per dtype), all rows in one native call
(``csrc/row_digests.c``; a Python loop where it was not compiled); placeholder ids are 62 bits of
each. ``content_key``: a span's handle, a keyed BLAKE3 of its dtype, shape and row digests.
``routing_text``: the hint a gateway routes on, each row's part the start of its digest, ending in
``ROUTE_TAG`` (``is_routing_text``). docs/concepts.md, "Placeholder ids"; docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Iterable

import numpy as np
import torch
from blake3 import blake3

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.segments import Grid, Ids, Segment, Span, Text

try:
    from sgl_embeds_protocol import _row_digests as native_rows
except ImportError:  # built without a C compiler (setup.py): the Python loop below, same digests
    native_rows = None

HANDLE_PREFIX = "span-"
# The error "type" of a request naming a handle the server does not hold (the client resends rows)
UNKNOWN_HANDLE_TYPE = "UnknownSpanHandle"
ROUTE_TAG = " <sgl_embeds routing hint>"
ROUTE_CHARS_PER_ROW = 6  # a row weighs about what a 1-2 token word weighs in the gateway's tree

# The scheme of row digests and handles. v3: a row key per dtype; v2 had one row key for all;
# v1 was a blake2b per row and a SHA-256 of the bytes.
KEY_SCHEME = "blake3-rows/v3"
ROW_DIGEST_BYTES = 32


def _derived_blake3_key(purpose: str) -> bytes:
    """Keyed BLAKE3, keys derived from the scheme's name: a row digest is never a handle's."""
    return blake3(purpose.encode(), derive_key_context=f"sgl_embeds {KEY_SCHEME}").digest()


_CONTENT_BLAKE3_KEY = _derived_blake3_key("span")


@functools.cache
def row_blake3_key(dtype: torch.dtype) -> bytes:
    """The key of the digests of rows of ``dtype``."""
    return _derived_blake3_key(f"row {dtype}")


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (on the CPU, contiguous) as one flat run, without a copy where it
    already is (flat: slicing it slices bytes, not rows)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


# Threads for one span's rows: one per 2 MiB of rows, at most this many (and the machine's cores)
HASH_THREADS = min(8, os.cpu_count() or 1)
_BYTES_PER_THREAD = 2 << 20


def _threads(nbytes: int) -> int:
    return max(1, min(HASH_THREADS, nbytes // _BYTES_PER_THREAD))


def row_digests(t: torch.Tensor) -> bytes:
    """The ``ROW_DIGEST_BYTES`` keyed BLAKE3 digests of the rows of ``t`` ``[n, ...]``, back to
    back, in one native call (docs/performance.md has its speed)."""
    raw, key = raw_bytes(t), row_blake3_key(t.dtype)
    n = t.shape[0] if t.dim() else 1
    width = raw.nbytes // n if n else 0
    if width == 0:  # no bytes per row: each row's digest is the empty input's
        return blake3(b"", key=key).digest() * n
    if native_rows is not None:
        return native_rows.digests(raw, width, key, _threads(raw.nbytes))
    return row_digests_by_row(raw, width, key)


# Element size and exponent bits of each float dtype a span travels in: all set is a NaN or an Inf
_EXPONENT_BITS = {torch.float32: (4, 0x7F800000), torch.float16: (2, 0x7C00),
                  torch.bfloat16: (2, 0x7F80)}


def digests_and_first_non_finite(t: torch.Tensor) -> tuple[bytes, int | None]:
    """``row_digests(t)`` and the first row of ``t`` holding a NaN or an Inf (None if none does),
    from one read of its bytes where the native pass was built (the check runs on each group of
    rows right after it is hashed, while it is in cache) for the dtypes in ``_EXPONENT_BITS``;
    two reads for any other (an in-process caller's float64 rows, say). ``t``: 2-D."""
    raw = raw_bytes(t)
    if native_rows is None or raw.nbytes == 0 or t.dtype not in _EXPONENT_BITS:
        return row_digests(t), wire.first_non_finite_row(t)
    elem_size, mask = _EXPONENT_BITS[t.dtype]
    digests, first_bad = native_rows.checked_digests(raw, raw.nbytes // t.shape[0], row_blake3_key(t.dtype),
                                                      _threads(raw.nbytes), elem_size, mask)
    return digests, None if first_bad == t.shape[0] else first_bad


def finite_row_digests(t: torch.Tensor) -> bytes:
    """``row_digests(t)`` of rows whose every value is finite, else ``wire.WireError`` naming the
    first row holding a NaN or an Inf: how the server reads a span's bytes where it enters, once."""
    digests, first_bad = digests_and_first_non_finite(t)
    if first_bad is not None:
        raise wire.non_finite(first_bad)
    return digests


def row_digests_by_row(raw: memoryview, width: int, key: bytes) -> bytes:
    """``row_digests`` one blake3 call per row: where the native pass was not built, and the
    reference the tests hold it to."""
    return b"".join([blake3(raw[i:i + width], key=key).digest()
                     for i in range(0, raw.nbytes, width)])


def content_key(t: torch.Tensor, digests: bytes | None = None) -> str:
    """The content key of a span as the server decodes it (dtype, shape and rows as sent): what
    the API calls its handle. ``digests``: ``row_digests(t)`` when the caller has them (then no
    byte is hashed again)."""
    digest = blake3(f"{t.dtype}{list(t.shape)}".encode(), key=_CONTENT_BLAKE3_KEY)
    digest.update(row_digests(t) if digests is None else digests)
    return HANDLE_PREFIX + digest.hexdigest()


def keyed(span: Span) -> Span:
    """``span`` with its row digests and content key, each computed only where absent: the one
    place a span gets its content key (the server's decoder, the handle store, and ``build_ids``
    for spans an in-process caller made)."""
    if span.content_key is not None and span.row_digests is not None:
        return span
    digests = row_digests(span.rows) if span.row_digests is None else span.row_digests
    return dataclasses.replace(span, row_digests=digests, content_key=content_key(span.rows, digests))


def route_rows(t: torch.Tensor, digests: bytes | None = None) -> str:
    """``ROUTE_CHARS_PER_ROW`` hex characters per row: the start of its row digest.
    ``digests``: ``row_digests(t)`` when the caller has them."""
    digests = row_digests(t) if digests is None else digests
    per_row = np.frombuffer(digests, np.uint8).reshape(-1, ROW_DIGEST_BYTES)
    return per_row[:, :ROUTE_CHARS_PER_ROW // 2].tobytes().hex()


def route_grid(grid: Grid | None) -> str:
    """A grid span's grid in the routing hint: the same rows under another grid (or a clip's
    under another time) are another prefix (they share no KV), so they must not look like one to
    the gateway. An image's is ``<1x4x8>``; a clip's ``<video 2x4x8 ...>`` with its time."""
    if grid is None:
        return ""
    if not grid.video:
        return "<{}x{}x{}>".format(*grid.thw)
    time = "" if grid.second_per_grid_t is None else f" {grid.second_per_grid_t!r}s"
    time += "".join(f" @{t!r}" for t in grid.timestamps or ())
    return "<video {}x{}x{}{}>".format(*grid.thw, time)


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
        elif isinstance(s, Span):
            parts.append(route_rows(s.rows) + route_grid(s.grid))
    parts.append(ROUTE_TAG)
    return "".join(parts)


def keyed_routing_text(text: str, api_key: str) -> str:
    """``text`` (a routing text) led by a digest of the client's API key, once."""
    mark = "[key " + blake3(api_key.encode()).hexdigest()[:16] + "] "
    return text if text.startswith(mark) else mark + text


def is_routing_text(value: object) -> bool:
    return isinstance(value, str) and value.endswith(ROUTE_TAG)
