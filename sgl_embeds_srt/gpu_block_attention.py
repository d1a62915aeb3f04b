"""Model side of bidirectional blocks on SGLang's GPU backends: Triton and FlashInfer attend a
batch holding a block through a custom mask (``flat_mask``: causal, each block's positions seeing
the whole block), with their own sliding window ANDed onto it; Triton's kernel runs without its
causal flag (and, on a model whose blocks hold on its sliding layers only, a full layer runs
causal without the mask), FlashInfer plans the batch on its paged wrapper alone, and the prefill
CUDA graph does not replay it. Why each: docs/engine.md, "Bidirectional blocks".
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from sgl_embeds_srt.block_attention import allowed_keys, layer_window
from sgl_embeds_srt.blocks import BLOCKS_ATTR, Block, served_sliding_blocks

MASKED = "sgl_embeds_block_mask"  # on a Triton backend's forward metadata: the mask is ours
PLANNING = "sgl_embeds_blocks_to_plan"  # on FlashInfer's prefill planner, while it plans a batch
# the index of the causal flag in the arguments Triton's forward_extend passes its kernel (after
# the layer): q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, causal
TRITON_MASK_ARG, TRITON_CAUSAL_ARG = 9, 10


def flat_mask(prefix_lens: Sequence[int], extend_lens: Sequence[int],
              blocks: Sequence[Sequence[Block]], kv_starts: Sequence[int] | None = None,
              device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's mask as both kernels read it: request by request, its queries (positions
    ``prefix ..``) by its keys from ``kv_starts[i]`` (0: every key) to ``prefix + extend``, row
    major, one bool each; and the offset of each request's first entry (``[batch + 1]`` int32)."""
    parts = []
    for i, (prefix, n_q) in enumerate(zip(prefix_lens, extend_lens)):
        start = kv_starts[i] if kv_starts is not None else 0
        parts.append(allowed_keys(int(prefix), int(n_q), blocks[i])[:, int(start):].reshape(-1))
    sizes = torch.tensor([0] + [p.numel() for p in parts], dtype=torch.int64)
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return mask.to(device), torch.cumsum(sizes, 0).to(torch.int32).to(device)


def _blocks_to_mask(forward_batch: Any) -> list | None:
    """The blocks of a prefill batch (extend or mixed) that holds one; None for any other."""
    blocks = getattr(forward_batch, BLOCKS_ATTR, None)
    mode = forward_batch.forward_mode
    if blocks is None or not mode.is_extend() or mode.is_target_verify() or mode.is_dllm_extend():
        return None
    return blocks


def triton_init_forward_metadata(original: Callable, self: Any, forward_batch: Any,
                                 *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``TritonAttnBackend.init_forward_metadata``: a batch with a block gets its
    mask in the metadata the extend kernel reads."""
    result = original(self, forward_batch, *args, **kwargs)
    blocks = _blocks_to_mask(forward_batch)
    if blocks is not None:
        metadata = self.forward_metadata
        metadata.custom_mask, metadata.mask_indptr = flat_mask(
            forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu, blocks,
            device=self.device)
        setattr(metadata, MASKED, True)
    return result


def triton_extend_kernel(original: Callable, self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``TritonAttnBackend._forward_extend_kernel``: with our mask the kernel runs
    non-causal (the mask is causal where no block is): its causal flag ends each query tile's
    sweep at the tile, which drops the later keys of a block longer than the tile. On a model
    whose blocks hold on its sliding layers only (Gemma 4 26B / 31B), a full layer runs as stock
    runs it, causal and without the mask; a sliding layer keeps the mask, the kernel's window
    ANDed onto it (its non-causal window is two-sided, so a block must fit the window:
    ``prompts.block_limit``; then this is HF Gemma 4's window AND (causal OR block))."""
    metadata = self.forward_metadata
    if getattr(metadata, MASKED, False) and len(args) > TRITON_CAUSAL_ARG \
            and args[TRITON_MASK_ARG] is metadata.custom_mask:
        if served_sliding_blocks() and layer_window(layer) is None:
            args = (*args[:TRITON_MASK_ARG], None, *args[TRITON_MASK_ARG + 1:])
        else:
            args = (*args[:TRITON_CAUSAL_ARG], False, *args[TRITON_CAUSAL_ARG + 1:])
    return original(self, layer, *args, **kwargs)


def flashinfer_init_forward_metadata(original: Callable, self: Any, forward_batch: Any,
                                     *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``FlashInferAttnBackend.init_forward_metadata``: a batch with a block is
    planned on the paged wrapper alone, with its blocks at hand for ``flashinfer_plan``."""
    blocks = _blocks_to_mask(forward_batch)
    if blocks is None:
        return original(self, forward_batch, *args, **kwargs)
    planner, multimodal = self.indices_updater_prefill, self.is_multimodal
    setattr(planner, PLANNING, (forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu, blocks))
    self.is_multimodal = True  # SGLang's switch to the paged wrapper alone (no ragged pass)
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        self.is_multimodal = multimodal
        delattr(planner, PLANNING)


def flashinfer_plan(original: Callable, self: Any, wrapper_ragged: Any, wrapper_paged: Any,
                    req_pool_indices: torch.Tensor, paged_kernel_lens: torch.Tensor,
                    paged_kernel_lens_sum: int, seq_lens: torch.Tensor, prefix_lens: Any,
                    kv_start_idx: Any, kv_indptr: torch.Tensor, qo_indptr: torch.Tensor,
                    use_ragged: bool, spec_info: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``FlashInferIndicesUpdaterPrefill.call_begin_forward``: while a batch with
    a block is planned, each paged wrapper is planned with the mask over the keys it reads
    (a sliding-window wrapper reads from ``kv_start_idx``)."""
    planning = getattr(self, PLANNING, None)
    if planning is not None and spec_info is None and not use_ragged:
        if kwargs.get("cross_attention_custom_mask") is not None:
            raise RuntimeError("sgl_embeds: a FlashInfer plan with a mask of its own holds a block")
        prefix_lens_cpu, extend_lens_cpu, blocks = planning
        starts = kv_start_idx.tolist() if kv_start_idx is not None else None
        kwargs["cross_attention_custom_mask"], _ = flat_mask(
            prefix_lens_cpu, extend_lens_cpu, blocks, starts, device=req_pool_indices.device)
    return original(self, wrapper_ragged, wrapper_paged, req_pool_indices, paged_kernel_lens,
                    paged_kernel_lens_sum, seq_lens, prefix_lens, kv_start_idx, kv_indptr, qo_indptr,
                    use_ragged, spec_info, *args, **kwargs)


def prefill_graph_can_run(original: Callable, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND hook of ``PrefillCudaGraphRunner.can_run_graph``: a batch with a block runs eager."""
    if getattr(forward_batch, BLOCKS_ATTR, None) is not None:
        return False
    return original(self, forward_batch, *args, **kwargs)
