"""Wire format: round trips, and a clear WireError for every malformed payload (no server)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from sgl_embeds_protocol import wire
from sgl_embeds_srt.parse import decode_span


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_base64_round_trip_is_exact_in_each_dtype(dtype):
    x = torch.randn(7, 33).to(wire.DTYPES[dtype])
    enc = wire.encode_tensor(x, "base64", dtype)
    assert enc["dtype"] == dtype and enc["shape"] == [7, 33]
    y = wire.decode_tensor(enc)
    assert y.dtype == x.dtype and torch.equal(y, x)


def test_json_lists_round_trip_and_one_dim_is_one_row():
    x = torch.randn(3, 5)
    assert torch.equal(wire.decode_tensor(wire.encode_tensor(x, "json")), x)
    assert wire.decode_tensor([1.0, 2.0, 3.0]).shape == (1, 3)


def test_numpy_and_lists_are_accepted_client_side():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert wire.encode_tensor(a)["shape"] == [2, 3]
    assert wire.as_2d_tensor([[1, 2], [3, 4]]).dtype == torch.float32


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


BAD = {
    "ragged rows": ([[1.0, 2.0], [3.0]], "ragged"),
    "empty span": ([], "empty"),
    "strings in rows": ([["a", "b"]], "numbers only"),
    "nan": ([[1.0, float("nan")]], "NaN or Inf"),
    "inf": ([[float("inf"), 1.0]], "NaN or Inf"),
    "unknown dtype": ({"data": "AAAA", "dtype": "int8", "shape": [1, 3]}, "unknown dtype"),
    "shape vs bytes": ({"data": _b64(torch.zeros(2, 4)), "dtype": "float32", "shape": [3, 4]}, "cannot hold shape"),
    "malformed base64": ({"data": "!" * 44, "dtype": "float32", "shape": [2, 4]}, "malformed base64"),
    "truncated base64": ({"data": _b64(torch.zeros(2, 4))[:-4], "dtype": "float32", "shape": [2, 4]}, "cannot hold shape"),
    "huge declared shape": ({"data": "AAAA", "dtype": "float32", "shape": [1 << 30, 1 << 20]}, "size limit"),
    "negative shape": ({"data": "", "dtype": "float32", "shape": [-1, 4]}, "non-negative"),
    "three dims": ({"data": "", "dtype": "float32", "shape": [1, 1, 1]}, "shape must be"),
    "unknown key": ({"data": "", "dtype": "float32", "shape": [0, 4], "pickle": 1}, "unknown keys"),
    "zero rows": ({"data": "", "dtype": "float32", "shape": [0, 4]}, "empty"),
    "not a tensor": ("hello", "nested float lists"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_payloads_raise_wire_error_naming_the_problem(case):
    payload, message = BAD[case]
    with pytest.raises(wire.WireError, match=message):
        decode_span(payload, wire.MAX_SPAN_BYTES)  # decoded, then its values checked as hashed


def test_size_limit_is_checked_before_decoding():
    x = torch.zeros(64, 64)
    with pytest.raises(wire.WireError, match="size limit"):
        wire.decode_tensor(wire.encode_tensor(x), max_bytes=1000)
    with pytest.raises(wire.WireError, match="size limit"):
        wire.decode_tensor(x.tolist(), max_bytes=1000)


def test_hidden_size_is_checked():
    with pytest.raises(wire.WireError, match="hidden size 5 but the model's hidden size is 64"):
        wire.check_tensor(torch.zeros(2, 5), hidden_size=64)


def test_large_finite_values_are_accepted_even_when_their_sum_overflows():
    wire.check_tensor(torch.full((4, 8), 3e38))  # the sum is inf, every value is finite
    with pytest.raises(wire.WireError, match="first in row 2"):
        wire.check_tensor(torch.cat([torch.full((2, 8), 3e38), torch.tensor([[float("nan")] * 8])]))
