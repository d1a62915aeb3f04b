"""Triton's extend kernel, run in Triton's interpreter on the CPU, over batches holding blocks:
prints, as JSON, the largest difference from the dense reference (``block_attention.attend`` with
``allowed_keys``) for each way of calling it. Run by tests/unit/test_gpu_block_masks.py in a
process of its own: the interpreter must be chosen before Triton is imported."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402

from sgl_embeds_srt import gpu_block_attention as gpu  # noqa: E402
from sgl_embeds_srt.block_attention import allowed_keys, attend  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 16


def run(case: dict, how: str) -> float:
    """One batch through the kernel; ``how``: ``hooked`` (our mask, through our hook, called as
    forward_extend calls it: causal), ``stock_flag`` (our mask and the causal flag, no hook),
    ``no_mask`` (causal, no mask)."""
    g = torch.Generator().manual_seed(case["seed"])
    prefixes, extends, blocks = case["prefix"], case["extend"], case["blocks"]
    window, cap = case.get("window"), case.get("cap", 0.0)
    total = sum(p + n for p, n in zip(prefixes, extends))
    k_buf = torch.randn(total + 1, KV_HEADS, DIM, generator=g)  # slot 0 unused, as in SGLang
    v_buf = torch.randn(total + 1, KV_HEADS, DIM, generator=g)
    q = torch.randn(sum(extends), HEADS, DIM, generator=g)
    slots, k_ext, v_ext, kv_idx, kv_ptr, offsets, start = [], [], [], [], [0], [], 1
    for p, n in zip(prefixes, extends):
        own = torch.arange(start, start + p + n)
        slots.append(own)
        first = max(p - window, 0) if window is not None else 0  # a sliding layer reads the window
        kv_idx.append(own[first:p])
        kv_ptr.append(kv_ptr[-1] + p - first)
        offsets.append(first)
        k_ext.append(k_buf[own[p:]])
        v_ext.append(v_buf[own[p:]])
        start += p + n
    mask, mask_ptr = gpu.flat_mask(prefixes, extends, blocks)
    qo_ptr = torch.tensor([0, *torch.tensor(extends).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.zeros_like(q)
    args = (q, torch.cat(k_ext), torch.cat(v_ext), out, k_buf, v_buf, qo_ptr,
            torch.tensor(kv_ptr, dtype=torch.int32), torch.cat(kv_idx).to(torch.int32),
            None if how == "no_mask" else mask, True, None if how == "no_mask" else mask_ptr,
            max(extends), 1.0, 1.0)
    kwargs = dict(sm_scale=DIM ** -0.5, logit_cap=cap, sliding_window_size=window if window is not None else -1,
                  window_kv_offsets=torch.tensor(offsets, dtype=torch.int32) if window is not None else None)
    backend = SimpleNamespace(dllm_attention=None, extend_attention_fwd=extend_attention_fwd,
                              forward_metadata=SimpleNamespace(custom_mask=mask, mask_indptr=mask_ptr))
    setattr(backend.forward_metadata, gpu.MASKED, True)
    if how == "hooked":
        gpu.triton_extend_kernel(TritonAttnBackend._forward_extend_kernel, backend, None, *args, **kwargs)
    else:
        extend_attention_fwd(*args, **kwargs)
    worst, row = 0.0, 0
    for i, (p, n) in enumerate(zip(prefixes, extends)):
        k_i, v_i = k_buf[slots[i]].movedim(0, 1), v_buf[slots[i]].movedim(0, 1)
        expected = attend(q[row:row + n].movedim(0, 1), k_i, v_i, allowed_keys(p, n, blocks[i], window),
                          DIM ** -0.5, cap).movedim(1, 0)
        worst = max(worst, (expected - out[row:row + n]).abs().max().item())
        row += n
    return worst


CASES = {
    # a block longer than a query tile (the kernel's tiles are 32 to 128 rows), after a cached prefix,
    # batched with a request without one
    "long_block": dict(seed=1, prefix=[3, 0], extend=[150, 20], blocks=[[(5, 140)], []]),
    # two blocks in one request, soft-capped logits (Gemma 2)
    "two_blocks_capped": dict(seed=2, prefix=[0], extend=[90], blocks=[[(2, 30), (40, 85)]], cap=5.0),
    # a sliding layer whose window starts inside the cached prefix (Triton reads the window's
    # part of the prefix only), a block no longer than the window
    "window": dict(seed=3, prefix=[40, 6], extend=[100, 50], blocks=[[(50, 80)], [(6, 30)]], window=32),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: {how: run(CASES[name], how) for how in ("hooked", "stock_flag", "no_mask")}
                      for name in names}))
