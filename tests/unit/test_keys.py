"""Content keys (no server): row digests, handles, the routing hint, and a kept span's rows hashed
once per request, for its handle and its placeholder ids together."""

from __future__ import annotations

import pytest
import torch
from blake3 import blake3

from sgl_embeds.writer import SpanWriter
from sgl_embeds_protocol import binary_body, keys, wire
from sgl_embeds_srt import placeholders
from sgl_embeds_srt.handles import SpanStore
from sgl_embeds_protocol.lru import LRU, nbytes
from sgl_embeds_srt.parse import parse_prompts
from sgl_embeds_srt.prompts import ModelSpec, build_ids
from sgl_embeds_protocol.segments import Grid, Span, Text

# Pinned: a change here changes every handle and placeholder id. Bump keys.KEY_SCHEME with it
# (clients and servers of different schemes never agree on a handle) and update docs/concepts.md.
PINNED_ROWS = torch.arange(8, dtype=torch.float32).reshape(2, 4)
PINNED_HANDLE = "span-1ca2fefc424f9c236f33c271a72a2dcf00fafbf4035eebafc8453622d20a417a"
PINNED_IDS = [6169683634844634225, 8591161410362431493]


def test_the_key_scheme_is_pinned():
    assert keys.KEY_SCHEME == "blake3-rows/v3"
    assert keys.content_key(PINNED_ROWS) == PINNED_HANDLE
    assert placeholders.placeholder_ids(PINNED_ROWS) == PINNED_IDS


def test_the_ids_are_what_docs_concepts_says():
    """The formula of docs/concepts.md, with the blake3 package alone."""
    context = "sgl_embeds blake3-rows/v3"
    for rows in (PINNED_ROWS, PINNED_ROWS.bfloat16()):
        row_blake3_key = blake3(f"row {rows.dtype}".encode(), derive_key_context=context).digest()
        expected = []
        for row in rows:
            digest = blake3(row.contiguous().view(torch.uint8).numpy().tobytes(), key=row_blake3_key).digest()
            expected.append(2**62 | int.from_bytes(digest[:8], "little") & (2**62 - 1))
        assert placeholders.placeholder_ids(rows) == expected


def test_the_same_bytes_in_another_dtype_are_other_rows():
    """bfloat16 and float16 rows of one width have bytes of one length: the row key names the
    dtype, so equal bytes read as other values never share a digest or a placeholder id."""
    as_bf16 = torch.randn(4, 16).bfloat16()
    as_f16 = as_bf16.view(torch.float16)  # the same bytes
    assert keys.raw_bytes(as_bf16) == keys.raw_bytes(as_f16)
    assert set(placeholders.placeholder_ids(as_bf16)).isdisjoint(placeholders.placeholder_ids(as_f16))
    assert keys.route_rows(as_bf16) != keys.route_rows(as_f16)


def test_the_pinned_keys_are_the_same_without_the_native_pass(monkeypatch):
    monkeypatch.setattr(keys, "native_rows", None)
    assert keys.content_key(PINNED_ROWS) == PINNED_HANDLE
    assert placeholders.placeholder_ids(PINNED_ROWS) == PINNED_IDS


def test_the_native_pass_gives_each_rows_own_blake3_digest():
    """csrc/row_digests.c against one blake3 call per row: every width class of the BLAKE3 tree
    (a partial block, one block, a chunk and one byte more, 2-3 chunks, a 17-chunk tree), row
    counts around its 16 lanes, one thread and several."""
    assert keys.native_rows is not None, "setup.py did not build sgl_embeds_protocol._row_digests (a C compiler?)"
    rng, key = torch.Generator().manual_seed(0), keys.row_blake3_key(torch.uint8)
    for width in [1, 63, 64, 65, 1023, 1024, 1025, 1152, 2048, 2049, 3073, 8192, 17000]:
        for n in [1, 15, 16, 17, 40]:
            raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=rng).numpy().tobytes()
            expected = keys.row_digests_by_row(memoryview(raw), width, key)
            for threads in (1, 3):
                assert keys.native_rows.digests(raw, width, key, threads) == expected, (width, n, threads)
    with pytest.raises(ValueError, match="divide"):
        keys.native_rows.digests(b"abc", 2, key)


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
    assert keys.content_key(x) == keys.content_key(x, digests) == keys.content_key(x.clone())
    assert keys.content_key(y) != keys.content_key(x)
    # dtype and shape are part of a handle: the same bytes read otherwise are another span
    assert keys.content_key(x.reshape(10, 8)) != keys.content_key(x)
    assert keys.content_key(x.view(torch.int32)) != keys.content_key(x)
    assert keys.row_digests(torch.zeros(3, 0)) == keys.row_digests(torch.zeros(1, 0)) * 3


