"""Scheduler side of bidirectional blocks: which positions of a request attend both ways, a cache
key that names a prefix LM's whole prompt, and prefill chunks that never cut a block.

A block is ``[start, end)`` of a request's positions (a bidirectional span's rows; a prefix LM's
whole prompt), set on the ``Req`` once (``set_blocks``, from ``scheduler.req_init``). A cache hit
may end inside a block only when the cached rows came from the same whole block: a span's first
placeholder id names the span (``placeholders.bidirectional_ids``), a prefix LM's prompt is in its
cache key. docs/engine.md, "Bidirectional blocks".
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from blake3 import blake3

from sgl_embeds_protocol.family import split_family, split_sliding_blocks
from sgl_embeds_srt.encoder_prompts import encoder_item

Block = tuple[int, int]
BLOCKS_ATTR = "sgl_embeds_blocks"  # on a Req: its blocks; on a ForwardBatch: each request's


def span_blocks(overrides: Any) -> list[Block]:
    """The blocks of a request's bidirectional spans (``prompt_rows.SpanRows.bidirectional``):
    each span's rows stand at consecutive positions."""
    blocks, offset = [], 0
    for span in getattr(overrides, "spans", None) or ():
        if span.bidirectional:
            blocks.append((overrides.positions[offset], overrides.positions[offset + span.n_rows - 1] + 1))
        offset += span.n_rows
    return blocks


def served_prefix_lm() -> bool:
    """Whether this scheduler serves a prefix LM's LLM (``family.Family.prefix_lm``); False in a
    process without server arguments (a ``Req`` built outside a scheduler)."""
    from sglang.srt.runtime_context import get_server_args  # SGLang not ready at plugin load

    try:
        model_path = get_server_args().model_path
    except ValueError:  # "Global server args is not set yet!"
        return False
    family = split_family(model_path)
    return family is not None and family.prefix_lm


def served_sliding_blocks() -> bool:
    """Whether this process serves a split LLM whose blocks hold on its sliding layers only
    (``family.split_sliding_blocks``: Gemma 4 26B / 31B); False without server arguments."""
    from sglang.srt.runtime_context import get_server_args  # SGLang not ready at plugin load

    try:
        model_path = get_server_args().model_path
    except ValueError:  # "Global server args is not set yet!"
        return False
    return split_sliding_blocks(model_path)


def set_blocks(req: Any) -> None:
    """Give ``req`` its blocks (read by ``block_attention`` and the chunk hooks below); a prefix
    LM's prompt is one block, and its cache key names the whole prompt."""
    blocks = span_blocks(req.positional_embed_overrides)
    if served_prefix_lm() and len(req.origin_input_ids):
        blocks = [(0, len(req.origin_input_ids))]
        ids = np.asarray(req.origin_input_ids, dtype=np.uint64)
        req.extra_key = (req.extra_key or "") + " prompt:" + blake3(ids.tobytes()).hexdigest()[:32]
    setattr(req, BLOCKS_ATTR, tuple(blocks))


def chunk_blocks(req: Any) -> tuple[Block, ...]:
    """What a prefill chunk of ``req`` must not cut: its blocks, and an encoder-decoder's encoder
    region with the decoder's first token (SGLang encodes the region in one step, and a step
    must hold a decoder token to write the encoder's keys and values)."""
    mm_inputs = getattr(req, "multimodal_inputs", None)
    encoder_len = mm_inputs.num_image_tokens if encoder_item(mm_inputs) else None
    encoder = ((0, encoder_len + 1),) if encoder_len else ()
    return getattr(req, BLOCKS_ATTR, ()) + encoder


def whole_block_end(req: Any, end: int, page_size: int = 1) -> int:
    """The end of a prefill chunk of ``req`` from its prefix to ``end`` that cuts no block
    (``chunk_blocks``): the start of a block that ``end`` cuts (page-aligned), or, where the chunk
    starts inside or at that block, the block's end (a block is taken whole, past the chunk size)."""
    for start, block_end in chunk_blocks(req):
        if start < end < block_end:
            aligned = start // page_size * page_size
            return aligned if aligned > req.prefix_len else block_end
    return end


def _keep_whole(adder: Any, req: Any) -> None:
    end = whole_block_end(req, req.extend_end, adder.page_size)
    if end > req.extend_end and adder.rem_chunk_tokens is not None:
        adder.rem_chunk_tokens -= end - req.extend_end  # no other request joins this chunk
    req.extend_end = end


def add_one_req(original: Callable, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``PrefillAdder.add_one_req``: a new request's first chunk cuts no block
    (where taking a block whole ends the prompt, the request is no longer chunked)."""
    result = original(self, req, *args, **kwargs)
    if self.new_chunked_req is req and chunk_blocks(req):
        _keep_whole(self, req)
        if req.extend_end >= len(req.full_untruncated_fill_ids):
            self.new_chunked_req = None
    return result


def add_chunked_req(original: Callable, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``PrefillAdder.add_chunked_req``: a continuing chunk cuts no block either;
    returns the request while it is still chunked, as the original does."""
    result = original(self, req, *args, **kwargs)
    added = bool(self.can_run_list) and self.can_run_list[-1] is req
    if added and chunk_blocks(req):
        _keep_whole(self, req)
        return req if req.extend_end < len(req.full_untruncated_fill_ids) else None
    return result
