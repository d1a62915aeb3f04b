"""A faster extend (prefill) step for SGLang's ``torch_native`` attention backend (CPU).

Stock ``_run_sdpa_forward_extend`` pads each request's new queries to the whole sequence, cached
prefix included, so on CPU a prefix-cache hit saved little (benchmarks/README.md, "What changed
the CPU numbers"). ``sdpa_forward_extend`` attends only the new queries, query ``i`` seeing keys
``0 .. prefix + i``: the same attention without the padding. Requests with encoder context or a
sliding window keep the stock path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.functional import scaled_dot_product_attention


def sdpa_forward_extend(
    original: Callable, self: Any, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor, extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None, scaling: float | None = None, enable_gqa: bool = False,
    causal: bool = False, is_cross_attn: bool = False, sliding_window_size: int | None = None,
) -> torch.Tensor:
    if encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
        return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                        is_cross_attn, sliding_window_size)
    heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
    start = 0
    for i in range(seq_lens.shape[0]):
        n_q, prefix, n_kv = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
        q = heads_first[:, start : start + n_q, :]
        slots = req_to_token[req_pool_indices[i], :n_kv]
        k = k_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        v = v_cache[slots].movedim(0, query.dim() - 2).to(q.dtype)
        mask, is_causal = None, causal
        if causal and prefix > 0:  # rectangular causal: query i sees keys up to prefix + i
            mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            is_causal = False
        out = scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           enable_gqa=enable_gqa, scale=scaling, is_causal=is_causal)
        output[start : start + n_q] = out.squeeze(0).movedim(query.dim() - 2, 0)
        start += n_q
    return output
