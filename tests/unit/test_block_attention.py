"""Bidirectional blocks without a server: the extend mask and attention against a dense reference
written out position by position, and where a prefill chunk may end (``blocks.whole_block_end``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sgl_embeds_srt.block_attention import allowed_keys, attend
from sgl_embeds_srt.blocks import BLOCKS_ATTR, span_blocks, whole_block_end
from sgl_embeds_srt.prompt_rows import SpanRows


def _dense_allowed(prefix: int, n_q: int, blocks, window) -> torch.Tensor:
    out = torch.zeros(n_q, prefix + n_q, dtype=torch.bool)
    for i in range(n_q):
        q = prefix + i
        for k in range(prefix + n_q):
            seen = k <= q and (window is None or k >= q - window)
            out[i, k] = seen or any(s <= q < e and s <= k < e for s, e in blocks)
    return out


@pytest.mark.parametrize("prefix, n_q, blocks, window", [
    (0, 12, [(2, 7)], None),
    (0, 12, [(0, 12)], None),  # a prefix LM's prompt
    (5, 9, [(3, 10)], None),  # a cache hit that ends inside the block (the same block was cached)
    (0, 14, [(1, 4), (6, 13)], 3),  # two blocks over a sliding window: the block overlays it
    (4, 6, [], 2),
])
def test_the_mask_equals_the_rule_written_out(prefix, n_q, blocks, window):
    assert torch.equal(allowed_keys(prefix, n_q, blocks, window), _dense_allowed(prefix, n_q, blocks, window))


@pytest.mark.parametrize("prefix, n_q, blocks, window", [
    (0, 14, [(1, 9)], 3),  # a block longer than the window
    (6, 8, [(2, 12)], 2),  # a cache hit inside the block
    (0, 12, [(1, 4), (6, 11)], 3),  # two blocks, the second longer than the window
])
def test_gemma4s_order_puts_the_window_over_the_blocks(prefix, n_q, blocks, window):
    """HF Gemma 4's sliding layers: window AND (causal OR block), the window one-sided (``kv >
    q - W``, SGLang's ``window`` = W - 1): a block's later rows stay visible to its earlier ones,
    its rows older than the window do not; unlike Gemma 3's order once a block outgrows the
    window."""
    expected = torch.zeros(n_q, prefix + n_q, dtype=torch.bool)
    for i in range(n_q):
        q = prefix + i
        for k in range(prefix + n_q):
            in_block = any(s <= q < e and s <= k < e for s, e in blocks)
            expected[i, k] = (k <= q or in_block) and k >= q - window
    ours = allowed_keys(prefix, n_q, blocks, window, window_over_blocks=True)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, allowed_keys(prefix, n_q, blocks, window))


def _reference(q, k, v, allowed, scale, cap):
    """Attention of one query head at a time, in float64, from the formulas."""
    heads, kv_heads = q.shape[0], k.shape[0]
    out = torch.zeros_like(q, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[h * kv_heads // heads].double(), v[h * kv_heads // heads].double()
        for i in range(q.shape[1]):
            scores = [float(q[h, i].double() @ kh[j]) * scale for j in range(k.shape[1])]
            if cap > 0:
                scores = [cap * math.tanh(s / cap) for s in scores]
            weights = torch.tensor([s if allowed[i, j] else -math.inf for j, s in enumerate(scores)],
                                   dtype=torch.float64).softmax(0)
            out[h, i] = weights @ vh
    return out


@pytest.mark.parametrize("cap", [0.0, 2.5])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_equals_the_dense_reference(cap, kv_heads):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, n, 8, generator=g) for h, n in ((4, 6), (kv_heads, 10), (kv_heads, 10)))
    allowed = allowed_keys(4, 6, [(2, 8)], None)
    ours = attend(q, k, v, allowed, 0.7, cap)
    torch.testing.assert_close(ours.double(), _reference(q, k, v, allowed, 0.7, cap), atol=1e-5, rtol=1e-5)
    causal = attend(q, k, v, allowed_keys(4, 6, [], None), 0.7, cap)
    assert (ours - causal).abs().max() > 1e-2, "the block must change the queries inside it"


def test_soft_capping_changes_the_scores():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, 8, generator=g) * 4, torch.randn(2, 5, 8, generator=g) * 4, torch.randn(2, 5, 8, generator=g)
    assert (attend(q, k, v, None, 1.0, 0.0) - attend(q, k, v, None, 1.0, 5.0)).abs().max() > 1e-2


def _req(blocks, prefix_len=0):
    return SimpleNamespace(prefix_len=prefix_len, **{BLOCKS_ATTR: tuple(blocks)})


@pytest.mark.parametrize("blocks, prefix, end, page, expected", [
    ([(4, 24)], 0, 16, 1, 4),  # the chunk ends before the block
    ([(4, 24)], 4, 20, 1, 24),  # the chunk starts at the block: it takes the block whole
    ([(4, 24)], 10, 20, 1, 24),  # a cache hit ended inside it: the rest of it, whole
    ([(9, 21)], 0, 16, 8, 8),  # page-aligned: back to the page the block starts in
    ([(3, 21)], 0, 16, 8, 21),  # ... unless that page is the chunk's first: whole
    ([(4, 10)], 0, 16, 1, 16),  # no block cut
    ([(4, 10), (12, 30)], 0, 16, 1, 12),
    ([], 0, 16, 1, 16),
])
def test_a_chunk_end_never_cuts_a_block(blocks, prefix, end, page, expected):
    assert whole_block_end(_req(blocks, prefix), end, page) == expected


def test_span_blocks_are_the_positions_of_bidirectional_spans():
    overrides = SimpleNamespace(positions=[2, 3, 4, 8, 9, 12, 13, 14],
                                spans=[SpanRows("a", 3, bidirectional=True), SpanRows("b", 2),
                                       SpanRows("c", 3, bidirectional=True)])
    assert span_blocks(overrides) == [(2, 5), (12, 15)]
    assert span_blocks(None) == [] and span_blocks(SimpleNamespace(positions=[1], spans=[])) == []
