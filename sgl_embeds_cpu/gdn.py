"""Pure-torch Gated DeltaNet ops for SGLang's CPU path (Qwen3.5's linear-attention layers).

Each keeps its call site's signature (SGLang's ``layers/attention/linear/``) and the meaning of
SGLang's Triton kernel of the same role; ``kernels.py`` exports them. The invariant: a request's
state lives in one slot of SGLang's pools, read and written in place through ``cache_indices`` (a
negative index is padding: untouched), in SGLang's layouts, not HF's: the SSM pool ``[slots,
v_heads, v_dim, k_dim]``, the conv pool ``[slots, channels, kernel - 1]`` (oldest input first).
Key heads are shared by consecutive value heads; arithmetic runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked (parallel) form of the recurrence
L2NORM_EPS = 1e-6  # q and k are scaled to unit length with this eps (HF's and FLA's)


# -- gates ------------------------------------------------------------------------------------


def gdn_gates(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
              softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """The decay in log space, ``g = -exp(A_log) * softplus(a + dt_bias)``, and the write
    strength ``beta = sigmoid(b)``, both float32 of ``a``'s shape."""
    x = a.float() + dt_bias.float()
    g = -A_log.float().exp() * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, b.float().sigmoid()


def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor):
    """``gdn_gates`` for ``a``, ``b`` of ``[tokens, v_heads]``: ``(g, beta)``, each
    ``[1, tokens, v_heads]`` float32 (the Triton kernel's output shape)."""
    g, beta = gdn_gates(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


# -- the short causal convolution -------------------------------------------------------------


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in (None, False):
        return x
    if activation in ("silu", "swish", True):
        return F.silu(x)
    raise ValueError(f"causal_conv1d: activation {activation!r} is not supported (silu or None)")


def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation,
                         conv_states: torch.Tensor, has_initial_state: torch.Tensor | None,
                         cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens_cpu=None, **_ignored) -> torch.Tensor:
    """Prefill: a depthwise causal convolution over each sequence of ``x`` (``[channels,
    tokens]``, sequences back to back at ``query_start_loc``), ``weight`` ``[channels, kernel]``.
    A sequence with ``has_initial_state`` continues from its slot's conv state, others from zeros;
    each slot then holds the sequence's last ``kernel - 1`` inputs. Returns ``[channels, tokens]``."""
    width = weight.shape[-1]
    w = weight.reshape(weight.shape[0], 1, width).float()
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist()
    resume = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    for i, slot in enumerate(slots[: len(starts) - 1]):
        bos, eos = starts[i], starts[i + 1]
        if eos == bos:
            continue
        seq = x[:, bos:eos].float()
        if slot >= 0 and resume[i]:
            past = conv_states[slot].float()
        else:
            past = seq.new_zeros(seq.shape[0], width - 1)
        full = torch.cat([past, seq], dim=1)
        y = F.conv1d(full.unsqueeze(0), w, None if bias is None else bias.float(), groups=seq.shape[0])
        out[:, bos:eos] = _activate(y[0], activation).to(out.dtype)
        if slot >= 0:
            conv_states[slot] = full[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None, activation, conv_state_indices: torch.Tensor,
                             intermediate_conv_window=None, intermediate_state_indices=None,
                             **_ignored) -> torch.Tensor:
    """Decode: one step (``x`` ``[batch, channels]``) or a few (``[batch, channels, steps]``) of
    the convolution per request, continuing from and updating the conv state of slot
    ``conv_state_indices[i]``. Returns ``x``'s shape."""
    if intermediate_conv_window is not None:
        raise NotImplementedError(
            "sgl_kernel.causal_conv1d_update_cpu: speculative verify (intermediate_conv_window) is "
            "not implemented by sgl_embeds' CPU fallback")
    steps = x.unsqueeze(-1) if x.dim() == 2 else x
    width = weight.shape[-1]
    slots = conv_state_indices[: steps.shape[0]].long()
    live = slots >= 0
    past = torch.zeros(steps.shape[0], steps.shape[1], width - 1)
    past[live] = conv_states[slots[live]].float()
    full = torch.cat([past, steps.float()], dim=-1)  # [batch, channels, width - 1 + steps]
    windows = full.unfold(-1, width, 1)  # [batch, channels, steps, width]
    y = (windows * weight.float().unsqueeze(1)).sum(-1)
    if bias is not None:
        y = y + bias.float().unsqueeze(-1)
    conv_states[slots[live]] = full[live][..., -(width - 1):].to(conv_states.dtype)
    y = _activate(y, activation).to(x.dtype)
    return y.squeeze(-1) if x.dim() == 2 else y


