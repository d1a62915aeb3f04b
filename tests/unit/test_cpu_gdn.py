"""The CPU fallback's Qwen3.5 ops against transformers' pure-torch references (no server).

Each op runs as SGLang calls it (packed sequences, state in pool slots in SGLang's layout, padding
rows) on random inputs, and is compared with ``transformers.models.qwen3_5``'s torch functions:
prefill in chunks and decode step by step, the state carried from one call to the next.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from sgl_embeds_cpu import fused, gdn

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 12  # k_dim != v_dim: a transposed state fails
TOL = dict(rtol=1e-4, atol=1e-5)


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, K_HEADS, K_DIM, generator=gen)
    k = torch.randn(1, length, K_HEADS, K_DIM, generator=gen)
    v = torch.randn(1, length, V_HEADS, V_DIM, generator=gen)
    a = torch.randn(length, V_HEADS, generator=gen)
    b = torch.randn(length, V_HEADS, generator=gen)
    return q, k, v, a, b


def _params(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V_HEADS, generator=gen), torch.randn(V_HEADS, generator=gen)  # A_log, dt_bias


class _Handed(Exception):
    """Raised where HF's layer hands its gates on, once they are caught."""


class _Fixed(torch.nn.Module):
    """A projection that gives ``value`` whatever its input."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value[None]


def _hf_gates(A_log, dt_bias, a, b):
    """``g`` and ``beta`` as HF's own ``Qwen3_5GatedDeltaNet.forward`` computes them from ``a``
    and ``b``: the layer run with its a / b projections giving them, caught where it passes
    them to its delta rule."""
    config = Qwen3_5TextConfig(hidden_size=8, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
                               linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM)
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    layer.A_log.data, layer.dt_bias.data = A_log.clone(), dt_bias.clone()
    layer.in_proj_a, layer.in_proj_b = _Fixed(a), _Fixed(b)
    caught = {}

    def catch(query, key, value, g, beta, **kwargs):
        caught.update(g=g, beta=beta)
        raise _Handed

    with mock.patch.object(hf, "torch_chunk_gated_delta_rule", catch), pytest.raises(_Handed):
        layer(torch.zeros(1, a.shape[0], config.hidden_size))
    return caught["g"][0], caught["beta"][0]


def _hf_delta_rule(q, k, v, g, beta, state):
    """HF's chunked reference (key heads repeated as HF's layer does); state ``[1, heads, k, v]``."""
    rep = V_HEADS // K_HEADS
    return hf.torch_chunk_gated_delta_rule(
        q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g, beta, chunk_size=16,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def _pool(slots: int, seed: int = 9) -> torch.Tensor:
    """A temporal pool in SGLang's layout, filled with noise (a row we must not touch stays it)."""
    return torch.randn(slots, V_HEADS, V_DIM, K_DIM, generator=torch.Generator().manual_seed(seed))


def _hf_state(pool: torch.Tensor, slot: int) -> torch.Tensor:
    return pool[slot].transpose(-1, -2).unsqueeze(0).clone()


def test_gating_equals_hf():
    A_log, dt_bias = _params()
    _, _, _, a, b = _inputs(7, 0)
    a[0, 0] = 30.0  # past softplus's threshold
    g, beta = gdn.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    want_g, want_beta = _hf_gates(A_log, dt_bias, a, b)
    assert g.shape == (1, 7, V_HEADS) and g.dtype == torch.float32
    torch.testing.assert_close(g[0], want_g, **TOL)
    torch.testing.assert_close(beta[0], want_beta, **TOL)


