"""Tensor <-> JSON wire format, shared by the client and the server.

A span is nested JSON float lists (a flat list is one row) or ``{"data": base64 of raw
little-endian bytes, "dtype", "shape"}``: ``encode_tensor`` / ``as_wire_tensor`` write it,
``decode_tensor`` reads it (a binary body's spans arrive as tensors and are checked alike).
Bytes become a tensor only through ``torch.frombuffer`` with a dtype of ``DTYPES``, never by
unpickling, and every size is checked against the budget before anything is allocated.
"""

from __future__ import annotations

import binascii
import math
import sys
import warnings
from typing import Any

import numpy as np
import torch

try:  # SIMD base64 (an SGLang dependency): ~5x faster than the standard library on large spans
    import pybase64 as b64
except ImportError:  # pragma: no cover
    import base64 as b64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_SPAN_BYTES = 256 * 1024 * 1024  # per tensor, as decoded float32
MAX_ROWS = 1 << 20
BUDGET_VAR = "SGLANG_EMBEDS_MAX_BYTES"  # the server's budget of one request's spans (sgl_embeds_srt.parse)
TENANTS_VAR = "SGLANG_EMBEDS_TENANTS"  # the server's API key -> tenant table (sgl_embeds_srt.tenants)


class WireError(ValueError):
    """A tensor payload that cannot be decoded; the message says what is wrong."""


def too_big(what: str, max_bytes: int) -> WireError:
    """The refusal of spans over the budget, naming the setting that sizes it."""
    return WireError(f"{what} exceed the size limit of {max_bytes} bytes (counted as float32; the "
                     f"server's {BUDGET_VAR} bounds all of a request's spans, by default {MAX_SPAN_BYTES} "
                     "or the served model's largest image, whichever is more)")


def encode_tensor(x: Any, fmt: str = "base64", dtype: str | None = None) -> Any:
    """Encode a ``[n, hidden]`` (or ``[hidden]``) tensor-like for the wire.

    ``fmt="base64"`` gives the binary object (``dtype`` defaults to the tensor's own dtype when it
    is one of float32/float16/bfloat16, else float32); ``fmt="json"`` gives nested float lists.
    """
    t = as_wire_tensor(x, fmt, dtype)
    if fmt == "json":
        return t.tolist()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raw = _byteswap(raw, t.element_size())
    return {"data": b64.b64encode(raw).decode("ascii"), "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}


def as_wire_tensor(x: Any, fmt: str = "base64", dtype: str | None = None) -> torch.Tensor:
    """The tensor a server decodes from ``encode_tensor(x, fmt, dtype)``: CPU, contiguous, in the
    wire dtype (float32 for JSON). Its handle (``keys.content_key``) is the server's."""
    t = as_2d_tensor(x)
    if fmt == "json":
        return t.detach().to("cpu", torch.float32).contiguous()
    if fmt != "base64":
        raise ValueError(f"unknown wire format {fmt!r}: use 'base64' or 'json'")
    name = dtype or DTYPE_NAMES.get(t.dtype, "float32")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: use one of {sorted(DTYPES)}")
    return t.detach().to("cpu", DTYPES[name]).contiguous()


def as_2d_tensor(x: Any) -> torch.Tensor:
    """A client-side tensor-like (torch, numpy, nested lists) as a 2-D tensor, with clear errors."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
    elif isinstance(x, np.ndarray):
        if x.dtype.kind not in "fiu":
            raise ValueError(f"embeddings must be numeric, got a numpy array of dtype {x.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, (list, tuple)):
        t = decode_json_lists(list(x), MAX_SPAN_BYTES)
    else:
        raise ValueError(f"embeddings must be a tensor, array or nested list, got {type(x).__name__}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"embeddings must have shape [n, hidden] or [hidden], got {list(t.shape)}")
    if not t.is_floating_point():
        t = t.to(torch.float32)
    return t


def is_tensor_batch(x: Any) -> bool:
    """Whether ``x`` holds one tensor per prompt rather than one ``[n, hidden]`` tensor: a 3-D
    tensor or array, or a non-empty list of tensors, arrays, wire objects (dicts), or of
    ``[n, hidden]`` nested lists (three levels of lists)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim == 3
    if not isinstance(x, list) or not x:
        return False
    first = x[0]
    if isinstance(first, (torch.Tensor, np.ndarray, dict)):
        return True
    return isinstance(first, (list, tuple)) and bool(first) and isinstance(first[0], (list, tuple))


def decode_tensor(obj: Any, max_bytes: int = MAX_SPAN_BYTES) -> torch.Tensor:
    """Decode either wire encoding into a 2-D CPU tensor; raise WireError on anything malformed.
    Its values are not read here: the server checks them in the pass that hashes its rows
    (``keys.finite_row_digests``)."""
    # in-process callers (Engine) and binary bodies (binary_body.py: views of the body)
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        t = as_2d_tensor(obj)
        if t.numel() * 4 > max_bytes:
            raise too_big(f"embeddings of shape {list(t.shape)}", max_bytes)
    elif isinstance(obj, dict):
        t = decode_binary(obj, max_bytes)
    elif isinstance(obj, list):
        t = decode_json_lists(obj, max_bytes)
    else:
        raise WireError(
            "embeddings must be nested float lists or an object {data, dtype, shape}, "
            f"got {type(obj).__name__}"
        )
    check_shape(t)
    return t


def decode_binary(obj: dict, max_bytes: int) -> torch.Tensor:
    unknown = set(obj) - {"data", "dtype", "shape", "encoding"}
    if unknown:
        raise WireError(f"unknown keys in binary embeddings: {sorted(unknown)}")
    if obj.get("encoding", "base64") != "base64":
        raise WireError(f"unknown encoding {obj.get('encoding')!r}: only 'base64' is supported")
    name = obj.get("dtype")
    shape, nbytes = declared_size(name, obj.get("shape"), max_bytes)
    itemsize = DTYPES[name].itemsize
    data = obj.get("data")
    if not isinstance(data, str):
        raise WireError("binary embeddings need 'data' as a base64 string")
    if len(data) != 4 * math.ceil(nbytes / 3):
        raise WireError(
            f"base64 data of {len(data)} chars cannot hold shape {shape} of {name} "
            f"({nbytes} bytes = {4 * math.ceil(nbytes / 3)} base64 chars)"
        )
    try:
        raw = b64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WireError(f"malformed base64 in embeddings data: {e}") from None
    if len(raw) != nbytes:
        raise WireError(f"data holds {len(raw)} bytes but shape {shape} of {name} needs {nbytes}")
    if sys.byteorder != "little":  # pragma: no cover
        raw = _byteswap(raw, itemsize)
    if nbytes == 0:
        return torch.empty(shape, dtype=DTYPES[name])
    # A view over the immutable decoded bytes (no copy): decoded spans are only ever read, and
    # the engine copies them when it converts or concatenates rows.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=DTYPES[name]).reshape(shape)


def declared_size(name: Any, shape: Any, max_bytes: int) -> tuple[list[int], int]:
    """A binary tensor's declared dtype name and shape, checked (shape ``[n, hidden]`` or
    ``[hidden]``, the float32 size within ``max_bytes``) before anything is read or allocated:
    the shape as ``[n, hidden]`` and its size in bytes."""
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) not in (1, 2)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"shape must be [n, hidden] or [hidden] of non-negative ints, got {shape!r}")
    if len(shape) == 1:
        shape = [1, shape[0]]
    if math.prod(shape) * 4 > max_bytes:
        raise too_big(f"embeddings of shape {shape}", max_bytes)
    return shape, math.prod(shape) * DTYPES[name].itemsize


