"""The extend-attention replacement equals SGLang's stock torch_native computation (no server)."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_embeds_cpu.attention import sdpa_forward_extend

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

STOCK = TorchNativeAttnBackend._run_sdpa_forward_extend
STOCK = getattr(STOCK, "__wrapped__", STOCK)  # the unpatched method if the plugin hooked it


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_stock_for_prefixes_and_batches(gqa, causal):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, pool = 4, 2 if gqa else 4, 8, 200
    k_cache, v_cache = torch.randn(pool, kv_heads, dim, generator=g), torch.randn(pool, kv_heads, dim, generator=g)
    prefixes, extends = [0, 17, 40], [5, 1, 12]
    seq_lens = torch.tensor([p + e for p, e in zip(prefixes, extends)])
    req_to_token = torch.zeros(3, 64, dtype=torch.int64)
    perm = torch.randperm(pool, generator=g)
    offset = 0
    for r, n in enumerate(seq_lens.tolist()):
        req_to_token[r, :n] = perm[offset : offset + n]
        offset += n
    query = torch.randn(sum(extends), heads, dim, generator=g)
    args = (k_cache, v_cache, req_to_token, torch.tensor([0, 1, 2]), seq_lens, torch.tensor(prefixes), torch.tensor(extends))
    kw = dict(scaling=0.3, enable_gqa=gqa, causal=causal)
    want = STOCK(None, query, torch.zeros_like(query), *args, **kw)
    got = sdpa_forward_extend(STOCK, None, query, torch.zeros_like(query), *args, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliding_window_keeps_the_stock_path():
    calls = []

    def fake_original(*args):
        calls.append(args)
        return "stock"

    q = torch.zeros(1, 1, 1)
    assert sdpa_forward_extend(fake_original, None, q, q, q, q, None, None, torch.tensor([1]), torch.tensor([0]),
                               torch.tensor([1]), sliding_window_size=4) == "stock" and calls