def test_prefill_in_chunks_then_decode_equals_hf_one_pass():
    """Three requests in one packed prefill (one of them resuming from its slot), then the first
    request prefilled again in two chunks, then decoded token by token: outputs and states equal
    HF's reference run over each whole sequence at once."""
    A_log, dt_bias = _params()
    lengths, slots = [70, 5, 33], [3, 0, 5]  # 70 > HF's chunk and ours is 64: several blocks
    seqs = [_inputs(n, seed) for seed, n in enumerate(lengths)]
    pool = _pool(6)
    untouched = pool[[1, 2, 4]].clone()
    start_states = [_hf_state(pool, s) for s in slots]

    packed = [torch.cat(parts, dim=1 if parts[0].dim() == 4 else 0) for parts in zip(*seqs)]
    q, k, v, a, b = packed
    g, beta = gdn.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, final, h = gdn.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, cu, False, True,
                                                   torch.tensor(slots))
    assert h is None and out.shape == v.shape and final.shape == (3, V_HEADS, V_DIM, K_DIM)
    for i, (sq, sk, sv, sa, sb) in enumerate(seqs):
        hg, hb = _hf_gates(A_log, dt_bias, sa, sb)
        want, want_state = _hf_delta_rule(sq, sk, sv, hg[None], hb[None], start_states[i])
        torch.testing.assert_close(out[:, cu[i] : cu[i + 1]], want, **TOL)
        torch.testing.assert_close(_hf_state(pool, slots[i]), want_state, **TOL)
        torch.testing.assert_close(final[i], pool[slots[i]], **TOL)
    torch.testing.assert_close(pool[[1, 2, 4]], untouched, rtol=0, atol=0)

    # the first request again: 40 + 30 prefill tokens in two calls, then 6 decode steps
    sq, sk, sv, sa, sb = _inputs(76, 0)
    pool[3] = pool[1]
    start = _hf_state(pool, 3)
    outs = []
    for lo, hi in [(0, 40), (40, 70)]:
        g, beta = gdn.fused_gdn_gating_cpu(A_log, sa[lo:hi], sb[lo:hi], dt_bias)
        o, _, _ = gdn.chunk_gated_delta_rule_cpu(sq[:, lo:hi], sk[:, lo:hi], sv[:, lo:hi], g, beta, pool,
                                                 torch.tensor([0, hi - lo]), False, True, torch.tensor([3]))
        outs.append(o)
    for t in range(70, 76):  # decode: a batch of two, the other row padding (slot -1)
        pad = lambda x: torch.cat([x, torch.zeros_like(x)], dim=1 if x.dim() == 4 else 0)  # noqa: E731
        o = gdn.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, pad(sq[:, t : t + 1]), pad(sk[:, t : t + 1]), pad(sv[:, t : t + 1]),
            pad(sa[t : t + 1]), pad(sb[t : t + 1]), pool, torch.tensor([3, -1]), torch.tensor([0, 1, 2]),
            use_qk_l2norm_in_kernel=True)
        outs.append(o[:, :1])
    hg, hb = _hf_gates(A_log, dt_bias, sa, sb)
    want, want_state = _hf_delta_rule(sq, sk, sv, hg[None], hb[None], start)
    torch.testing.assert_close(torch.cat(outs, dim=1), want, **TOL)
    torch.testing.assert_close(_hf_state(pool, 3), want_state, **TOL)


def test_decode_step_equals_hf_recurrent_step():
    """One decode step for a batch of three requests against HF's recurrent reference."""
    A_log, dt_bias = _params()
    q, k, v, a, b = _inputs(3, 4)  # three requests, one token each
    pool = _pool(4)
    slots = [2, 0, 3]
    states = torch.cat([_hf_state(pool, s) for s in slots])
    out = gdn.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool, torch.tensor(slots), torch.arange(4), use_qk_l2norm_in_kernel=True)
    hg, hb = _hf_gates(A_log, dt_bias, a, b)
    rep = V_HEADS // K_HEADS
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        q.repeat_interleave(rep, 2).transpose(0, 1), k.repeat_interleave(rep, 2).transpose(0, 1),
        v.transpose(0, 1), hg[:, None], hb[:, None], initial_state=states, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want.transpose(0, 1), **TOL)
    torch.testing.assert_close(torch.cat([_hf_state(pool, s) for s in slots]), want_state, **TOL)


def test_conv_prefill_in_chunks_then_decode_equals_hf():
    """The short convolution as SGLang runs it (prefill of packed sequences, one resuming from its
    slot; then one-token updates) equals HF's ``causal_conv1d_fn`` over each whole sequence."""
    gen = torch.Generator().manual_seed(1)
    channels, width = 6, 4
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    whole = [torch.randn(channels, n, generator=gen) for n in (9, 2)]  # 2 < width - 1
    conv_states = torch.randn(4, channels, width - 1, generator=gen)
    # request 0: 5 tokens, then 3 more resuming (chunked prefill), then 1 decode step
    # request 1: 2 tokens in the first call, then 1 decode step
    out0 = gdn.causal_conv1d_fn_cpu(torch.cat([whole[0][:, :5], whole[1]], 1), weight, bias, "silu", conv_states,
                                    torch.tensor([False, False]), torch.tensor([1, 3]), torch.tensor([0, 5, 7]))
    out1 = gdn.causal_conv1d_fn_cpu(whole[0][:, 5:8], weight, bias, "silu", conv_states, torch.tensor([True]),
                                    torch.tensor([1]), torch.tensor([0, 3]))
    step = torch.stack([whole[0][:, 8], whole[1][:, 1]])
    out2 = gdn.causal_conv1d_update_cpu(step, conv_states, weight, bias, "silu", torch.tensor([1, 3]))
    ours = [torch.cat([out0[:, :5], out1, out2[0, :, None]], 1), torch.cat([out0[:, 5:7], out2[1, :, None]], 1)]
    whole[1] = torch.cat([whole[1], whole[1][:, 1:]], 1)  # its decode step fed its second token again
    for mine, x in zip(ours, whole):
        want = hf.causal_conv1d_fn(x[None], weight, bias, activation="silu")[0]
        torch.testing.assert_close(mine, want, **TOL)
    torch.testing.assert_close(conv_states[1], whole[0][:, -(width - 1):], rtol=0, atol=0)


def test_conv_update_equals_hf_update():
    gen = torch.Generator().manual_seed(2)
    channels, width = 5, 4
    weight = torch.randn(channels, width, generator=gen)
    ours = torch.randn(3, channels, width - 1, generator=gen)
    theirs = ours[[2, 0]].clone()
    x = torch.randn(2, channels, generator=gen)
    out = gdn.causal_conv1d_update_cpu(x, ours, weight, None, "silu", torch.tensor([2, 0, -1]))
    want = hf.causal_conv1d_update(x[..., None], theirs, weight, None, activation="silu")[..., 0]
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(ours[[2, 0]], theirs, rtol=0, atol=0)


