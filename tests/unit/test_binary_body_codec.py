"""The binary request body (no server): round trips, views of the body, and a clear WireError
for every malformed frame, naming the field."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest
import torch

from sgl_embeds_protocol import binary_body, wire
from sgl_embeds_srt.parse import parse_prompts, segments_from_wire


def frame(head: dict | bytes, buffer: bytes = b"") -> bytes:
    """A binary body written by hand: the head's length, the head, the buffer."""
    raw = head if isinstance(head, bytes) else orjson.dumps(head)
    return struct.pack("<Q", len(raw)) + raw + buffer


def one_span(ref: dict, buffer: bytes = b"", field: str = "input_embeds") -> bytes:
    return frame({field: ref}, buffer)


def f32(n: int, h: int, begin: int = 0) -> dict:
    return {"dtype": "float32", "shape": [n, h], "data_offsets": [begin, begin + 4 * n * h]}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 576)])
def test_spans_round_trip_exactly_as_views_of_the_body(dtype, shape):
    a = torch.randn(*shape).to(wire.DTYPES[dtype])
    b = torch.randn(3, shape[1]).to(wire.DTYPES[dtype])
    request = {"input_segments": [{"type": "text", "text": "look "},
                                  {"type": "embeds", "embeds": a, "image_grid_thw": [1, 2, 8]},
                                  {"type": "input_ids", "input_ids": [5, 6]},
                                  {"type": "embeds", "embeds": b}],
               "sampling_params": {"max_new_tokens": 3}, "keep_spans": True}
    body, content_type = binary_body.encode_body(request)
    assert content_type == binary_body.CONTENT_TYPE and binary_body.is_binary(content_type)
    decoded = binary_body.decode_body(body)
    got_a, got_b = decoded["input_segments"][1]["embeds"], decoded["input_segments"][3]["embeds"]
    assert got_a.dtype == a.dtype and torch.equal(got_a, a) and torch.equal(got_b, b)
    assert decoded == {**request, "input_segments": decoded["input_segments"]}
    assert [s.get("image_grid_thw") for s in decoded["input_segments"]] == [None, [1, 2, 8], None, None]
    start = np.frombuffer(body, np.uint8).ctypes.data
    assert start <= got_a.data_ptr() < got_b.data_ptr() < start + len(body)  # no copy


def test_the_parts_are_the_body_and_view_the_rows_without_a_copy():
    """What a client posts (``encode_parts``, sent one after another): the body's bytes, each
    span's part a view of its tensor (no copy of the rows on the client)."""
    a, b = torch.randn(5, 24).bfloat16(), torch.randn(3, 24)
    request = {"input_segments": [{"type": "embeds", "embeds": a}, {"type": "text", "text": "x"},
                                  {"type": "embeds", "embeds": b}]}
    parts = binary_body.encode_parts(request)
    assert b"".join(parts) == binary_body.encode_body(request)[0]
    views = [p for p in parts if isinstance(p, memoryview)]
    assert [np.frombuffer(v, np.uint8).ctypes.data for v in views] == [a.data_ptr(), b.data_ptr()]


def test_batches_uploads_chat_parts_numpy_and_a_wire_dtype():
    rows = [torch.randn(2, 8), torch.randn(4, 8)]
    batch = binary_body.decode_body(binary_body.encode_body({"input_embeds": rows}, "float16")[0])
    assert [t.dtype for t in batch["input_embeds"]] == [torch.float16] * 2
    assert all(torch.equal(t, r.half()) for t, r in zip(batch["input_embeds"], rows))
    upload = binary_body.decode_body(binary_body.encode_body({"embeds": np.ones((3, 8), np.float32)})[0])
    assert torch.equal(upload["embeds"], torch.ones(3, 8))
    chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "input_embeds", "input_embeds": rows[0]}]}]}
    part = binary_body.decode_body(binary_body.encode_body(chat)[0])["messages"][0]["content"][1]
    assert torch.equal(part["input_embeds"], rows[0])
    one_dim = binary_body.decode_body(binary_body.encode_body({"input_embeds": torch.ones(8)})[0])
    assert one_dim["input_embeds"].shape == (1, 8)


def test_the_parser_reads_a_binary_body_as_it_reads_json():
    rows = torch.randn(5, 16).bfloat16()
    request = {"input_segments": [{"type": "text", "text": "a"}, {"type": "embeds", "embeds": rows}]}
    as_json = {"input_segments": [request["input_segments"][0],
                                  {"type": "embeds", "embeds": wire.encode_tensor(rows)}]}
    [binary], _ = parse_prompts(binary_body.decode_body(binary_body.encode_body(request)[0]), 1 << 20)
    [json_], _ = parse_prompts(as_json, 1 << 20)
    assert binary[0] == json_[0] and torch.equal(binary[1].rows, json_[1].rows)