# -- the gated delta rule ---------------------------------------------------------------------


def _normed(q: torch.Tensor, k: torch.Tensor, v_heads: int, l2norm: bool):
    """q, k as float32 ``[tokens, v_heads, k_dim]`` (key heads repeated for their value heads),
    unit length if ``l2norm``, and q scaled by ``k_dim ** -0.5``."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    repeat = v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def delta_rule_chunked(q, k, v, g, beta, state):
    """One sequence, every head at once, a block of ``CHUNK`` tokens at a time. ``q``, ``k``:
    ``[heads, T, k_dim]`` (normalised, q scaled), ``v`` ``[heads, T, v_dim]``, ``g``, ``beta``
    ``[heads, T]``, ``state`` ``[heads, k_dim, v_dim]`` (float32 throughout). Returns the outputs
    ``[heads, T, v_dim]`` and the state after the last token.

    Within a block, with ``G`` the running sum of ``g`` from the block's start and ``S0`` the
    state before it, token t writes ``u_t = beta_t (v_t - exp(G_t) S0^T k_t)
    - sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) u_s`` (a unit lower-triangular system), and
    reads ``o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s``: the per-token
    recurrence ``S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q`` unrolled."""
    heads, length, _ = k.shape
    out = v.new_empty(heads, length, v.shape[-1])
    for start in range(0, length, CHUNK):
        sl = slice(start, min(start + CHUNK, length))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        cum = g[:, sl].cumsum(-1)  # [heads, C]
        n = cum.shape[-1]
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
        system = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        system = system + torch.eye(n)
        rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        reads = (qc @ kc.transpose(-1, -2)) * decay
        out[:, sl] = cum.exp().unsqueeze(-1) * (qc @ state) + reads @ u
        last = cum[:, -1:]
        state = last.exp().unsqueeze(-1) * state + (kc * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ u
    return out, state


def delta_rule_steps(q, k, v, g, beta, state):
    """The same recurrence token by token, for a batch of requests: ``q``, ``k`` ``[batch, T,
    heads, k_dim]``, ``v`` ``[batch, T, heads, v_dim]``, ``g``, ``beta`` ``[batch, T, heads]``,
    ``state`` ``[batch, heads, k_dim, v_dim]``. Returns ``[batch, T, heads, v_dim]`` and the state."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        delta = (v[:, t] - (state * kt.unsqueeze(-1)).sum(-2)) * beta[:, t].unsqueeze(-1)
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outs, dim=1), state


def _load_states(pool: torch.Tensor, slots: torch.Tensor, shape) -> torch.Tensor:
    """float32 ``[n, heads, k_dim, v_dim]`` from the pool's ``[.., heads, v_dim, k_dim]`` rows
    (zeros for padding rows)."""
    states = torch.zeros(slots.shape[0], *shape)
    live = slots >= 0
    states[live] = pool[slots[live]].float().transpose(-1, -2)
    return states