def test_fused_norms_equal_hf_rmsnorm_and_gate_split():
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 4, 2, 8
    q_norm, k_norm = hf.Qwen3_5RMSNorm(dim), hf.Qwen3_5RMSNorm(dim)
    with torch.no_grad():
        q_norm.weight.normal_(generator=gen)
        k_norm.weight.normal_(generator=gen)
    q_gate = torch.randn(tokens, heads * 2 * dim, generator=gen)
    k = torch.randn(tokens, kv_heads * dim, generator=gen)
    # HF's Qwen3_5Attention: per head, the query then its gate
    hf_q, hf_gate = torch.chunk(q_gate.view(tokens, heads, 2 * dim), 2, dim=-1)
    q, k_out, gate = fused.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_norm.weight, k_norm.weight, 1e-6, dim, heads)
    torch.testing.assert_close(q.view(tokens, heads, dim), q_norm(hf_q), **TOL)
    torch.testing.assert_close(k_out.view(tokens, kv_heads, dim), k_norm(k.view(tokens, kv_heads, dim)), **TOL)
    torch.testing.assert_close(gate.view(tokens, heads, dim), hf_gate, rtol=0, atol=0)
    q2, k2 = fused.fused_qk_gemma_rmsnorm_cpu(hf_q.reshape(tokens, -1), k, q_norm.weight, k_norm.weight, 1e-6, dim)
    torch.testing.assert_close(q2, q, rtol=0, atol=0)
    torch.testing.assert_close(k2, k_out, rtol=0, atol=0)
    x = torch.randn(tokens, heads * dim, generator=gen)
    want = x * torch.sigmoid(hf_gate.reshape(tokens, -1))
    fused.fused_sigmoid_mul_cpu(x, hf_gate)  # a strided 3-D view, as SGLang passes it
    torch.testing.assert_close(x, want, **TOL)


def test_qkvzba_split_gives_hf_layers_projections():
    """SGLang packs a checkpoint's ``in_proj_qkv`` / ``in_proj_z`` and ``in_proj_b`` /
    ``in_proj_a`` into one projection each, in the order of its own ``packed_modules_mapping``;
    our split of the packed outputs gives what HF's ``Qwen3_5GatedDeltaNet`` projects with each."""
    from sglang.srt.models.qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
                               linear_key_head_dim=K_DIM, linear_value_head_dim=V_DIM)
    layer = hf.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(6))
    packing = Qwen3_5ForCausalLM.packed_modules_mapping
    with torch.no_grad():
        qkvz, ba = (x @ torch.cat([getattr(layer, name).weight for name in packing[packed]]).T
                    for packed in ("in_proj_qkvz", "in_proj_ba"))
        qkv, z, b, a = fused.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, K_HEADS, V_HEADS, K_DIM, V_DIM)
        torch.testing.assert_close(qkv, layer.in_proj_qkv(x), **TOL)
        torch.testing.assert_close(z, layer.in_proj_z(x).reshape(5, V_HEADS, V_DIM), **TOL)
        torch.testing.assert_close(b, layer.in_proj_b(x), **TOL)
        torch.testing.assert_close(a, layer.in_proj_a(x), **TOL)


def test_gated_rmsnorm_hook_equals_hf_norm():
    from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm

    gen = torch.Generator().manual_seed(4)
    ours, theirs = RMSNorm(12, eps=1e-6), hf.Qwen3_5RMSNormGated(12, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(generator=gen)
        theirs.weight.copy_(ours.weight)
    x, z = torch.randn(7, 12, generator=gen), torch.randn(7, 12, generator=gen)
    stock = lambda *args: pytest.fail("the CPU path must not reach SGLang's Triton kernel")  # noqa: E731
    torch.testing.assert_close(fused.rms_norm_gated(stock, ours, x, z), theirs(x, z), **TOL)


@pytest.mark.parametrize("do_add", [False, True])
def test_shared_expert_gate_hook_equals_hf_gate(do_add):
    """Qwen3.5-MoE's shared expert: ``sigmoid(shared_expert_gate(h)) * shared_expert(h)``, added
    to the routed experts' output (HF's ``Qwen3_5MoeSparseMoeBlock``)."""
    gen = torch.Generator().manual_seed(5)
    h, shared, routed = (torch.randn(6, 10, generator=gen) for _ in range(3))
    gate = torch.nn.Linear(10, 1, bias=False)
    with torch.no_grad():
        gate.weight.normal_(generator=gen)
    output = routed.clone()
    stock = lambda *args, **kwargs: pytest.fail("the CPU path must not reach SGLang's Triton kernel")  # noqa: E731
    fused.gate_sigmoid_mul(stock, h, gate.weight.detach().squeeze(0), shared, output, do_add=do_add)
    hf_shared = torch.sigmoid(gate(h)) * shared
    torch.testing.assert_close(output, hf_shared + routed if do_add else hf_shared, **TOL)
