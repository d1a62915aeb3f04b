"""The span store (handles by content key) without a server: LRU within a byte budget, held
spans by content key, and a span that is its whole body held without a copy."""

from __future__ import annotations

import pytest
import torch

from sgl_embeds_protocol import binary_body, keys
from sgl_embeds_srt.handles import SpanStore
from sgl_embeds_protocol.segments import Span


def test_store_evicts_least_recently_used_within_its_budget():
    span_bytes = 64 * 4 + keys.ROW_DIGEST_BYTES  # one row of float32 and its digest
    store = SpanStore(budget=3 * span_bytes)
    a, b, c, d = (torch.full((1, 64), float(i)) for i in range(4))
    ha, hb, hc = (store.put(Span(x)).content_key for x in (a, b, c))
    assert store.put(Span(a.clone())).content_key == ha  # same rows, same handle (content hash); now most recent
    store.put(Span(d))  # evicts b, the least recently used
    assert torch.equal(store.get(ha).rows, a) and torch.equal(store.get(hc).rows, c)
    assert store.get(ha).row_digests == keys.row_digests(a) and store.get(ha).content_key == ha
    with pytest.raises(ValueError, match="unknown span handle"):
        store.get(hb)
    assert store.stats() == {"count": 3, "bytes": 3 * span_bytes, "budget": 3 * span_bytes}
    with pytest.raises(ValueError, match="exceeds the handle store's budget"):
        store.put(Span(torch.zeros(4, 64)))
    assert store.delete(ha) and not store.delete(ha) and store.stats()["count"] == 2


def test_a_span_that_is_its_whole_body_is_held_without_a_copy():
    """The one span of a binary body is a view of the body, which is nearly all rows: kept as
    it is (and weighed as the whole body). Two spans of one body are each kept as a copy, so
    neither holds on to the other's bytes."""
    store = SpanStore(budget=1 << 24)
    big = torch.randn(512, 64)
    one = binary_body.decode_body(binary_body.encode_body({"input_embeds": big})[0])["input_embeds"]
    held = store.put(Span(one)).rows
    assert held.data_ptr() == one.data_ptr() and torch.equal(held, big)
    assert store.stats()["bytes"] == one.untyped_storage().nbytes() + 512 * keys.ROW_DIGEST_BYTES
    a, b = binary_body.decode_body(binary_body.encode_body({"input_embeds": [big[:300], big[300:]]})[0])["input_embeds"]
    for part in (a, b):
        held = store.put(Span(part)).rows
        assert held.data_ptr() != part.data_ptr() and held.untyped_storage().nbytes() == part.nbytes
