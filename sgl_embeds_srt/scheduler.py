"""Scheduler-side hooks: span prompts keep the radix cache, placeholder ids never reach the vocab,
and a grid span's rows move into its image item (``handle_generate_request``).

A request is a span prompt only when every override position holds a placeholder id (a content
hash of its row, so the ids alone determine the KV): ``req_init`` checks that once and marks it
(``prompt_rows.SpanPromptRows``); any other overrides keep SGLang's behaviour (no caching).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from sglang.srt.managers.embed_types import PositionalEmbeds
from sglang.srt.managers.io_struct import MMInputsProcessError
from sglang.srt.managers.schedule_batch import FAKE_BOOTSTRAP_HOST, MultimodalProcessorOutput

from sgl_embeds_srt.blocks import set_blocks
from sgl_embeds_srt.encoder_prompts import ROW_POSITIONS, encoder_item
from sgl_embeds_srt.image_spans import is_span_item
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE, is_placeholder
from sgl_embeds_srt.prompt_rows import SpanPromptRows
from sgl_embeds_srt.token_ids import first_bad_position


def is_span_prompt(req: Any) -> bool:
    return isinstance(req.positional_embed_overrides, SpanPromptRows)


def req_init(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
    """After ``Req.__init__``: the request's bidirectional blocks (``blocks.set_blocks``), the
    stock cache opt-out undone for span prompts, and a request holding an id the embedding table
    cannot look up aborted (the last guard, see ``token_ids.py``)."""
    original(self, *args, **kwargs)
    set_blocks(self)
    overrides = self.positional_embed_overrides
    if overrides is not None and overrides.embeds is None:  # rows the scheduler lacks (transport.py)
        self.positional_embed_overrides = None  # so its placeholders abort it below
    elif overrides is not None and overrides.positions and all(
            is_placeholder(self.origin_input_ids[p]) for p in overrides.positions):
        self.positional_embed_overrides = SpanPromptRows.of(overrides)
        # Same rule as stock minus the override clause (fake-bootstrap requests stay uncached).
        self.skip_radix_cache_insert = self.bootstrap_host == FAKE_BOOTSTRAP_HOST
    abort_unlookupable(self)


def abort_unlookupable(req: Any) -> bool:
    """Abort ``req`` (this request only) if an id outside the vocabulary would reach the
    embedding lookup: a bad id, or a placeholder id without its span's rows."""
    if req.vocab_size is None or req.input_embeds is not None:
        return False
    spans = req.positional_embed_overrides.positions if is_span_prompt(req) else ()
    pos = first_bad_position(req.origin_input_ids, req.vocab_size, spans)
    if pos is None:
        return False
    token = int(req.origin_input_ids[pos])
    why = " (a span placeholder id without its rows)" if is_placeholder(token) else ""
    req.positional_embed_overrides = None  # no longer a span prompt either
    req.set_finish_with_abort(f"token id {token} at position {pos} is outside the vocabulary "
                              f"[0, {req.vocab_size}){why}")
    return True


def req_init_next_round_input(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Match span prompts against the radix cache: hide the overrides from the stock opt-out.

    SGLang 0.5.23's ``Req.init_next_round_input`` turns prefix matching off with a bare
    ``if self.positional_embed_overrides is not None`` and has no flag or hook for it; the method
    reads the overrides nowhere else, and the scheduler runs it on one thread. Hiding them for
    this one call is the only way short of copying the method (the guard
    ``targets.REQ_NEXT_ROUND_INPUT`` fails the launch if that code changes)."""
    if not is_span_prompt(self):
        return original(self, *args, **kwargs)
    prompt_rows = self.positional_embed_overrides
    self.positional_embed_overrides = None
    try:
        return original(self, *args, **kwargs)
    finally:
        self.positional_embed_overrides = prompt_rows


def prepare_for_extend(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """After the extend batch is built: placeholder ids become 0 for the embedding lookup.

    The real rows are scattered over those positions (``replace_embeds``) by the model runner;
    this keeps an out-of-vocab id from ever indexing the embedding table.
    """
    result = original(self, *args, **kwargs)
    ids = self.prefill_input_ids_cpu
    if self.replace_positions is not None and ids is not None:
        ids.masked_fill_(ids >= PLACEHOLDER_BASE, 0)
    return result


def handle_generate_request(original: Callable, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``Scheduler.handle_generate_request``: each image item of the request takes
    its rows (restored by now, ``transport.CrossingRows.reconstruct``) out of the rows carrier,
    which keeps only the rows of plain spans (none on these models); an encoder-decoder's encoder
    item takes them all, with their positions (``encoder_prompts.py``). A request whose rows this
    scheduler should hold but does not is aborted alone, by SGLang, as a multimodal input error."""
    images = recv_req.mm_inputs
    encoder = encoder_item(images) if isinstance(images, MultimodalProcessorOutput) else None
    if encoder is None and (not isinstance(images, MultimodalProcessorOutput)
                            or not any(map(is_span_item, images.mm_items))):
        return original(self, recv_req, *args, **kwargs)
    prompt_rows = recv_req.positional_embed_overrides
    recv_req.positional_embed_overrides = None
    if encoder is not None and prompt_rows is None and encoder.model_specific_data.get(ROW_POSITIONS) == []:
        return original(self, recv_req, *args, **kwargs)  # an encoder prompt of text alone (a health check)
    if prompt_rows is None or prompt_rows.embeds is None:
        missing = getattr(prompt_rows, "missing", "")
        recv_req.mm_inputs = MMInputsProcessError(f"the rows of image span {missing} are not held here")
        return original(self, recv_req, *args, **kwargs)
    if encoder is not None:  # an encoder-decoder's prompt: every row is the encoder's
        encoder = copy.copy(encoder)
        encoder.feature = prompt_rows.embeds
        encoder.model_specific_data = {**encoder.model_specific_data, ROW_POSITIONS: list(prompt_rows.positions)}
        recv_req.mm_inputs = copy.copy(images)
        recv_req.mm_inputs.mm_items = [encoder]
        return original(self, recv_req, *args, **kwargs)
    row_of = {pos: i for i, pos in enumerate(prompt_rows.positions)}
    images = copy.copy(images)  # requests of one message may share these objects
    images.mm_items = [copy.copy(item) for item in images.mm_items]
    taken: set[int] = set()
    for item in images.mm_items:
        if is_span_item(item):
            start, end = item.offsets[0]
            first, last = row_of[start], row_of[end]
            item.feature = prompt_rows.embeds[first:last + 1]
            taken.update(range(first, last + 1))
    recv_req.mm_inputs = images
    plain = [i for i in range(len(prompt_rows.positions)) if i not in taken]
    if plain:
        recv_req.positional_embed_overrides = PositionalEmbeds(
            prompt_rows.embeds[plain], [prompt_rows.positions[i] for i in plain])
    return original(self, recv_req, *args, **kwargs)
