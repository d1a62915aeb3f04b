"""Server side of a span prompt: wire fields -> token ids with placeholders + positional embeds.

Shared by the HTTP middleware and the ``Engine`` hooks; runs in the process that holds the
tokenizer manager. Every error is a ``ValueError`` (HTTP 400) that names the problem.

Tokenization rule: a text segment at the very start of a prompt is tokenized like a plain text
prompt (with the tokenizer's special tokens, e.g. BOS); every later text segment without them,
so ``[text A, span, text B]`` is exactly ``tok(A) + span + tok(B, no specials)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from sgl_embeds import segments as seg
from sgl_embeds import wire

SPAN_FIELDS = ("input_segments", "input_embeds")


def max_request_bytes() -> int:
    """Decoded float32 bytes allowed in one request's spans (``SGL_EMBEDS_MAX_BYTES``)."""
    return int(os.environ.get("SGL_EMBEDS_MAX_BYTES", wire.DEFAULT_MAX_BYTES))


@dataclass(frozen=True)
class ModelSpec:
    """What the server knows of the model that a span prompt must agree with."""

    hidden_size: int
    dtype: torch.dtype
    vocab_size: int
    context_len: int
    tokenizer: Any

    @classmethod
    def from_tokenizer_manager(cls, tm: Any) -> "ModelSpec":
        mc = tm.model_config
        return cls(mc.hidden_size, mc.dtype, mc.vocab_size, tm.context_len, tm.tokenizer)


def has_span_fields(body: dict) -> bool:
    return body.get("input_segments") is not None or body.get("input_embeds") is not None


def parse_prompts(body: dict, max_bytes: int, resolve: seg.Resolver | None = None) -> tuple[list[list[seg.Segment]], bool]:
    """The span prompts of a request body: (one segment list per prompt, is_batch).
    ``resolve`` looks up span handles (HTTP only)."""
    if body.get("input_segments") is not None and body.get("input_embeds") is not None:
        raise ValueError("give either input_segments or input_embeds, not both")
    for other in ("text", "input_ids"):
        if body.get(other) is not None:
            raise ValueError(f"{other} cannot be combined with input_segments/input_embeds: "
                             "put the text or ids in input_segments instead")
    if body.get("input_segments") is not None:
        items = body["input_segments"]
        if isinstance(items, list) and items and isinstance(items[0], list):
            return [seg.segments_from_wire(p, max_bytes, resolve) for p in items], True
        return [seg.segments_from_wire(items, max_bytes, resolve)], False
    embeds = body["input_embeds"]
    if _is_batch_of_tensors(embeds):
        return [[seg.Embeds(seg.decode_span(e, max_bytes, resolve))] for e in embeds], True
    return [[seg.Embeds(seg.decode_span(embeds, max_bytes, resolve))]], False


def _is_batch_of_tensors(x: Any) -> bool:
    """A list of tensors: of dicts (binary objects, handles), of 2-D tensors (in-process), or three
    levels of nested lists."""
    if not isinstance(x, list) or not x:
        return False
    first = x[0]
    if isinstance(first, torch.Tensor):
        return first.dim() >= 2
    return isinstance(first, dict) or (isinstance(first, list) and bool(first) and isinstance(first[0], list))


def build_ids(segments: list[seg.Segment], spec: ModelSpec, specials_first: bool = True) -> tuple[list[int], Any]:
    """Token ids (placeholders at span rows) and the ``PositionalEmbeds`` of the span rows.

    ``specials_first=False`` for prompts that carry their own special tokens (rendered chats)."""
    from sglang.srt.managers.embed_types import PositionalEmbeds

    ids: list[int] = []
    rows: list[torch.Tensor] = []
    positions: list[int] = []
    for i, s in enumerate(segments):
        if isinstance(s, seg.Text):
            if spec.tokenizer is None:
                raise ValueError("this server runs without a tokenizer: send input_ids segments")
            ids.extend(spec.tokenizer.encode(s.text, add_special_tokens=(i == 0 and specials_first)))
        elif isinstance(s, seg.Ids):
            bad = [t for t in s.ids if t >= spec.vocab_size]
            if bad:
                raise ValueError(f"segment {i}: token id {bad[0]} is outside the vocabulary [0, {spec.vocab_size})")
            ids.extend(s.ids)
        else:
            # Values were checked when the span was decoded (or uploaded); here only the width,
            # and finiteness again only if the cast to the model's dtype can overflow.
            try:
                wire.check_shape(s.tensor, spec.hidden_size)
            except wire.WireError as e:
                raise wire.WireError(f"segment {i}: {e}") from None
            t = s.tensor.to(spec.dtype)
            if t.dtype != s.tensor.dtype and wire.first_non_finite_row(t) is not None:
                raise ValueError(f"segment {i}: embeddings overflow the model's dtype {spec.dtype}")
            positions.extend(range(len(ids), len(ids) + t.shape[0]))
            ids.extend(seg.placeholder_ids(t))
            rows.append(t)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token or embedding row")
    if len(ids) >= spec.context_len:
        raise ValueError(f"the prompt has {len(ids)} positions (text tokens + span rows), more than "
                         f"the model's context length of {spec.context_len}")
    overrides = PositionalEmbeds(torch.cat(rows), positions) if rows else None
    return ids, overrides


def to_generate_kwargs(body: dict, spec: ModelSpec, resolve: seg.Resolver | None = None) -> dict:
    """Replace the span fields of a ``/generate``-shaped body by ``input_ids`` and
    ``positional_embed_overrides``, ready for ``GenerateReqInput(**kwargs)``."""
    prompts, is_batch = parse_prompts(body, max_request_bytes(), resolve)
    built = [build_ids(p, spec) for p in prompts]
    out = {k: v for k, v in body.items() if k not in SPAN_FIELDS}
    if is_batch:
        out["input_ids"] = [ids for ids, _ in built]
        overrides = [pe for _, pe in built]
        out["positional_embed_overrides"] = overrides * _parallel_samples(body.get("sampling_params"))
    else:
        out["input_ids"], out["positional_embed_overrides"] = built[0]
    return out


def _parallel_samples(sampling_params: Any) -> int:
    """``n`` of a batch request: GenerateReqInput repeats the batch n times for parallel sampling."""
    first = sampling_params[0] if isinstance(sampling_params, list) and sampling_params else sampling_params
    n = first.get("n", 1) if isinstance(first, dict) else 1
    return n if isinstance(n, int) and n > 1 else 1


def make_generate_req(body: dict, spec: ModelSpec, resolve: seg.Resolver | None = None):
    """A ``GenerateReqInput`` for a body with span fields; ``ValueError`` on any bad field."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    kwargs = to_generate_kwargs(body, spec, resolve)
    try:
        return GenerateReqInput(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad request field: {e}") from None
