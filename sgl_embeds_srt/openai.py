"""OpenAI-compatible routes with embeddings: ``/v1/completions`` and ``/v1/chat/completions``.

``completions_body`` / ``chat_body`` turn a body with span fields (``input_embeds``,
``input_segments``, chat parts of type ``input_embeds``: with a grid, an image or a clip; on a
split VLM with an ``ImageText`` (Gemma 3), an image as its processor writes one) into a
stock body of token ids, chats rendered with the tokenizer's template, and its
``prompt_rows.PromptRows``; SGLang's own route serves it, and ``generate_request`` attaches the
rows (docs/openai.md; docs/architecture.md, step 8).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from sgl_embeds_srt import parse, prompts, tenants
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import ImageText
from sgl_embeds_srt.handles import SpanStore
from sgl_embeds_protocol.keys import is_routing_text
from sgl_embeds_srt.prompt_rows import PromptRows
from sgl_embeds_srt.stock_request import being_served

SPAN_PART_TYPE = "input_embeds"


def completions_body(body: dict, spec: prompts.ModelSpec,
                     store: SpanStore | None = None) -> tuple[dict, PromptRows | None]:
    """A stock ``/v1/completions`` body (prompt = ids) and the prompt's rows to attach."""
    if body.get("prompt") not in (None, "", []) and not is_routing_text(body["prompt"]):
        raise ValueError("prompt must be empty (or a gateway routing hint) when input_embeds or "
                         "input_segments is given")
    without_prompt = {k: v for k, v in body.items() if k != "prompt"}
    parsed, is_batch = parse.parse_prompts(without_prompt, spec.max_span_bytes, store)
    if is_batch:
        raise ValueError("/v1/completions takes one span prompt per request; "
                         "use /generate for batches")
    ids, prompt_rows = prompts.build_ids(parsed[0], spec)
    out = {k: v for k, v in body.items() if k not in parse.REQUEST_SPAN_FIELDS}
    out["prompt"] = ids
    return out, prompt_rows


def chat_has_spans(body: dict) -> bool:
    if body.get("input_embeds") is not None:
        return True
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == SPAN_PART_TYPE
                                             for p in content):
            return True
    return False