def decode_json_lists(obj: list, max_bytes: int) -> torch.Tensor:
    """Nested lists -> float32 tensor; rows must be equally long lists of plain numbers."""
    if not obj:
        raise WireError("empty embeddings: a span needs at least one row")
    rows = obj if isinstance(obj[0], (list, tuple)) else [obj]
    width = len(rows[0])
    if len(rows) * width * 4 > max_bytes:
        raise too_big(f"embeddings of {len(rows)} x {width}", max_bytes)
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise WireError(f"row {i} is a {type(row).__name__}, expected a list of numbers")
        if len(row) != width:
            raise WireError(f"ragged embeddings: row {i} has {len(row)} values, row 0 has {width}")
        for v in row:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise WireError(f"row {i} holds a {type(v).__name__}, expected numbers only")
    return torch.tensor(rows, dtype=torch.float32)


def check_tensor(t: torch.Tensor, hidden_size: int | None = None) -> None:
    """Shape and value checks that hold for every span, whatever the encoding."""
    check_shape(t, hidden_size)
    first_bad = first_non_finite_row(t)
    if first_bad is not None:
        raise non_finite(first_bad)


def non_finite(first_bad: int) -> WireError:
    """The error of a span whose row ``first_bad`` is the first to hold a NaN or an Inf."""
    return WireError(f"embeddings contain NaN or Inf (first in row {first_bad})")


def check_shape(t: torch.Tensor, hidden_size: int | None = None) -> None:
    if t.dim() != 2:
        raise WireError(f"embeddings must be 2-D [n, hidden], got shape {list(t.shape)}")
    n, h = t.shape
    if n == 0 or h == 0:
        raise WireError(f"empty embeddings: shape {list(t.shape)} has no rows or no columns")
    if n > MAX_ROWS:
        raise WireError(f"a span of {n} rows exceeds the limit of {MAX_ROWS}")
    if hidden_size is not None and h != hidden_size:
        raise WireError(f"embeddings have hidden size {h} but the model's hidden size is {hidden_size}")


def first_non_finite_row(t: torch.Tensor) -> int | None:
    """The first row holding a NaN or Inf, or None.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum proves every value finite
    (one fast reduction); a non-finite sum (NaN/Inf, or a finite overflow) gets the full scan.
    """
    if torch.isfinite(t.sum()) or torch.isfinite(t).all():
        return None
    return int((~torch.isfinite(t)).any(dim=1).nonzero()[0])


def _byteswap(raw: bytes, itemsize: int) -> bytes:  # pragma: no cover
    return np.frombuffer(raw, dtype=np.dtype(f"u{itemsize}")).byteswap().tobytes()