def test_a_range_not_aligned_to_its_dtype_is_copied():
    rows = torch.randn(3, 4)
    body = one_span({"dtype": "float32", "shape": [3, 4], "data_offsets": [1, 49]},
                    b"\0" + rows.numpy().tobytes())
    t = binary_body.decode_body(body)["input_embeds"]
    assert torch.equal(t, rows) and t.data_ptr() % 4 == 0


def test_content_types():
    assert binary_body.is_binary(b"Application/X-SGL-Embeds; charset=binary")
    assert not binary_body.is_binary("application/json") and not binary_body.is_binary(None)


BAD = {
    "empty body": (b"", "8-byte length of its JSON head; this one has 0 bytes"),
    "head past the body": (struct.pack("<Q", 100) + b"{}", "declared 100 bytes long, but only 2"),
    "head not JSON": (frame(b"{nope"), "not JSON"),
    "head not UTF-8": (frame(b'{"a": "\xff"}'), "not JSON"),
    "head not an object": (frame([1, 2]), "must be a JSON object (the request), got list"),
    "unknown dtype": (one_span({**f32(1, 4), "dtype": "float64"}, bytes(16)),
                      "input_embeds: unknown dtype 'float64'"),
    "bad shape": (one_span({**f32(1, 4), "shape": [1, 1, 4]}, bytes(16)), "input_embeds: shape must be"),
    "huge shape": (one_span({"dtype": "float32", "shape": [1 << 30, 1 << 20], "data_offsets": [0, 4]}),
                   "exceed the size limit"),
    "offsets not a pair": (one_span({**f32(1, 4), "data_offsets": [0]}, bytes(16)), "data_offsets must be"),
    "negative offset": (one_span({**f32(1, 4), "data_offsets": [-16, 0]}, bytes(16)), "data_offsets must be"),
    "end before begin": (one_span({**f32(0, 4), "data_offsets": [8, 0]}, bytes(16)), "data_offsets must be"),
    "bool offset": (one_span({**f32(1, 1), "data_offsets": [False, 4]}, bytes(4)), "data_offsets must be"),
    "range vs shape": (one_span({**f32(1, 4), "data_offsets": [0, 12]}, bytes(16)),
                       "data_offsets [0, 12] hold 12 bytes, but shape [1, 4] of float32 needs 16"),
    "truncated body": (one_span(f32(2, 4), bytes(31)), "end past the 31 bytes after the head"),
    "unknown key": (one_span({**f32(1, 4), "data": "AAAA"}, bytes(16)), "unknown keys in a byte range: ['data']"),
    "overlap": (frame({"input_segments": [{"type": "embeds", "embeds": f32(2, 4)},
                                          {"type": "embeds", "embeds": f32(1, 4, begin=16)}]}, bytes(32)),
                "input_segments[1].embeds: data_offsets [16, 32] overlap those of input_segments[0].embeds"),
    "same range twice": (frame({"input_embeds": [f32(1, 4), f32(1, 4)]}, bytes(16)), "overlap"),
    "range at no span's place": (frame({"sampling_params": {"stop": f32(1, 4)}}, bytes(16)),
                                 "sampling_params.stop: a byte range stands only where a span goes"),
    "range in the wrong field of a segment": (
        frame({"input_segments": [{"type": "text", "embeds": f32(1, 4)}]}, bytes(16)),
        "input_segments[0].embeds: a byte range stands only"),
    "range nested too deep in a batch": (frame({"input_embeds": [[f32(1, 4)]]}, bytes(16)),
                                         "input_embeds[0][0]: a byte range stands only"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_bodies_raise_wire_error_naming_the_field(case):
    body, message = BAD[case]
    with pytest.raises(wire.WireError) as e:
        binary_body.decode_body(body, max_bytes=1 << 20)
    assert message in str(e.value)


def test_values_are_checked_where_every_span_is_parsed():
    rows = torch.randn(3, 4)
    rows[2, 1] = float("nan")
    body = binary_body.encode_body({"input_segments": [{"type": "embeds", "embeds": rows}]})[0]
    decoded = binary_body.decode_body(body)
    with pytest.raises(wire.WireError, match=r"segment 0: embeddings contain NaN or Inf \(first in row 2\)"):
        segments_from_wire(decoded["input_segments"])
    empty = binary_body.decode_body(one_span(f32(0, 4)))
    with pytest.raises(wire.WireError, match="empty"):
        parse_prompts(empty, 1 << 20)


def test_the_size_limit_counts_each_span_as_float32():
    body = binary_body.encode_body({"input_embeds": torch.zeros(64, 64).half()})[0]
    binary_body.decode_body(body, max_bytes=64 * 64 * 4)
    with pytest.raises(wire.WireError, match="size limit of 16383 bytes"):
        binary_body.decode_body(body, max_bytes=64 * 64 * 4 - 1)
