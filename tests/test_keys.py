"""Content keys (no server): row digests, handles, the routing hint, and a kept span's rows hashed
once per request, for its handle and its placeholder ids together."""

from __future__ import annotations

import pytest
import torch

from sgl_embeds_srt import keys, placeholders, prompts, wire
from sgl_embeds_srt.handles import SpanStore
from sgl_embeds_srt.lru import LRU, nbytes
from sgl_embeds_srt.parse import parse_prompts
from sgl_embeds_srt.prompts import ModelSpec, build_ids

# Pinned: a change here changes every handle and placeholder id. Bump keys.KEY_SCHEME with it
# (clients and servers of different schemes never agree on a handle) and update docs/concepts.md.
PINNED_ROWS = torch.arange(8, dtype=torch.float32).reshape(2, 4)
PINNED_HANDLE = "span-a6092ba1c6f09539b7b1edb5b705ba7e22eed828d0e574df198a8ccda90795a1"
PINNED_IDS = [7411569373720037247, 8559117142896220527]


def test_the_key_scheme_is_pinned():
    assert keys.KEY_SCHEME == "blake3-rows/v2"
    assert keys.span_handle(PINNED_ROWS) == PINNED_HANDLE
    assert placeholders.placeholder_ids(PINNED_ROWS) == PINNED_IDS


def test_the_pinned_keys_are_the_same_without_the_native_pass(monkeypatch):
    monkeypatch.setattr(keys, "native_rows", None)
    assert keys.span_handle(PINNED_ROWS) == PINNED_HANDLE
    assert placeholders.placeholder_ids(PINNED_ROWS) == PINNED_IDS


def test_the_native_pass_gives_each_rows_own_blake3_digest():
    """csrc/row_digests.c against one blake3 call per row: every width class of the BLAKE3 tree
    (a partial block, one block, a chunk and one byte more, 2-3 chunks, a 17-chunk tree), row
    counts around its 16 lanes, one thread and several."""
    assert keys.native_rows is not None, "setup.py did not build sgl_embeds_srt._row_digests (a C compiler?)"
    rng = torch.Generator().manual_seed(0)
    for width in [1, 63, 64, 65, 1023, 1024, 1025, 1152, 2048, 2049, 3073, 8192, 17000]:
        for n in [1, 15, 16, 17, 40]:
            raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=rng).numpy().tobytes()
            expected = keys.row_digests_by_row(memoryview(raw), width)
            for threads in (1, 3):
                assert keys.native_rows.digests(raw, width, keys._ROW_KEY, threads) == expected, (width, n, threads)
    with pytest.raises(ValueError, match="divide"):
        keys.native_rows.digests(b"abc", 2, keys._ROW_KEY)


def test_row_digests_are_per_row_and_the_handle_is_built_from_them():
    x = torch.randn(5, 16)
    digests = keys.row_digests(x)
    size = keys.ROW_DIGEST_BYTES
    assert len(digests) == 5 * size and len({digests[i:i + size] for i in range(0, 5 * size, size)}) == 5
    assert keys.row_digests(x[2:4]) == digests[2 * size:4 * size]  # position-independent
    y = x.clone()
    y[3, 7] += 1e-3
    changed = keys.row_digests(y)
    assert changed[3 * size:4 * size] != digests[3 * size:4 * size]
    assert changed[:3 * size] == digests[:3 * size] and changed[4 * size:] == digests[4 * size:]
    assert keys.span_handle(x) == keys.span_handle(x, digests) == keys.span_handle(x.clone())
    assert keys.span_handle(y) != keys.span_handle(x)
    # dtype and shape are part of a handle: the same bytes read otherwise are another span
    assert keys.span_handle(x.reshape(10, 8)) != keys.span_handle(x)
    assert keys.span_handle(x.view(torch.int32)) != keys.span_handle(x)
    assert keys.row_digests(torch.zeros(3, 0)) == keys.row_digests(torch.zeros(1, 0)) * 3


