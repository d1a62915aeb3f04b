"""Property-based fuzzing of the wire decoders (JSON tensors, and the binary body): any input is a
finite 2-D tensor or a WireError, never another exception, and declared sizes are checked before
anything is allocated."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_embeds_protocol import binary_body, keys, wire
from sgl_embeds_srt.parse import decode_span, has_span_fields, parse_prompts, segments_from_wire
from sgl_embeds_protocol.segments import Span
from strategies import json_values, payloads, shapes

LIMIT = 1 << 20


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_decoder_returns_a_checked_tensor_or_a_wire_error(payload):
    try:
        span = decode_span(payload, LIMIT)  # decoded, then its values checked as it is hashed
    except wire.WireError:
        return
    t = span.rows
    assert span.row_digests == keys.row_digests(t)
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
    """Refused from the declared size before anything is allocated: at 2**31 x 2**31 rows an
    allocation would fail or take minutes; the bound is loose because other processes share
    the cores (a pooled server starting, say)."""
    t0 = time.perf_counter()
    with pytest.raises(wire.WireError):
        wire.decode_tensor({"data": "AAAA", "dtype": dtype, "shape": [n, h]}, LIMIT)
    assert time.perf_counter() - t0 < 1.0


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


# The binary body (binary_body.py): random heads, ranges and buffers, through the decoder and the
# parser every route uses, raise only WireError / ValueError, and what is accepted is checked.
any_ranges = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int8"]), json_values),
     "shape": shapes,
     "data_offsets": st.one_of(st.lists(st.integers(-5, 300), min_size=2, max_size=2),
                               st.lists(st.integers(-5, 2**66), max_size=3), json_values)},
    optional={"extra": json_values},
)


@st.composite
def fitting_ranges(draw) -> dict:
    """A range whose length fits its dtype and shape (mostly), somewhere in a small buffer."""
    dtype = draw(st.sampled_from(sorted(wire.DTYPES)))
    shape = draw(st.lists(st.integers(0, 6), min_size=1, max_size=2))
    begin = draw(st.integers(0, 160))
    end = begin + wire.DTYPES[dtype].itemsize * math.prod(shape) + draw(st.sampled_from([0, 0, 0, 1, -1]))
    offsets = draw(st.sampled_from([[begin, end]] * 4 + [  # and near misses of every kind
        [float(begin), float(end)], [str(begin), end], [bool(begin), end], [begin], [begin, end, end],
        [end, begin], [-begin - 1, end - begin - 1], None, {"begin": begin}]))
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


byte_ranges = st.one_of(fitting_ranges(), any_ranges)
segments_with_ranges = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["embeds", "text"]), "embeds": byte_ranges},
                          optional={"image_grid_thw": json_values}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)}), json_values), max_size=4)
heads = st.one_of(
    st.fixed_dictionaries({"input_embeds": st.one_of(byte_ranges, st.lists(byte_ranges, max_size=3))},
                          optional={"keep_spans": json_values, "text": json_values}),
    st.fixed_dictionaries({"input_segments": st.one_of(segments_with_ranges, st.lists(segments_with_ranges, max_size=2))}),
    st.fixed_dictionaries({"embeds": byte_ranges}),
    st.dictionaries(st.text(max_size=6), st.one_of(json_values, byte_ranges), max_size=4),
    json_values,
)


# random bytes, or finite values in every dtype (0x3c00 is 1.0 in float16; 0x3c003c00 finite)
buffers = st.one_of(st.binary(max_size=320), st.integers(0, 400).map(lambda n: (b"\x00\x3c" * 200)[:n]))


def _binary_body(head, buffer: bytes, declared: int | None) -> bytes:
    raw = json.dumps(head).encode()  # NaN, Inf and ints past 64 bits included: not JSON to orjson
    return (len(raw) if declared is None else declared).to_bytes(8, "little") + raw + buffer


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads, buffers, st.one_of(st.none(), st.none(), st.integers(0, 2**64 - 1)), st.integers(0, 400))
def test_binary_bodies_decode_to_checked_spans_or_a_value_error(head, buffer, declared, cut):
    body = _binary_body(head, buffer, declared)
    body = body[:len(body) - cut] if cut < 40 else body  # truncated now and then
    try:
        tensors = _parsed_spans(body)
    except ValueError:  # WireError included
        return
    for t in tensors:
        assert t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and bool(t.isfinite().all())
        assert t.numel() * 4 <= LIMIT


def _parsed_spans(body: bytes) -> list:
    """The spans of a binary body as the routes parse them; ValueError (WireError included) on any
    fault."""
    request = binary_body.decode_body(body, LIMIT)
    prompts = parse_prompts(request, LIMIT)[0] if has_span_fields(request) else []
    return [s.rows for p in prompts for s in p if isinstance(s, Span)]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9), st.sampled_from(sorted(wire.DTYPES))),
                min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3), st.integers(0, 10**6),
       st.booleans())
def test_mutated_binary_bodies_decode_to_checked_spans_or_a_value_error(spans, flips, cut, truncate):
    """Valid bodies with bytes changed (head or rows) and cut short: near misses reach every check."""
    rows = [torch.randn(n, h).to(wire.DTYPES[d]) for n, h, d in spans]
    body = bytearray(binary_body.encode_body({"input_segments": [{"type": "embeds", "embeds": r} for r in rows]})[0])
    for at, value in flips:
        body[at % len(body)] = value
    if truncate:
        body = body[:cut % len(body)]
    try:
        tensors = _parsed_spans(bytes(body))
    except ValueError:
        return
    for t in tensors:
        assert t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and bool(t.isfinite().all())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_a_binary_body_or_a_wire_error(body):
    try:
        assert isinstance(binary_body.decode_body(body, LIMIT), dict)
    except wire.WireError:
        pass


@given(st.integers(1, 2**31), st.integers(1, 2**31), st.sampled_from(sorted(wire.DTYPES)))
@settings(max_examples=100, deadline=None)
def test_huge_declared_ranges_in_tiny_binary_bodies_cost_nothing(n, h, dtype):
    body = _binary_body({"input_embeds": {"dtype": dtype, "shape": [n, h], "data_offsets": [0, n * h * 2]}},
                        b"\0" * 8, None)
    t0 = time.perf_counter()
    try:
        binary_body.decode_body(body, LIMIT)
    except wire.WireError:
        pass
    assert time.perf_counter() - t0 < 0.05


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 40), st.sampled_from(sorted(wire.DTYPES))),
                min_size=1, max_size=4))
def test_binary_bodies_round_trip(spans):
    rows = [torch.randn(n, h).to(wire.DTYPES[d]) for n, h, d in spans]
    request = {"input_segments": [{"type": "embeds", "embeds": r} for r in rows]}
    decoded = binary_body.decode_body(binary_body.encode_body(request)[0], LIMIT)
    assert all(torch.equal(s["embeds"], r) for s, r in zip(decoded["input_segments"], rows))
