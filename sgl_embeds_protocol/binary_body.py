"""The binary request body: a request's spans as raw bytes after a small JSON head.

``CONTENT_TYPE`` (``application/x-sgl-embeds``), laid out as a safetensors file: a u64 length,
the head (the request's JSON form, each span a ``data_offsets`` range of the buffer, only where a
span goes: ``RANGE_FIELDS``, span segments and parts), the buffer. ``encode_parts`` /
``encode_body`` write one; ``decode_body`` gives the JSON form's request with each span a tensor
viewing the body, its frame checked before anything is allocated (docs/concepts.md, "The binary
body").
"""

from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson
import torch

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.keys import raw_bytes

CONTENT_TYPE = "application/x-sgl-embeds"
ALIGN = 64  # encode_parts starts the buffer and each range at a multiple of this
# The fields that take a span (a top-level input_embeds also a list of them); below the top, in
# an object whose type names the field (a segment or a chat part)
RANGE_FIELDS = ("input_embeds", "embeds")
RANGE_KEYS = {"dtype", "shape", "data_offsets"}


def is_binary(content_type: str | bytes | None) -> bool:
    """Whether a ``Content-Type`` header names the binary body (parameters ignored)."""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return (content_type or "").split(";", 1)[0].strip().lower() == CONTENT_TYPE


def encode_parts(request: dict, dtype: str | None = None) -> list[bytes | memoryview]:
    """A request whose spans are tensors (torch or numpy, where its JSON form takes a wire
    tensor) as a binary body in parts, back to back: the frame and head, then each tensor's
    bytes as they are (a view, not a copy) with the alignment padding between. A tensor goes in
    ``dtype``, by default its own (float32 if it is none of ``wire.DTYPES``), as
    ``wire.encode_tensor`` does. A client posts the parts as they are (``sum(part lengths)``
    as its Content-Length), so the body is never copied into one buffer."""
    buffer: list[bytes | memoryview] = []
    size = 0

    def as_range(x: Any) -> dict:
        nonlocal size
        t = wire.as_wire_tensor(x, "base64", dtype)
        pad = -size % ALIGN
        if pad:
            buffer.append(bytes(pad))
        begin = size + pad
        raw = raw_bytes(t)
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            raw = memoryview(np.frombuffer(raw, f"u{t.element_size()}").byteswap().tobytes())
        buffer.append(raw)
        size = begin + raw.nbytes
        return {"dtype": wire.DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                "data_offsets": [begin, size]}

    head = orjson.dumps(map_tensors(request, as_range))
    head += b" " * (-(8 + len(head)) % ALIGN)  # JSON allows trailing spaces
    return [struct.pack("<Q", len(head)) + head, *buffer]


