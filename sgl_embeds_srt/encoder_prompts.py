"""Tokenizer side of an encoder-decoder (Florence-2): a built span prompt becomes the encoder's
input, and the request's own ids the decoder's fixed start.

``EncoderDecoder.of`` reads what the served checkpoint says (its architecture, the decoder's start
and forced first tokens, how many positions its encoder has); ``as_encoder_prompt`` turns the ids
and rows ``prompts.build_ids`` made into one multimodal item (``encoder_item``) that
goes to the scheduler in SGLang's own field, the rows after it (``scheduler.handle_generate_request``
moves them in). docs/engine.md, "An encoder-decoder".
"""

from __future__ import annotations

import dataclasses
import functools
from array import array
from typing import Any

import numpy as np
from blake3 import blake3
from sglang.srt.managers.schedule_batch import (
    Modality, MultimodalDataItem, MultimodalInputFormat, MultimodalProcessorOutput,
)

from sgl_embeds_protocol.family import ENCODER_DECODER, FAMILIES
from sgl_embeds_srt.prompt_rows import PromptRows

# the encoder-decoders served, by their records (their model classes: florence2.py)
ENCODER_DECODER_ARCHITECTURES = tuple(family.hf_class for family in FAMILIES if family.served_as == ENCODER_DECODER)
# an encoder prompt's item (model_specific_data): its token ids (placeholders at the span rows)
# and the positions of its rows, in the order of ``item.feature``'s rows
ENCODER_IDS, ROW_POSITIONS = "sgl_embeds_encoder_ids", "sgl_embeds_row_positions"


NO_ENCODER_PROMPT = ("this encoder-decoder (Florence-2) reads an image: send its rows as an embedding span "
                     "in front of the task prompt; a prompt of text alone has no encoder input here")


def encoder_item(mm_inputs: Any) -> Any:
    """The encoder prompt's item of a request's multimodal inputs (None: the request has none)."""
    items = getattr(mm_inputs, "mm_items", None) or ()
    return next((item for item in items if ENCODER_IDS in item.model_specific_data), None)


def served_encoder_decoder(architectures: list[str] | None) -> bool:
    """Whether a checkpoint of ``architectures`` is an encoder-decoder sgl_embeds serves."""
    return any(arch in ENCODER_DECODER_ARCHITECTURES for arch in architectures or ())


@dataclasses.dataclass(frozen=True)
class EncoderDecoder:
    """What a span prompt for the served encoder-decoder must agree with."""

    decoder_prompt: tuple[int, ...]  # the decoder's start token, then its forced first token if any
    encoder_positions: int  # the encoder's learned positions: the longest encoder prompt

    @classmethod
    def of(cls, hf_config: Any, model_path: str | None) -> "EncoderDecoder | None":
        if not served_encoder_decoder(getattr(hf_config, "architectures", None)):
            return None
        text = hf_config.text_config
        generation = _generation_config(model_path)
        start = getattr(generation, "decoder_start_token_id", None)
        start = text.decoder_start_token_id if start is None else start
        forced = getattr(generation, "forced_bos_token_id", None)
        forced = getattr(text, "forced_bos_token_id", None) if forced is None else forced
        return cls((start,) if forced is None else (start, forced), text.max_position_embeddings)


@functools.cache  # read once per served model: the tokenizer side asks on every request
def _generation_config(model_path: str | None) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path) if model_path else None
    except (OSError, ValueError):  # a checkpoint without generation_config.json
        return None


def as_encoder_prompt(ids: list[int], prompt_rows: PromptRows | None,
                      model: EncoderDecoder) -> tuple[list[int], PromptRows]:
    """The decoder prompt, and the rows carrying the encoder prompt's item (``images``). The
    item's identity is a digest of the encoder ids (placeholder ids name the rows) and of the
    spans' tenant-scoped content keys, so its pad sentinels, the radix key of the encoder
    region, are equal only for the same prompt from the same tenant."""
    if prompt_rows is None:
        raise ValueError(NO_ENCODER_PROMPT)
    if len(ids) > model.encoder_positions:
        raise ValueError(f"the encoder prompt has {len(ids)} positions (span rows + text tokens), more "
                         f"than the encoder's {model.encoder_positions}")
    keys = [span.content_key for span in prompt_rows.spans]
    prompt_rows.images = encoder_inputs(ids, keys, model)
    return list(model.decoder_prompt), prompt_rows


def encoder_inputs(ids: list[int], content_keys: list[str | None], model: EncoderDecoder,
                   row_positions: list[int] | None = None) -> MultimodalProcessorOutput:
    """SGLang's multimodal inputs of an encoder prompt: one item of its ids (``row_positions``
    given where the prompt has no rows: the scheduler then gives it none)."""
    digest = blake3(np.asarray(ids, dtype=np.uint64).tobytes())
    digest.update("\0".join(key or "" for key in content_keys).encode())
    data = {ENCODER_IDS: list(ids), **({} if row_positions is None else {ROW_POSITIONS: row_positions})}
    item = MultimodalDataItem(modality=Modality.IMAGE, format=MultimodalInputFormat.PRECOMPUTED_EMBEDDING,
                              offsets=[(0, len(ids) - 1)], model_specific_data=data)
    item.set_identity(digest.digest(32))
    return MultimodalProcessorOutput(mm_items=[item], input_ids=list(model.decoder_prompt))


def without_spans(tm: Any, obj: Any, tokenized: Any) -> None:
    """A tokenized request that carries no encoder prompt, on a served encoder-decoder
    (``image_spans.create_tokenized_object`` asks): refused, unless it is SGLang's own health
    check, whose ``[0]`` becomes a text-only encoder prompt here."""
    if not is_health_check(obj.rid):
        raise ValueError(NO_ENCODER_PROMPT)
    model = EncoderDecoder.of(tm.model_config.hf_config, tm.server_args.model_path)
    tokenized.mm_inputs = encoder_inputs(list(tokenized.input_ids), [], model, row_positions=[])
    tokenized.input_ids = array("q", model.decoder_prompt)


def is_health_check(rid: Any) -> bool:
    """SGLang's own health check (``/health``, ``/health_generate``): one token after ``[0]``."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    return isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX)