def _store_states(pool: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    live = slots >= 0
    pool[slots[live]] = states[live].transpose(-1, -2).to(pool.dtype)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                               use_qk_l2norm_in_kernel=False, initial_state_indices=None, **_ignored):
    """Prefill: the gated delta rule over each sequence of a packed batch (``q``, ``k`` ``[1,
    tokens, k_heads, k_dim]``, ``v`` ``[1, tokens, v_heads, v_dim]``, ``g``, ``beta`` ``[1, tokens,
    v_heads]``, sequences at ``cu_seqlens``), each from and back into its slot of the pool
    ``initial_state`` (``initial_state_indices``). Returns ``(out [1, tokens, v_heads, v_dim],
    final states [sequences, v_heads, v_dim, k_dim], None)``: no per-chunk states (as the CPU
    kernel of ``sgl_kernel``)."""
    if head_first:
        raise NotImplementedError("sgl_kernel.chunk_gated_delta_rule_cpu: head_first=True is not implemented")
    v_heads, v_dim, k_dim = v.shape[-2], v.shape[-1], q.shape[-1]
    qs, ks = _normed(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v_heads,
                     use_qk_l2norm_in_kernel)
    vs, gs, bs = v.reshape(-1, v_heads, v_dim).float(), g.reshape(-1, v_heads).float(), beta.reshape(-1, v_heads).float()
    if cu_seqlens is None:
        per = q.shape[1]
        starts = list(range(0, qs.shape[0] + 1, per))
    else:
        starts = cu_seqlens.tolist()
    n = len(starts) - 1
    slots = (initial_state_indices if initial_state_indices is not None else torch.arange(n))[:n].long()
    states = _load_states(initial_state, slots, (v_heads, k_dim, v_dim))
    out = torch.zeros(qs.shape[0], v_heads, v_dim)
    for i in range(n):
        sl = slice(starts[i], starts[i + 1])
        if sl.stop == sl.start:
            continue
        o, states[i] = delta_rule_chunked(qs[sl].transpose(0, 1), ks[sl].transpose(0, 1), vs[sl].transpose(0, 1),
                                          gs[sl].T, bs[sl].T, states[i])
        out[sl] = o.transpose(0, 1)
    _store_states(initial_state, slots, states)
    final = states.transpose(-1, -2).to(initial_state.dtype)
    return out.to(q.dtype).reshape(*v.shape[:-2], v_heads, v_dim), final, None


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
    disable_state_update=False, intermediate_states_buffer=None, intermediate_state_indices=None,
    cache_steps=None, retrieve_parent_token=None,
):
    """Decode: the gates (``gdn_gates`` of ``a``, ``b``) and the recurrence, token by token, for
    each request (``q``, ``k`` ``[1, tokens, k_heads, k_dim]``, ``v`` ``[1, tokens, v_heads,
    v_dim]``, requests at ``cu_seqlens``), from and back into slot ``initial_state_indices[i]``.
    Returns ``[1, tokens, v_heads, v_dim]``."""
    if is_kda or intermediate_states_buffer is not None or disable_state_update:
        raise NotImplementedError(
            "sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu: only the plain Gated DeltaNet decode "
            "step is implemented by sgl_embeds' CPU fallback (no KDA, no speculative verify)")
    v_heads, v_dim, k_dim = v.shape[-2], v.shape[-1], q.shape[-1]
    total = v.shape[0] * v.shape[1]
    qs, ks = _normed(q.reshape(total, -1, k_dim), k.reshape(total, -1, k_dim), v_heads, use_qk_l2norm_in_kernel)
    g, beta = gdn_gates(A_log, a.reshape(total, v_heads), b.reshape(total, v_heads), dt_bias,
                        softplus_beta, softplus_threshold)
    vs = v.reshape(total, v_heads, v_dim).float()
    starts = cu_seqlens.tolist() if cu_seqlens is not None else list(range(total + 1))
    n = len(starts) - 1
    slots = initial_state_indices[:n].long()
    states = _load_states(initial_state_source, slots, (v_heads, k_dim, v_dim))
    out = torch.zeros(total, v_heads, v_dim)
    lengths = {starts[i + 1] - starts[i] for i in range(n)}
    if len(lengths) == 1 and starts[0] == 0:  # every request as many tokens: one batched loop
        per = lengths.pop()
        view = lambda x: x[: n * per].reshape(n, per, *x.shape[1:])  # noqa: E731
        o, states = delta_rule_steps(view(qs), view(ks), view(vs), view(g), view(beta), states)
        out[: n * per] = o.reshape(n * per, v_heads, v_dim)
    else:
        for i in range(n):
            sl = slice(starts[i], starts[i + 1])
            o, s = delta_rule_steps(qs[sl][None], ks[sl][None], vs[sl][None], g[sl][None], beta[sl][None],
                                    states[i : i + 1])
            out[sl], states[i] = o[0], s[0]
    _store_states(initial_state_source, slots, states)
    return out.to(q.dtype).reshape(*v.shape)