def encode_body(request: dict, dtype: str | None = None) -> tuple[bytes, str]:
    """``encode_parts`` as one ``bytes``, and its content type."""
    return b"".join(encode_parts(request, dtype)), CONTENT_TYPE


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` (a request) with each tensor in it (torch or numpy) replaced by ``fn(tensor)``."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_tensors(v, fn) for v in value]
    return value


def json_form(request: dict) -> dict:
    """The JSON form of a request whose spans are tensors: each one base64 in its own dtype."""
    return map_tensors(request, wire.encode_tensor)


def decode_body(body: bytes | bytearray | memoryview,
                max_bytes: int = wire.MAX_SPAN_BYTES) -> dict:
    """The request of a binary body, each range replaced by a tensor viewing ``body``;
    ``max_bytes``: a span's limit, counted as float32 (as ``wire.decode_tensor``'s). The frame is
    checked first (the head's length, each range's dtype, shape, size and end, no overlap), each
    error a ``wire.WireError`` naming the field; bytes no range covers (``encode_parts``'
    alignment padding) are ignored. Values (NaN, Inf) are checked later, where every span's are."""
    data = memoryview(body).cast("B")
    if len(data) < 8:
        raise wire.WireError(f"a binary body starts with the 8-byte length of its JSON head; "
                             f"this one has {len(data)} bytes")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise wire.WireError(f"the JSON head is declared {n} bytes long, but only {len(data) - 8} "
                             "bytes follow its length (a truncated body?)")
    try:
        head = orjson.loads(data[8:8 + n])
    except orjson.JSONDecodeError as e:
        raise wire.WireError(f"the head of a binary body is not JSON: {e}") from None
    if not isinstance(head, dict):
        raise wire.WireError(f"the head of a binary body must be a JSON object (the request), "
                             f"got {type(head).__name__}")
    start = 8 + n
    ranges = [_read_range(node, key, where, len(data) - start, max_bytes)
              for node, key, where in _places(head)]
    covering = sorted((r for r in ranges if r.end > r.begin), key=lambda r: r.begin)
    for before, after in zip(covering, covering[1:]):
        if after.begin < before.end:
            raise wire.WireError(f"{after.where}: data_offsets {[after.begin, after.end]} overlap "
                                 f"those of {before.where} {[before.begin, before.end]}")
    whole = _whole(data) if ranges else None
    for r in ranges:
        r.node[r.key] = _view(whole, r.dtype, r.shape, start + r.begin, r.end - r.begin)
    return head


@dataclass(frozen=True)
class _Range:
    """A span's range, checked: its place in the head (``node[key]``, ``where`` as a path), and
    what it holds (``begin``/``end``: offsets in the buffer)."""

    node: Any
    key: Any
    where: str
    dtype: torch.dtype
    shape: list[int]  # [n, hidden]
    begin: int
    end: int


def _places(head: dict) -> list[tuple[Any, Any, str]]:
    """Where each range stands in the head: (its container, its key there, its path), each
    checked to be a span's place. Iterative: a deep head costs no recursion."""
    found = []
    stack: list[tuple[Any, str, bool]] = [(head, "", False)]  # (node, path, its items take spans)
    while stack:
        node, path, takes_spans = stack.pop()
        is_dict = isinstance(node, dict)
        for key, value in (node.items() if is_dict else enumerate(node)):
            if not isinstance(value, (dict, list)):
                continue
            here = (f"{path}.{key}" if path else key) if is_dict else f"{path}[{key}]"
            place = takes_spans or (is_dict and key in RANGE_FIELDS
                                    and (node is head or node.get("type") == key))
            if isinstance(value, dict) and "data_offsets" in value:
                if not place:
                    raise wire.WireError(f"{here}: a byte range stands only where a span goes "
                                         "(top-level input_embeds or embeds, or the span of a "
                                         '{"type": "embeds", "embeds": ...} segment or a '
                                         '{"type": "input_embeds", "input_embeds": ...} part)')
                found.append((node, key, here))
            else:  # the items of a list at a span's place take spans (a batch of input_embeds)
                stack.append((value, here, place and is_dict and isinstance(value, list)))
    return found


def _read_range(node: Any, key: Any, where: str, buffer_size: int, max_bytes: int) -> _Range:
    """The range at ``node[key]``, checked against the buffer's size and the span limit."""
    ref = node[key]
    unknown = set(ref) - RANGE_KEYS
    if unknown:
        raise wire.WireError(f"{where}: unknown keys in a byte range: {sorted(unknown)} "
                             f"(a range has {sorted(RANGE_KEYS)})")
    try:
        shape, nbytes = wire.declared_size(ref.get("dtype"), ref.get("shape"), max_bytes)
    except wire.WireError as e:
        raise wire.WireError(f"{where}: {e}") from None
    offsets = ref["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise wire.WireError(f"{where}: data_offsets must be [begin, end] of ints with "
                             f"0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    if end - begin != nbytes:
        raise wire.WireError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, but shape "
                             f"{shape} of {ref['dtype']} needs {nbytes}")
    if end > buffer_size:
        raise wire.WireError(f"{where}: data_offsets {offsets} end past the {buffer_size} bytes "
                             "after the head (a truncated body?)")
    return _Range(node, key, where, wire.DTYPES[ref["dtype"]], shape, begin, end)


def _whole(data: memoryview) -> torch.Tensor:
    """The body as one uint8 tensor: its spans are views of it, so each span's storage is the
    whole body (``handles.SpanStore`` keeps a span that is nearly all of it without a copy)."""
    # Spans are only ever read (a body in bytes is read-only memory): the engine copies rows
    # where it converts or concatenates them.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def _view(whole: torch.Tensor, dtype: torch.dtype, shape: list[int], offset: int,
          nbytes: int) -> torch.Tensor:
    """The tensor at ``whole[offset:offset + nbytes]``: a view where the bytes are aligned to
    the dtype on a little-endian host, else a copy."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = whole[offset:offset + nbytes]
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        swapped = raw.numpy().view(f"<u{dtype.itemsize}").astype(f"=u{dtype.itemsize}")
        return torch.from_numpy(swapped).view(dtype).reshape(shape)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)
