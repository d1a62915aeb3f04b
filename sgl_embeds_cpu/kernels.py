"""Reference implementations of the ``sgl_kernel`` CPU ops that SGLang's CPU path calls.

``finder.py`` loads this module as ``sgl_kernel`` (and ``sgl_kernel.mamba``); the Gated DeltaNet
ops live in ``gdn.py``, the fused elementwise ones in ``fused.py``. ``TORCH_OPS`` registers the
ops SGLang looks up as torch ops at import, with their call sites' schemas. Any other name, and
``fused_input_proj_cpu`` (reached only with AMX), is a stub that raises ``NotImplementedError``
naming the op, never a silent no-op (docs/engine.md, "The CPU kernels: an opt-in plugin").
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np
import torch

from sgl_embeds_cpu import fused, gdn
# sgl_kernel.mamba's names (the finder loads this module under both names)
from sgl_embeds_cpu.gdn import (  # noqa: F401
    causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu,
)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i, write its new KV slots into its row of the token pool:
    ``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[sum_{j<i} len_j : +len_i]``."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For each buffer b (base address ``data_ptrs[b]``, ``strides[b]`` bytes a row), copy the rows
    ``src_loc`` onto the rows ``tgt_loc``; all sources are read before any target is written."""
    if src_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = np.frombuffer(raw, dtype=np.uint8).reshape(rows, stride)
        buf[tgt] = buf[src]  # fancy indexing gathers a copy first: safe in place


def _missing(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by sgl_embeds' CPU fallback "
            "(install the real sgl_kernel build for this op)"
        )

    op.__name__ = name
    return op


# name -> (schema, implementation; None: a stub that raises naming the op)
TORCH_OPS: dict[str, tuple[str, Callable | None]] = {
    "fused_sigmoid_mul_cpu": ("(Tensor(a!) x, Tensor gate) -> ()", fused.fused_sigmoid_mul_cpu),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        fused.fused_qk_gemma_rmsnorm_cpu),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads)"
        " -> (Tensor, Tensor, Tensor)", fused.fused_qk_gemma_rmsnorm_with_gate_cpu),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v)"
        " -> (Tensor, Tensor, Tensor, Tensor)", fused.fused_qkvzba_split_reshape_cat_contiguous_cpu),
    "fused_input_proj_cpu": (
        "(Tensor hidden_states, Tensor qkvz_weight, Tensor ba_weight, bool is_vnni) -> (Tensor, Tensor)", None),
    "fused_gdn_gating_cpu": ("(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
                             gdn.fused_gdn_gating_cpu),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b,"
        " Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor? cu_seqlens=None,"
        " bool use_qk_l2norm_in_kernel=False, float softplus_beta=1.0, float softplus_threshold=20.0,"
        " bool is_kda=False, bool disable_state_update=False, Tensor? intermediate_states_buffer=None,"
        " Tensor? intermediate_state_indices=None, int? cache_steps=None,"
        " Tensor? retrieve_parent_token=None) -> Tensor", gdn.fused_sigmoid_gating_delta_rule_update_cpu),
}
_LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")  # FRAGMENT: others may define ops there too
for _name, (_schema, _impl) in TORCH_OPS.items():
    if not hasattr(torch.ops.sgl_kernel, _name):
        _LIBRARY.define(_name + _schema)
        _LIBRARY.impl(_name, _impl or _missing(_name), "CompositeExplicitAutograd")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
