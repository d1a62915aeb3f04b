"""Model side of bidirectional blocks: the extend step's mask on the ``torch_native`` backend.

A forward batch carries each request's blocks (``forward_batch_init``); the extend hook attends a
request whose prompt holds a block with ``allowed_keys`` (causal, the sliding window, and every
position of a block seeing the whole block). Both hooks also apply attention logit soft-capping,
which stock ``torch_native`` drops (Gemma 2). docs/engine.md, "Bidirectional blocks".
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

from sgl_embeds_srt.blocks import BLOCKS_ATTR, Block, served_sliding_blocks

logger = logging.getLogger(__name__)


def allowed_keys(prefix: int, n_q: int, blocks: Sequence[Block], window: int | None = None,
                 window_over_blocks: bool = False) -> torch.Tensor:
    """``[n_q, prefix + n_q]``: which keys the queries at positions ``prefix ..`` attend. Causal,
    within the sliding window (``window``: SGLang's, keys at ``q - window`` and after), then each
    block's positions see the whole block (HF Gemma 3's order: the block overlays the window);
    ``window_over_blocks``: the window cuts the blocks too, keys after the query kept (HF Gemma
    4's order on its sliding layers: window AND (causal OR block))."""
    q_pos = torch.arange(prefix, prefix + n_q).unsqueeze(1)
    k_pos = torch.arange(prefix + n_q).unsqueeze(0)
    allowed = k_pos <= q_pos
    windowed = window is not None and window > -1
    if windowed and not window_over_blocks:
        allowed &= k_pos >= q_pos - window
    for start, end in blocks:
        allowed |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if windowed and window_over_blocks:
        allowed &= k_pos >= q_pos - window
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
           scale: float, logit_cap: float) -> torch.Tensor:
    """Attention of ``q`` ``[heads, n_q, d]`` over ``k``, ``v`` ``[kv_heads, n_kv, d]`` where
    ``allowed`` (None: everywhere); scores soft-capped at ``logit_cap`` when it is > 0, as HF's
    eager Gemma 2 does (``cap * tanh(scores / cap)`` before the mask, softmax in float32)."""
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    if logit_cap <= 0:
        return scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                            attn_mask=allowed, scale=scale).squeeze(0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_cap) * logit_cap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def forward_batch_init(original: Callable, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ForwardBatch.init_new``: an extend batch carries its requests' blocks
    (``blocks.BLOCKS_ATTR``, in the batch's order) when one of them has a block."""
    forward_batch = original(cls, batch, *args, **kwargs)
    reqs = getattr(batch, "reqs", None) or ()
    blocks = [getattr(req, BLOCKS_ATTR, ()) for req in reqs]
    if any(blocks) and not batch.forward_mode.is_decode_or_idle():
        setattr(forward_batch, BLOCKS_ATTR, blocks)
    return forward_batch


def load_batch(original: Callable, self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``EagerRunner.load_batch``: the batch it runs (a copy into its static
    buffers, made with ``dataclasses.replace``) keeps the blocks."""
    loaded = original(self, forward_batch, *args, **kwargs)
    blocks = getattr(forward_batch, BLOCKS_ATTR, None)
    if blocks is not None:
        setattr(loaded, BLOCKS_ATTR, blocks)
    return loaded


def _ours(layer: Any, forward_batch: Any) -> bool:
    """A layer this module attends: self-attention of a decoder-only model (an encoder-decoder's
    requests read their keys after the encoder's slots, ``encoder_lens``), equal q/k and v widths,
    and soft-capping (if any) by tanh, the one ``attend`` computes."""
    return forward_batch.encoder_lens is None and not layer.is_cross_attention and layer.attn_type != AttentionType.ENCODER_ONLY \
        and layer.qk_head_dim == layer.v_head_dim \
        and (not layer.logit_cap or getattr(layer, "logit_capping_method", "tanh") == "tanh")


def layer_window(layer: Any) -> int | None:
    """The layer's sliding window (SGLang's size: keys at ``q - size`` and after); None: a full layer."""
    size = layer.sliding_window_size
    return size if size is not None and size > -1 else None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(0, 1)  # [tokens, heads, d] -> [heads, tokens, d]


def _save_kv(backend: Any, layer: Any, forward_batch: Any, k: Any, v: Any, save_kv_cache: bool) -> None:
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)


def _request_kv(backend: Any, layer: Any, forward_batch: Any, i: int, n_kv: int, dtype: torch.dtype):
    slots = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[i], :n_kv]
    k = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots]
    v = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots]
    return _heads_first(k).to(dtype), _heads_first(v).to(dtype)


_cut_logged = False


def forward_extend(original: Callable, self: Any, q: torch.Tensor, k: Any, v: Any, layer: Any,
                   forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
    """AROUND hook of ``TorchNativeAttnBackend.forward_extend``: a batch with a block, or a layer
    with soft-capping, is attended here; any other keeps the stock path (and the CPU plugin's)."""
    blocks = getattr(forward_batch, BLOCKS_ATTR, None)
    cap = layer.logit_cap or 0.0
    if (blocks is None and cap <= 0) or kwargs or not _ours(layer, forward_batch):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    global _cut_logged
    sliding_only, window = served_sliding_blocks(), layer_window(layer)
    _save_kv(self, layer, forward_batch, k, v, save_kv_cache)
    q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    out_ = out.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    start = 0
    for i in range(forward_batch.seq_lens.shape[0]):
        n_q, prefix = int(forward_batch.extend_seq_lens_cpu[i]), int(forward_batch.extend_prefix_lens_cpu[i])
        request_blocks = blocks[i] if blocks is not None else ()
        if sliding_only and window is None:
            request_blocks = ()  # a full layer of such a model attends causally
        if not _cut_logged and any(s < prefix + n_q < e for s, e in request_blocks):
            _cut_logged = True  # a scheduler bug (blocks.py keeps chunks whole): say it once
            logger.error("sgl_embeds: a prefill chunk ends inside a bidirectional block")
        k_i, v_i = _request_kv(self, layer, forward_batch, i, prefix + n_q, q.dtype)
        allowed = allowed_keys(prefix, n_q, request_blocks, window, sliding_only).to(q.device)
        q_i = _heads_first(q_[start : start + n_q])
        out_[start : start + n_q] = attend(q_i, k_i, v_i, allowed, layer.scaling, cap).movedim(1, 0)
        start += n_q
    return out


def forward_decode(original: Callable, self: Any, q: torch.Tensor, k: Any, v: Any, layer: Any,
                   forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
    """AROUND hook of ``TorchNativeAttnBackend.forward_decode``: a layer with soft-capping is
    attended here (a generated token attends causally: no block reaches it)."""
    cap = layer.logit_cap or 0.0
    if cap <= 0 or kwargs or not _ours(layer, forward_batch):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    _save_kv(self, layer, forward_batch, k, v, save_kv_cache)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    out_ = out.view(-1, layer.tp_q_head_num, layer.v_head_dim)
    window = layer_window(layer)
    for i in range(forward_batch.seq_lens.shape[0]):
        n_kv = int(forward_batch.seq_lens_cpu[i])
        k_i, v_i = _request_kv(self, layer, forward_batch, i, n_kv, q.dtype)
        allowed = allowed_keys(n_kv - 1, 1, (), window).to(q.device) if window is not None else None
        out_[i : i + 1] = attend(_heads_first(q_[i : i + 1]), k_i, v_i, allowed, layer.scaling, cap).movedim(1, 0)
    return out
