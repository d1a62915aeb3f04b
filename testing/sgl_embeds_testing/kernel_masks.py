"""Attention kernels given a batch's block mask (``gpu_block_attention.flat_mask``) against the dense
reference (``block_attention.attend`` with ``allowed_keys``): Triton's extend kernel, through our
hook, on any device Triton runs on (its interpreter on the CPU: tests/unit/triton_block_masks.py;
CUDA: gpu/test_block_masks.py), and FlashInfer's paged prefill wrapper (CUDA only)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch

from sgl_embeds_srt import gpu_block_attention as gpu
from sgl_embeds_srt.block_attention import allowed_keys, attend

HEADS, KV_HEADS, DIM = 4, 2, 16

CASES = {
    # a block longer than a query tile (the kernel's tiles are 32 to 128 rows), after a cached prefix,
    # batched with a request without one
    "long_block": dict(seed=1, prefix=[3, 0], extend=[150, 20], blocks=[[(5, 140)], []]),
    # two blocks in one request, soft-capped logits (Gemma 2)
    "two_blocks_capped": dict(seed=2, prefix=[0], extend=[90], blocks=[[(2, 30), (40, 85)]], cap=5.0),
    # a sliding layer whose window starts inside the cached prefix (the kernels read the window's
    # part of the prefix only), a block no longer than the window
    "window": dict(seed=3, prefix=[40, 6], extend=[100, 50], blocks=[[(50, 80)], [(6, 30)]], window=32),
    # a model whose blocks hold on its sliding layers only (Gemma 4 26B / 31B): on a sliding layer,
    # window AND (causal OR block) (blocks no longer than the window, as on any GPU backend, and
    # the window cutting the keys before them); on a full layer, causal
    "sliding_only": dict(seed=4, prefix=[20, 0], extend=[50, 30], blocks=[[(45, 62)], [(3, 20)]], window=16,
                         sliding_only=True),
    "sliding_only_full_layer": dict(seed=5, prefix=[20, 0], extend=[50, 30], blocks=[[(25, 62)], [(3, 28)]],
                                    sliding_only=True),
}


def expected_keys(case: dict, i: int) -> torch.Tensor:
    """Request ``i``'s allowed keys, as HF attends them (``block_attention.allowed_keys``): on a
    model whose blocks hold on its sliding layers only, a full layer is causal and a sliding one
    cuts its blocks by the window."""
    window, sliding_only = case.get("window"), case.get("sliding_only", False)
    blocks = case["blocks"][i] if window is not None or not sliding_only else ()
    return allowed_keys(case["prefix"][i], case["extend"][i], blocks, window, window_over_blocks=sliding_only)


def _batch(case: dict, device: str, dtype: torch.dtype):
    """The case's paged KV (slot 0 unused, as in SGLang), queries, and each request's slots."""
    g = torch.Generator().manual_seed(case["seed"])
    total = sum(p + n for p, n in zip(case["prefix"], case["extend"]))
    k_buf = torch.randn(total + 1, KV_HEADS, DIM, generator=g)
    v_buf = torch.randn(total + 1, KV_HEADS, DIM, generator=g)
    q = torch.randn(sum(case["extend"]), HEADS, DIM, generator=g)
    slots, start = [], 1
    for p, n in zip(case["prefix"], case["extend"]):
        slots.append(torch.arange(start, start + p + n))
        start += p + n
    return k_buf.to(device, dtype), v_buf.to(device, dtype), q.to(device, dtype), slots


def _worst(case: dict, q, k_buf, v_buf, slots, out) -> float:
    """The largest difference of ``out`` from the dense reference, computed in float32 on the CPU."""
    worst, row = 0.0, 0
    q, k_buf, v_buf, out = (t.float().cpu() for t in (q, k_buf, v_buf, out))
    for i, n in enumerate(case["extend"]):
        k_i, v_i = k_buf[slots[i]].movedim(0, 1), v_buf[slots[i]].movedim(0, 1)
        allowed = expected_keys(case, i)
        expected = attend(q[row:row + n].movedim(0, 1), k_i, v_i, allowed, DIM ** -0.5,
                          case.get("cap", 0.0)).movedim(1, 0)
        worst = max(worst, (expected - out[row:row + n]).abs().max().item())
        row += n
    return worst


def triton(case: dict, how: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The case through Triton's extend kernel; ``how``: ``hooked`` (our mask, through our hook,
    called as forward_extend calls it: causal), ``hooked_every_layer`` (the same, the hook not told
    the blocks hold on the sliding layers only), ``stock_flag`` (our mask and the causal flag, no
    hook: stock Gemma 3 on Triton), ``no_mask`` (causal, no mask)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    prefixes, extends, window = case["prefix"], case["extend"], case.get("window")
    k_buf, v_buf, q, slots = _batch(case, device, dtype)
    k_ext, v_ext, kv_idx, kv_ptr, offsets = [], [], [], [0], []
    for p, own in zip(prefixes, slots):
        first = max(p - window, 0) if window is not None else 0  # a sliding layer reads the window
        kv_idx.append(own[first:p])
        kv_ptr.append(kv_ptr[-1] + p - first)
        offsets.append(first)
        k_ext.append(k_buf[own[p:]])
        v_ext.append(v_buf[own[p:]])
    mask, mask_ptr = gpu.flat_mask(prefixes, extends, case["blocks"], device=device)
    qo_ptr = torch.tensor([0, *torch.tensor(extends).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = torch.zeros_like(q)
    int32 = dict(dtype=torch.int32, device=device)
    args = (q, torch.cat(k_ext), torch.cat(v_ext), out, k_buf, v_buf, qo_ptr, torch.tensor(kv_ptr, **int32),
            torch.cat(kv_idx).to(**int32), None if how == "no_mask" else mask, True,
            None if how == "no_mask" else mask_ptr, max(extends), 1.0, 1.0)
    kwargs = dict(sm_scale=DIM ** -0.5, logit_cap=case.get("cap", 0.0),
                  sliding_window_size=window if window is not None else -1,
                  window_kv_offsets=torch.tensor(offsets, **int32) if window is not None else None)
    backend = SimpleNamespace(dllm_attention=None, extend_attention_fwd=extend_attention_fwd,
                              forward_metadata=SimpleNamespace(custom_mask=mask, mask_indptr=mask_ptr))
    setattr(backend.forward_metadata, gpu.MASKED, True)
    if how.startswith("hooked"):
        layer = SimpleNamespace(sliding_window_size=window if window is not None else -1)
        sliding_only = case.get("sliding_only", False) and how == "hooked"
        with mock.patch.object(gpu, "served_sliding_blocks", lambda: sliding_only):
            gpu.triton_extend_kernel(TritonAttnBackend._forward_extend_kernel, backend, layer, *args, **kwargs)
    else:
        extend_attention_fwd(*args, **kwargs)
    return _worst(case, q, k_buf, v_buf, slots, out)


def flashinfer(case: dict, dtype: torch.dtype = torch.float16) -> float:
    """The case through FlashInfer's paged prefill wrapper (page size 1), planned with the mask
    ``flashinfer_plan`` gives it: over the keys the wrapper reads (a sliding one: the window)."""
    import flashinfer

    prefixes, extends, window = case["prefix"], case["extend"], case.get("window")
    k_buf, v_buf, q, slots = _batch(case, "cuda", dtype)
    starts = [max(p - window, 0) if window is not None else 0 for p in prefixes]
    read = [own[s:] for own, s in zip(slots, starts)]
    kv_ptr = torch.tensor([0, *torch.tensor([len(r) for r in read]).cumsum(0).tolist()], dtype=torch.int32)
    qo_ptr = torch.tensor([0, *torch.tensor(extends).cumsum(0).tolist()], dtype=torch.int32)
    mask, _ = gpu.flat_mask(prefixes, extends, case["blocks"], starts, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "NHD")
    wrapper.plan(qo_ptr.cuda(), kv_ptr.cuda(), torch.cat(read).to(torch.int32).cuda(),
                 torch.ones(len(read), dtype=torch.int32, device="cuda"), HEADS, KV_HEADS, DIM, 1,
                 custom_mask=mask, window_left=window if window is not None else -1,
                 logits_soft_cap=case.get("cap", 0.0), sm_scale=DIM ** -0.5, q_data_type=dtype)
    out = wrapper.run(q, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
    return _worst(case, q, k_buf, v_buf, slots, out)