def test_each_row_has_its_own_part_of_the_routing_hint():
    x = torch.randn(4, 32)
    hint, width = keys.route_rows(x), keys.ROUTE_CHARS_PER_ROW
    assert len(hint) == 4 * width
    assert [hint[i * width:(i + 1) * width] for i in range(4)] == [keys.route_rows(x[i:i + 1]) for i in range(4)]
    assert len({hint[i * width:(i + 1) * width] for i in range(4)}) == 4
    assert hint == keys.route_rows(x, keys.row_digests(x)) and hint[:width] == keys.row_digests(x[:1])[:3].hex()



def _hint_by_hand(rows: torch.Tensor, grid: str) -> str:
    """The routing hint of ``[Text("look "), Span(rows, grid), Text(" then")]`` as docs and
    keys.py describe it, written out here: 3 bytes of each row's digest in hex, the grid, the tag."""
    digests = keys.row_digests(rows)
    row_parts = "".join(digests[i:i + 3].hex() for i in range(0, len(digests), keys.ROW_DIGEST_BYTES))
    return "look " + row_parts + grid + " then" + " <sgl_embeds routing hint>"


@pytest.mark.parametrize("grid, written", [
    (Grid((1, 4, 8)), "<1x4x8>"), (Grid((1, 8, 4)), "<1x8x4>"), (None, ""),
    (Grid((2, 2, 8), video=True, second_per_grid_t=1.0), "<video 2x2x8 1.0s>"),
    (Grid((2, 2, 8), video=True, timestamps=(0.25, 1.25)), "<video 2x2x8 @0.25 @1.25>"),
])
def test_a_grid_spans_routing_hint_names_its_grid(grid, written):
    """The same rows under another grid (a clip's: another time) are another prefix (no shared
    KV): the hint the client sends (``SpanWriter``) and ``routing_text`` both say the grid, as
    written by hand here."""
    rows = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    prompt = [Text("look "), Span(rows, grid=grid), Text(" then")]
    sent = SpanWriter(16).fields("input_segments", [prompt], batch=False)["text"]
    assert sent == keys.routing_text(prompt) == _hint_by_hand(rows, written)


def test_two_grids_of_the_same_rows_give_two_hints():
    rows = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    grids = [Grid((1, 4, 8)), Grid((1, 8, 4)), Grid((2, 4, 4), video=True), None,
             Grid((2, 4, 4), video=True, second_per_grid_t=0.5), Grid((2, 4, 4), video=True, second_per_grid_t=1.0)]
    hints = {SpanWriter(16).fields("input_segments", [[Span(rows, grid=grid)]], batch=False)["text"]
             for grid in grids}
    assert len(hints) == len(grids), hints


def _spec(dtype: torch.dtype) -> ModelSpec:
    return ModelSpec(hidden_size=16, dtype=dtype, vocab_size=1000, context_len=4096, tokenizer=None)


def _counting_row_digests(monkeypatch) -> list:
    """Every hashing pass over a span's bytes (``keys.row_digests``, or ``keys.digests_and_first_non_finite``
    where the server checks the values in the same read), by shape,
    on a server that has remembered no span's ids yet (another test's may be the same rows in
    another model dtype)."""
    monkeypatch.setattr(placeholders, "_HELD_IDS", LRU(1 << 20, nbytes))
    calls, real, real_checked, inside_checked = [], keys.row_digests, keys.digests_and_first_non_finite, []

    def counting(t):
        if not inside_checked:  # the fallback of digests_and_first_non_finite: the same pass
            calls.append(tuple(t.shape))
        return real(t)

    def counting_checked(t):
        calls.append(tuple(t.shape))
        inside_checked.append(t)
        try:
            return real_checked(t)
        finally:
            inside_checked.pop()

    monkeypatch.setattr(keys, "row_digests", counting)
    monkeypatch.setattr(keys, "digests_and_first_non_finite", counting_checked)
    monkeypatch.setattr(placeholders, "row_digests", counting)
    return calls


def test_a_held_span_is_hashed_once_for_its_handle_and_its_ids(monkeypatch):
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
    by_handle = {"input_segments": [{"type": "embeds", "embeds": {"handle": segments[1].content_key}}]}
    [segments], _ = parse_prompts(by_handle, 1 << 20, store)
    assert build_ids(segments, _spec(torch.float32))[0] == expected and calls == []