def test_each_row_has_its_own_part_of_the_routing_hint():
    x = torch.randn(4, 32)
    hint, width = keys.route_rows(x), keys.ROUTE_CHARS_PER_ROW
    assert len(hint) == 4 * width
    assert [hint[i * width:(i + 1) * width] for i in range(4)] == [keys.route_rows(x[i:i + 1]) for i in range(4)]
    assert len({hint[i * width:(i + 1) * width] for i in range(4)}) == 4
    assert hint == keys.route_rows(x, keys.row_digests(x)) and hint[:width] == keys.row_digests(x[:1])[:3].hex()


def _spec(dtype: torch.dtype) -> ModelSpec:
    return ModelSpec(hidden_size=16, dtype=dtype, vocab_size=1000, context_len=4096, tokenizer=None)


def _counting_row_digests(monkeypatch) -> list:
    """Every call to ``keys.row_digests`` (the one hashing pass over a span's bytes), by shape,
    on a server that has remembered no span's ids yet (another test's may be the same rows in
    another model dtype)."""
    monkeypatch.setattr(placeholders, "_KEPT", LRU(1 << 20, nbytes))
    calls, real = [], keys.row_digests

    def counting(t):
        calls.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(keys, "row_digests", counting)
    monkeypatch.setattr(placeholders, "row_digests", counting)
    monkeypatch.setattr(prompts, "row_digests", counting)
    return calls


def test_a_kept_span_is_hashed_once_for_its_handle_and_its_ids(monkeypatch):
    store, rows = SpanStore(1 << 20), torch.randn(6, 16)
    expected = placeholders.placeholder_ids(rows)
    calls = _counting_row_digests(monkeypatch)
    inline = {"input_segments": [{"type": "input_ids", "input_ids": [1, 2]},
                                 {"type": "embeds", "embeds": wire.encode_tensor(rows)}],
              "keep_spans": True}
    [segments], _ = parse_prompts(inline, 1 << 20, store)
    ids, _ = build_ids(segments, _spec(torch.float32))
    assert ids == [1, 2, *expected] and calls == [(6, 16)]
    calls.clear()
    by_handle = {"input_segments": [{"type": "embeds", "embeds": {"handle": segments[1].handle}}]}
    [segments], _ = parse_prompts(by_handle, 1 << 20, store)
    assert build_ids(segments, _spec(torch.float32))[0] == expected and calls == []


def test_rows_cast_to_the_model_dtype_are_hashed_as_the_model_sees_them(monkeypatch):
    store, rows = SpanStore(1 << 20), torch.randn(3, 16)
    expected = placeholders.placeholder_ids(rows.bfloat16())
    calls = _counting_row_digests(monkeypatch)
    body = {"input_embeds": wire.encode_tensor(rows, "base64", "float32"), "keep_spans": True}
    [segments], _ = parse_prompts(body, 1 << 20, store)
    assert build_ids(segments, _spec(torch.bfloat16))[0] == expected
    assert calls == [(3, 16), (3, 16)]  # the rows as sent (the handle), then as cast (the ids)
    calls.clear()
    unkept = {"input_embeds": wire.encode_tensor(rows, "base64", "float32")}
    [segments], _ = parse_prompts(unkept, 1 << 20, store)
    # sent again, not kept: the rows as sent are hashed for the span's content key, which is the
    # kept span's handle, so its ids are the remembered ones
    assert build_ids(segments, _spec(torch.bfloat16))[0] == expected and calls == [(3, 16)]
    # no ids remembered, rows in the model's dtype: one pass gives the key and the ids
    expected_float32 = placeholders.placeholder_ids(rows)
    monkeypatch.setattr(placeholders, "_KEPT", LRU(1 << 20, nbytes))
    calls.clear()
    assert build_ids(segments, _spec(torch.float32))[0] == expected_float32 and calls == [(3, 16)]