def chat_body(body: dict, spec: prompts.ModelSpec,
              store: SpanStore | None = None) -> tuple[dict, PromptRows | None]:
    """A stock ``/v1/chat/completions`` body (``input_ids`` set) and the prompt's rows to attach."""
    out = {k: v for k, v in body.items() if k not in parse.REQUEST_SPAN_FIELDS}
    reader = parse.SpanReader(spec.max_span_bytes, store, parse.wants_held(body, store))
    if body.get("input_embeds") is not None:
        span = reader.read(body["input_embeds"])
        ids, prompt_rows = prompts.build_ids([span], spec)
        if not out.get("messages"):  # SGLang validates messages even when input_ids are given
            out["messages"] = [{"role": "user", "content": ""}]
        out["input_ids"] = ids
        return out, prompt_rows
    spans: list[seg.Span] = []
    vision_parts: list[int] = []  # indices into spans of the parts the template renders as media
    messages, flat_messages = [], []
    for i, m in enumerate(body["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            messages.append(m)
            flat_messages.append(m)
            continue
        parts = []  # text parts (a plain span as its marker), image and video parts, for the template
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not is_routing_text(part.get("text")):
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == SPAN_PART_TYPE:
                span = reader.read(part.get(SPAN_PART_TYPE), f"messages[{i}].content[{j}]: ", part)
                if span.grid is not None and spec.vision is not None:
                    vision_parts.append(len(spans))
                    parts.append({"type": "video" if span.grid.video else "image"})
                elif spec.image_text is not None:  # a split VLM's image, as its processor writes one
                    if spec.image_block and part.get(seg.ATTENTION) is None:
                        span = dataclasses.replace(span, bidirectional=True)
                    vision_parts.append(len(spans))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": seg.marker(len(spans))})
                spans.append(span)
            else:
                raise ValueError(f"messages[{i}].content[{j}]: content parts with spans may be "
                                 f"'text' or '{SPAN_PART_TYPE}', got {kind!r}")
        flat = "".join(p.get("text", "") for p in parts)
        has_vision = any(p["type"] != "text" for p in parts)
        messages.append({**m, "content": parts if has_vision else flat})
        flat_messages.append({**m, "content": seg.strip_markers(flat)})
    rendered = chat_text(spec.tokenizer, messages, body)
    if vision_parts and spec.vision is not None:
        rendered = _spans_at_pad_tokens(rendered, vision_parts, spans, spec)
    elif vision_parts:
        rendered = _spans_as_image_text(rendered, vision_parts, spec.image_text)
    segments = _segments_of_chat_text(rendered, spans)
    ids, prompt_rows = prompts.build_ids(segments, spec, specials_first=False)
    out["messages"] = flat_messages
    out["input_ids"] = ids
    return out, prompt_rows


def _spans_at_pad_tokens(rendered: str, vision_parts: list[int], spans: list[seg.Span],
                         spec: prompts.ModelSpec) -> str:
    """The rendered chat with each image or video pad token the template wrote for an image or
    video part replaced, in order, by the marker of that part's span: the template writes what
    surrounds them (``<|vision_start|>``, ``<|vision_end|>``, any label), exactly as for raw
    media."""
    is_clip = {spec.tokenizer.convert_ids_to_tokens(spec.vision.image_token_id): False,
               spec.tokenizer.convert_ids_to_tokens(spec.vision.video_token_id): True}
    pieces = re.split("(" + "|".join(map(re.escape, is_clip)) + ")", rendered)
    written = [is_clip[token] for token in pieces[1::2]]
    wanted = [spans[k].grid.video for k in vision_parts]
    if written != wanted:
        def kinds(flags: list[bool]) -> str:
            return ", ".join("video" if clip else "image" for clip in flags) or "none"

        raise ValueError(f"the chat template wrote the pad tokens of [{kinds(written)}] for the input_embeds "
                         f"parts with a grid [{kinds(wanted)}]: it must render each image and video "
                         "content part once, in order")
    return pieces[0] + "".join(seg.marker(k) + after for k, after in zip(vision_parts, pieces[2::2]))


def _spans_as_image_text(rendered: str, vision_parts: list[int], image_text: ImageText) -> str:
    """The rendered chat with each ``image_text.written`` the template wrote for an image part
    replaced, in order, by that part's span between the processor's ``before`` and ``after``."""
    pieces = rendered.split(image_text.written)
    if len(pieces) - 1 != len(vision_parts):
        raise ValueError(f"the chat template wrote {len(pieces) - 1} {image_text.written!r} for "
                         f"{len(vision_parts)} input_embeds parts: each part is an image here, and the "
                         f"text may not hold {image_text.written!r} itself")
    return pieces[0] + "".join(image_text.before + seg.marker(k) + image_text.after + after
                               for k, after in zip(vision_parts, pieces[1:]))


def chat_text(tokenizer: Any, messages: list, body: dict) -> str:
    """The messages as the tokenizer's chat template renders them (markers where spans stand)."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **kwargs)
    except Exception as e:  # a template error is the request's problem (bad roles, ...)
        raise ValueError(f"the chat template could not render these messages: {e}") from None


def _segments_of_chat_text(text: str, spans: list[seg.Span]) -> list[seg.Segment]:
    prompt = seg.split_at_markers(text, dict(enumerate(spans)))
    if sum(isinstance(s, seg.Span) for s in prompt.segments) != len(spans):
        raise ValueError("the chat template dropped a span: every input_embeds part must be rendered")
    return prompt.segments


def generate_request(original: Callable, self: Any, obj: Any, request: Any = None) -> Any:
    """AROUND hook of ``TokenizerManager.generate_request``: attach the prompt's rows of the
    ``StockRequest`` being served to the ``GenerateReqInput`` SGLang's OpenAI handler built
    (``request``: a Starlette request; None from the ``Engine``, which never serves one)."""
    stock = being_served() if request is not None else None
    if stock is not None and stock.prompt_rows is not None:
        obj.positional_embed_overrides = stock.prompt_rows
    if tenants.current() is not None and hasattr(obj, "extra_key"):  # the tenant's own cache entries
        obj.extra_key = tenants.extra_key(obj.extra_key)
    return original(self, obj, request)
