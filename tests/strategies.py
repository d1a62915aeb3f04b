"""Hypothesis strategies shared by the fuzzers (``unit/test_fuzz_wire.py``, ``server/test_fuzz_http.py``):
any JSON value, and wire tensors well-formed or not."""

from __future__ import annotations

import base64

from hypothesis import strategies as st

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
