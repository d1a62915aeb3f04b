"""Pure-torch versions of the fused elementwise ops SGLang's ``models/qwen3_5.py`` takes from
``sgl_kernel`` on CPU (``torch.ops.sgl_kernel.<name>_cpu``), and two CPU-only hooks.

Each op keeps its call site's schema and the meaning of SGLang's Triton kernel of the same name
(``srt/models/utils.py``, ``triton_gdn_fused_proj.py``); the norms are Qwen3.5's zero-centred RMS
norms (``_gemma_rmsnorm``). ``rms_norm_gated`` and ``gate_sigmoid_mul`` are the CPU plugin's hooks
(``targets.GATED_RMSNORM_FORWARD``, ``targets.GATE_SIGMOID_MUL``): without AMX SGLang would run a
Triton kernel there.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F


def _gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMS norm, ``x / rms(x) * (1 + w)``, computed in float32 and returned
    in ``x``'s dtype (HF's ``Qwen3_5RMSNorm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def fused_sigmoid_mul_cpu(x: torch.Tensor, gate: torch.Tensor) -> None:
    """``x *= sigmoid(gate)`` in place (``gate`` of ``x``'s size, any view of it)."""
    x.mul_(torch.sigmoid(gate.float()).reshape(x.shape).to(x.dtype))


def fused_qk_gemma_rmsnorm_cpu(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               eps: float, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of ``q`` and ``k`` normalised with its own weight: ``([q_heads, head_dim],
    [k_heads, head_dim])``, one row per token and head."""
    return (_gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
            _gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                                         k_weight: torch.Tensor, eps: float, head_dim: int, num_heads: int):
    """``q_gate`` holds per head the query then its output gate (``[tokens, heads * 2 *
    head_dim]``): the normalised queries, keys and the gate, each ``[rows, head_dim]``."""
    pairs = q_gate.reshape(q_gate.shape[0], num_heads, 2, head_dim)
    q, k_out = fused_qk_gemma_rmsnorm_cpu(pairs[:, :, 0], k, q_weight, k_weight, eps, head_dim)
    return q, k_out, pairs[:, :, 1].reshape(-1, head_dim).contiguous()


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor,
                                                  num_heads_qk: int, num_heads_v: int, head_qk: int,
                                                  head_v: int):
    """Split Qwen3.5's contiguous projections ``[q | k | v | z]`` and ``[b | a]``: ``(qkv
    [tokens, q + k + v], z [tokens, v_heads, head_v], b [tokens, v_heads], a [tokens, v_heads])``."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    tokens = mixed_qkvz.shape[0]
    qkv = mixed_qkvz[:, :qkv_dim].contiguous()
    z = mixed_qkvz[:, qkv_dim:].reshape(tokens, num_heads_v, head_v).contiguous()
    return qkv, z, mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:].contiguous()


def rms_norm_gated(original: Callable, self: Any, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / rms(x) * silu(z)`` (HF's ``Qwen3_5RMSNormGated``, float32 inside) for
    SGLang's ``fla.layernorm_gated.RMSNorm`` on CPU tensors, where SGLang has no kernel of its own
    (its ``sgl_kernel`` one needs AMX); anything else goes to ``original``."""
    from sglang.kernels.ops.attention.fla import layernorm_gated  # SGLang is loaded when this runs

    plain = self.norm_before_gate and self.group_size is None and self.activation in ("swish", "silu")
    if x.device.type != "cpu" or layernorm_gated._use_cpu or not plain:
        return original(self, x, z)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def gate_sigmoid_mul(original: Callable, hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                     shared_output: torch.Tensor, output: torch.Tensor, *, do_add: bool) -> None:
    """The shared expert's gate of Qwen2-MoE and Qwen3.5-MoE, ``output (+)= sigmoid(h . w) *
    shared`` per token (HF's ``sigmoid(shared_expert_gate(h)) * shared_expert(h)``), in float32,
    for CPU tensors; anything else goes to ``original`` (SGLang's Triton launch)."""
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, output, do_add=do_add)
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    result = gate * shared_output.float()
    if do_add:
        result = result + output.float()
    output.copy_(result.to(output.dtype))