@pytest.mark.parametrize("form", ["base64", "binary body"])
def test_the_server_reads_an_inline_span_once_for_its_values_check_its_key_and_its_ids(monkeypatch, form):
    """No values pass of its own: the check runs in the native pass that hashes the rows."""
    assert keys.native_rows is not None, "setup.py did not build sgl_embeds_protocol._row_digests"
    calls = _counting_row_digests(monkeypatch)
    value_passes = []
    monkeypatch.setattr(wire, "first_non_finite_row", lambda t: value_passes.append(t) or None)
    rows = torch.randn(6, 16).bfloat16()
    request = {"input_segments": [{"type": "embeds", "embeds": rows}]}
    if form == "base64":
        request = binary_body.json_form(request)
    else:
        request = binary_body.decode_body(binary_body.encode_body(request)[0])
    [segments], _ = parse_prompts(request, 1 << 20)
    ids, _ = build_ids(segments, _spec(torch.float32))
    assert calls == [(6, 16)] and value_passes == []
    assert ids == placeholders.placeholder_ids(rows)
    bad = rows.clone()
    bad[4, 3] = float("inf")
    request = binary_body.decode_body(binary_body.encode_body(
        {"input_segments": [{"type": "embeds", "embeds": bad}]})[0])
    with pytest.raises(wire.WireError, match=r"segment 0: embeddings contain NaN or Inf \(first in row 4\)"):
        parse_prompts(request, 1 << 20)


def test_rows_of_a_dtype_the_native_check_does_not_know_are_checked_too():
    """An in-process caller (the Engine) may hand float64 rows: hashed and checked as any other."""
    rows = torch.randn(4, 16, dtype=torch.float64)
    [segments], _ = parse_prompts({"input_segments": [{"type": "embeds", "embeds": rows}]}, 1 << 20)
    assert segments[0].row_digests == keys.row_digests(rows)
    assert build_ids(segments, _spec(torch.float32))[0] == placeholders.placeholder_ids(rows.float())
    rows[2, 5] = float("nan")
    with pytest.raises(wire.WireError, match=r"NaN or Inf \(first in row 2\)"):
        parse_prompts({"input_segments": [{"type": "embeds", "embeds": rows}]}, 1 << 20)


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
    # no ids remembered, rows in the model's dtype: the digests made as the span was decoded
    # give the key and the ids, with no second pass
    expected_float32 = placeholders.placeholder_ids(rows)
    monkeypatch.setattr(placeholders, "_HELD_IDS", LRU(1 << 20, nbytes))
    calls.clear()
    assert build_ids(segments, _spec(torch.float32))[0] == expected_float32 and calls == []


def test_rows_whose_cast_is_exact_stay_as_sent_and_are_hashed_once(monkeypatch):
    """bfloat16 / float16 rows to a float32 model: one pass over the bytes as sent gives the
    content key and the ids, and the rows reach the transport uncast (the model casts them)."""
    calls = _counting_row_digests(monkeypatch)
    rows = torch.randn(5, 16).bfloat16()
    ids, prompt_rows = build_ids([Span(rows)], _spec(torch.float32))
    assert calls == [(5, 16)] and ids == placeholders.placeholder_ids(rows)
    assert prompt_rows.embeds is rows
    assert ids != placeholders.placeholder_ids(rows.float())  # another dtype: other rows
    # the same bytes as float16 are other values: other ids, never the bfloat16 rows' KV
    f16_ids, f16_rows = build_ids([Span(rows.view(torch.float16))], _spec(torch.float32))
    assert set(f16_ids).isdisjoint(ids) and f16_rows.embeds.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_native_pass_finds_the_first_non_finite_row_as_torch_does(dtype):
    """``digests_and_first_non_finite``: the digests, and the first row holding a NaN or an Inf, for any
    row, in any thread's share (1 and 3 threads), at any element; the largest finite value and
    the smallest subnormal are finite."""
    assert keys.native_rows is not None, "setup.py did not build sgl_embeds_protocol._row_digests"
    rng = torch.Generator().manual_seed(1)
    info = torch.finfo(dtype)
    for n, hidden in [(1, 8), (17, 33), (40, 576)]:
        rows = torch.randn(n, hidden, generator=rng).to(dtype)
        rows[0, 0], rows[-1, -1] = info.max, info.smallest_normal / 4
        assert keys.digests_and_first_non_finite(rows) == (keys.row_digests(rows), None)
        for row in sorted({0, n // 2, n - 1}):
            for value in (float("nan"), float("inf"), -float("inf")):
                bad = rows.clone()
                bad[row, (row * 7) % hidden] = value
                bad[n - 1, 0] = value  # a later one too: the first is the one named
                raw, width = keys.raw_bytes(bad), bad.element_size() * hidden
                elem_size, mask = keys._EXPONENT_BITS[dtype]
                for threads in (1, 3):
                    found = keys.native_rows.checked_digests(raw, width, keys.row_blake3_key(dtype), threads, elem_size, mask)
                    assert found == (keys.row_digests(bad), row), (n, hidden, row, value, threads)
                assert keys.digests_and_first_non_finite(bad) == (keys.row_digests(bad), row)


def test_checked_row_digests_are_the_same_without_the_native_pass(monkeypatch):
    rows = torch.randn(9, 16).bfloat16()
    rows[4, 3] = float("nan")
    native = keys.digests_and_first_non_finite(rows)
    monkeypatch.setattr(keys, "native_rows", None)
    assert keys.digests_and_first_non_finite(rows) == native == (keys.row_digests(rows), 4)
