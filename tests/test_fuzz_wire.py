"""Property-based fuzzing of the wire decoder: any input is a finite 2-D tensor or a WireError,
never another exception, and declared sizes are checked before anything is allocated."""

from __future__ import annotations

import base64
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_embeds_srt import wire
from sgl_embeds_srt.parse import segments_from_wire

LIMIT = 1 << 20
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))
scalars = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=5))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=40)
shapes = st.one_of(st.lists(st.integers(-5, 2**40), min_size=0, max_size=4), json_values)
datas = st.one_of(st.binary(max_size=256).map(lambda b: base64.b64encode(b).decode()), st.text(max_size=64), json_values)
binary_objects = st.fixed_dictionaries(
    {"data": datas, "dtype": st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int8", "float64", ""]), json_values), "shape": shapes},
    optional={"encoding": st.one_of(st.just("base64"), json_values), "extra": json_values},
)
rows = st.lists(st.lists(numbers, min_size=0, max_size=8), min_size=0, max_size=6)
payloads = st.one_of(binary_objects, rows, json_values)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_decoder_returns_a_checked_tensor_or_a_wire_error(payload):
    try:
        t = wire.decode_tensor(payload, LIMIT)
    except wire.WireError:
        return
    assert t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and bool(t.isfinite().all())
    assert t.numel() * 4 <= LIMIT


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_ids", "embeds", "x"])},
                                                 optional={"text": json_values, "input_ids": json_values, "embeds": payloads}),
                          json_values), max_size=5))
def test_segment_parser_raises_only_wire_errors(items):
    try:
        segments_from_wire(items, LIMIT)
    except wire.WireError:
        pass


@given(st.integers(1, 2**31), st.integers(1, 2**31), st.sampled_from(sorted(wire.DTYPES)))
@settings(max_examples=100, deadline=None)
def test_huge_declared_shapes_with_tiny_payloads_cost_nothing(n, h, dtype):
    t0 = time.perf_counter()
    try:
        wire.decode_tensor({"data": "AAAA", "dtype": dtype, "shape": [n, h]}, LIMIT)
    except wire.WireError:
        pass
    assert time.perf_counter() - t0 < 0.05


def test_deep_json_nesting_is_a_wire_error_not_a_crash():
    deep: list = [1.0]
    for _ in range(5000):
        deep = [deep]
    try:
        wire.decode_tensor(deep, LIMIT)
    except wire.WireError as e:
        assert "expected numbers" in str(e) or "ragged" in str(e)
    else:
        raise AssertionError("deeply nested lists were accepted")
