"""Server side of a span prompt: segments -> token ids with placeholders + positional embeds.

``make_generate_req`` is the whole path of a ``/generate``-shaped body, shared by the middleware,
the OpenAI routes and the ``Engine``: ``parse.py``, ``build_ids`` (the tokenization rule of
docs/concepts.md, "Segments"), then SGLang's ``GenerateReqInput``. It runs where the tokenizer
manager lives; every error is a ``ValueError`` (HTTP 400) naming the problem.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.family import ImageText, split_family, split_image_text, split_sliding_blocks
from sgl_embeds_srt.encoder_prompts import EncoderDecoder, as_encoder_prompt
from sgl_embeds_srt.handles import SpanStore
from sgl_embeds_srt.image_spans import GridSpan, VisionSpec, check_grid_span, check_vision_ids, image_inputs, place
from sgl_embeds_protocol.keys import keyed
from sgl_embeds_srt.parse import REQUEST_SPAN_FIELDS, max_span_bytes, parse_prompts
from sgl_embeds_srt.placeholders import bidirectional_ids, placeholder_ids
from sgl_embeds_protocol.segments import Span, Ids, Segment, Text
from sgl_embeds_srt.token_ids import check_ids
from sgl_embeds_srt.prompt_rows import PromptRows
from sgl_embeds_srt import tenants


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the server knows of the model that a span prompt must agree with."""

    hidden_size: int
    dtype: torch.dtype
    vocab_size: int
    context_len: int
    tokenizer: Any
    vision: VisionSpec | None = None  # an M-RoPE VLM served natively: spans are images
    model_path: str | None = None  # as the server was launched with it
    prefix_lm: bool = False  # every prompt is one bidirectional block (family.Family.prefix_lm)
    blocks_refused: str | None = None  # why this server cannot attend a block both ways
    max_block: "BlockLimit | None" = None  # the most positions one block may hold, and why
    # a split family's image as its processor writes it: the chat route renders span parts so
    image_text: ImageText | None = None
    # each image one bidirectional block (family.Family.image_block, or the split LLM's family
    # file where its checkpoint decides: family.split_sliding_blocks)
    image_block: bool = False
    # the rows of the largest image the served VLM's processor makes (0: not said, or no VLM)
    largest_image_rows: int = 0
    # an encoder-decoder (Florence-2): the prompt is the encoder's input (encoder_prompts.py)
    encoder_decoder: EncoderDecoder | None = None
    model_type: str | None = None  # the checkpoint's (HF's model_type)

    @classmethod
    def from_tokenizer_manager(cls, tm: Any) -> "ModelSpec":
        mc, args = tm.model_config, tm.server_args
        vision = VisionSpec.of(mc.hf_config)
        family = split_family(args.model_path)
        return cls(mc.hidden_size, mc.dtype, mc.vocab_size, tm.context_len, tm.tokenizer, vision,
                   args.model_path, prefix_lm=family is not None and family.prefix_lm,
                   blocks_refused=blocks_refused(args, mc, vision), max_block=block_limit(args, mc),
                   image_text=split_image_text(args.model_path),
                   image_block=(family is not None and family.image_block)
                   or split_sliding_blocks(args.model_path),
                   largest_image_rows=vision.largest_image_rows(getattr(tm, "processor", None)) if vision else 0,
                   encoder_decoder=EncoderDecoder.of(mc.hf_config, args.model_path),
                   model_type=getattr(mc.hf_config, "model_type", None))

    @property
    def span_width(self) -> int:
        """The width of a span's rows: the hidden size, with a Qwen3-VL's deepstack rows after it."""
        return self.hidden_size if self.vision is None else self.vision.span_width(self.hidden_size)

    @property
    def max_span_bytes(self) -> int:
        """The budget of one request's spans (``parse.max_span_bytes``), sized to hold at least
        one of the largest images the processor makes, at the span width, as float32."""
        return max_span_bytes(self.largest_image_rows * self.span_width * 4)

    def check_width(self, rows: Any, where: str = "") -> None:
        """A span's shape against the model (``wire.WireError`` naming the width it wants)."""
        try:
            wire.check_shape(rows, self.span_width)
        except wire.WireError as e:
            if self.vision is None or rows.dim() != 2:
                raise wire.WireError(f"{where}{e}") from None
            raise wire.WireError(f"{where}{self.vision.width_error(rows.shape[1], self.hidden_size)}") from None


def build_ids(segments: list[Segment], spec: ModelSpec,
              specials_first: bool = True) -> tuple[list[int], PromptRows | None]:
    """Token ids (placeholders at span rows) and the span rows at their positions
    (``prompt_rows.PromptRows``; None without spans). On an M-RoPE VLM every span is an image or
    a clip (``image_spans.py``): its pad token at its rows, and its items in ``PromptRows.images``.

    ``specials_first=False`` for prompts that carry their own special tokens (rendered chats)."""
    ids: list[int] = []
    rows_per_span: list[torch.Tensor] = []
    content_keys: list[str] = []  # of the spans' rows as sent (transport.py)
    positions: list[int] = []
    images: list[GridSpan] = []
    bidirectional: list[bool] = []
    for i, s in enumerate(segments):
        if isinstance(s, Text):
            if spec.tokenizer is None:
                raise ValueError("this server runs without a tokenizer: send input_ids segments")
            ids.extend(spec.tokenizer.encode(s.text, add_special_tokens=(i == 0 and specials_first)))
        elif isinstance(s, Ids):
            check_ids(s.ids, spec.vocab_size, f"segment {i}: input_ids")
            ids.extend(s.ids)
        else:
            # Values were checked when the span was decoded (or uploaded); here only the width,
            # and finiteness again only if the cast to the model's dtype can overflow.
            spec.check_width(s.rows, f"segment {i}: ")
            check_grid_span(s.grid, s.rows.shape[0], spec.vision, ids[-1] if ids else None,
                            f"segment {i}: ")
            # the content key and row digests of the rows as sent (set where the server decoded
            # the span; computed here for an in-process caller's spans): the digests give the
            # placeholder ids too, unless the rows must be cast
            s = keyed(s)
            if s.bidirectional:
                check_block(spec, s.rows.shape[0], f"segment {i}: a bidirectional span")
            if spec.vision is None:
                t, span_ids = _rows_and_ids(s, spec, i)
                if s.bidirectional:
                    span_ids = bidirectional_ids(span_ids, s.content_key)
                positions.extend(range(len(ids), len(ids) + len(span_ids)))
                ids.extend(span_ids)
            else:
                t = _cast(s, spec, i)
                span_ids, image = place(s.content_key, s.grid, t.shape[0], len(ids), spec.vision, spec.tokenizer)
                images.append(image)
                positions.extend(image.positions)
                ids.extend(span_ids)
            rows_per_span.append(t)
            content_keys.append(s.content_key and tenants.scoped(s.content_key))  # held rows: per tenant
            bidirectional.append(s.bidirectional)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token or embedding row")
    if len(ids) >= spec.context_len:
        raise ValueError(f"the prompt has {len(ids)} positions (text tokens + span rows), more than "
                         f"the model's context length of {spec.context_len}")
    if spec.vision is not None:
        check_vision_ids(ids, images, spec.vision)
    if spec.prefix_lm:
        check_block(spec, len(ids), "the prompt (this model attends it as one bidirectional block)")
    prompt_rows = PromptRows.from_spans(rows_per_span, content_keys, positions, bidirectional) \
        if rows_per_span else None
    if spec.encoder_decoder is not None:
        return as_encoder_prompt(ids, prompt_rows, spec.encoder_decoder)
    if images:
        prompt_rows.images = image_inputs(ids, images, spec.vision)
    return ids, prompt_rows


def blocks_refused(server_args: Any, model_config: Any, vision: VisionSpec | None) -> str | None:
    """Why this server cannot attend a block both ways (docs/engine.md, "Bidirectional blocks");
    None where it can."""
    if vision is not None:
        return ("a VLM served natively attends its image rows as its own model does: send "
                "causal spans")
    backend = _prefill_backend(server_args)
    if backend not in BLOCK_BACKENDS:
        return (f"bidirectional blocks are attended on the {', '.join(BLOCK_BACKENDS)} attention "
                f"backends; this server prefills with {backend!r}")
    if _linear_attention(model_config):
        return "this model's linear-attention layers read the prompt in one direction only"
    if backend not in SLIDING_BLOCK_BACKENDS and split_sliding_blocks(server_args.model_path):
        return ("this model attends a block both ways on its sliding layers only, which "
                f"{' and '.join(map(repr, SLIDING_BLOCK_BACKENDS))} do; this server prefills with {backend!r}")
    if backend != TORCH_NATIVE:
        if getattr(server_args, "speculative_algorithm", None):
            return "speculative decoding plans the GPU backends' masks for its own trees"
        if getattr(server_args, "enable_deterministic_inference", False):
            return "the deterministic extend kernel is not one sgl_embeds gives a block's mask"
        if getattr(server_args, "dcp_size", 1) > 1:
            return "decode context parallelism attends without a custom mask"
        if getattr(model_config, "attention_arch", None) is not None \
                and getattr(model_config.attention_arch, "name", "") == "MLA":
            return "multi-head latent attention prefills without a custom mask"
    return None


def _prefill_backend(server_args: Any) -> str:
    return server_args.prefill_attention_backend or server_args.attention_backend


def _linear_attention(model_config: Any) -> bool:
    """Whether SGLang registers linear-attention (recurrent) layers for the model."""
    try:
        return getattr(model_config, "linear_attn_registry_result", None) is not None
    except Exception:  # a config its registry cannot read has no linear layers SGLang knows of
        return False


TORCH_NATIVE = "torch_native"
# where a block is attended: block_attention.py (CPU), gpu_block_attention.py (the others)
BLOCK_BACKENDS = (TORCH_NATIVE, "triton", "flashinfer")
# where a block on the sliding layers only is (Gemma 4 26B / 31B): a full layer causal, per layer
SLIDING_BLOCK_BACKENDS = (TORCH_NATIVE, "triton")


@dataclasses.dataclass(frozen=True)
class BlockLimit:
    """The most positions one block may hold on this server, and why (the end of a 400)."""

    positions: int
    why: str


def block_limit(server_args: Any, model_config: Any) -> BlockLimit:
    """A block is prefilled in one step; on a GPU backend a sliding layer's window also bounds it
    (the kernels AND their window with the block's mask: gpu_block_attention.py)."""
    limit = BlockLimit(server_args.max_prefill_tokens, "a block is prefilled in one step, of at most "
                       f"{server_args.max_prefill_tokens} (--max-prefill-tokens)")
    backend = _prefill_backend(server_args)
    window = _sliding_window(model_config) if backend != TORCH_NATIVE else None
    if window is not None and window < limit.positions:
        limit = BlockLimit(window, f"on {backend!r} a block must fit the model's sliding window "
                           f"of {window} positions")
    return limit


def _sliding_window(model_config: Any) -> int | None:
    config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def check_block(spec: ModelSpec, n_positions: int, what: str) -> None:
    """A block of ``n_positions`` against what the server can attend (``ValueError``: HTTP 400)."""
    if spec.blocks_refused is not None:
        raise ValueError(f"{what} cannot be served here: {spec.blocks_refused}")
    if spec.max_block is not None and n_positions > spec.max_block.positions:
        raise ValueError(f"{what} has {n_positions} positions; {spec.max_block.why}")


# Casts to the model's dtype that lose nothing (and so cannot overflow): rows sent in such a dtype
# stay in it up to the model, which casts the rows it runs (SGLang's model runner does, for every
# override); their bytes as sent name the model's rows, so they give the placeholder ids
EXACT_CASTS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def _cast(s: Span, spec: ModelSpec, i: int) -> torch.Tensor:
    """A span's rows in the model's dtype; a cast that overflows it is the client's error."""
    t = s.rows.to(spec.dtype)
    if t.dtype != s.rows.dtype and wire.first_non_finite_row(t) is not None:
        raise ValueError(f"segment {i}: embeddings overflow the model's dtype {spec.dtype}")
    return t


def _rows_and_ids(s: Span, spec: ModelSpec, i: int) -> tuple[torch.Tensor, list[int]]:
    """A keyed span's rows for ``PromptRows`` and its placeholder ids (held under its content
    key). Rows in the model's dtype, or in one whose cast to it is exact, are not cast here: no
    copy of (up to) twice their bytes, and their ids come from the row digests already made, so
    the HTTP process reads the bytes once."""
    if s.rows.dtype == spec.dtype or (s.rows.dtype, spec.dtype) in EXACT_CASTS:
        return s.rows, placeholder_ids(s.rows, s.content_key, s.row_digests)
    t = _cast(s, spec, i)
    return t, placeholder_ids(t, s.content_key)


def to_generate_kwargs(body: dict, spec: ModelSpec, store: SpanStore | None = None) -> dict:
    """Replace the span fields of a ``/generate``-shaped body by ``input_ids`` and
    ``positional_embed_overrides``, ready for ``GenerateReqInput(**kwargs)``."""
    prompts, is_batch = parse_prompts(body, spec.max_span_bytes, store)
    built = [build_ids(p, spec) for p in prompts]
    # text: a routing hint
    out = {k: v for k, v in body.items() if k not in REQUEST_SPAN_FIELDS and k != "text"}
    if is_batch:
        out["input_ids"] = [ids for ids, _ in built]
        per_prompt = [prompt_rows for _, prompt_rows in built]
        n = _parallel_samples(body.get("sampling_params"))
        out["positional_embed_overrides"] = per_prompt * n
    else:
        out["input_ids"], out["positional_embed_overrides"] = built[0]
    return out


def _parallel_samples(sampling_params: Any) -> int:
    """``n`` of a batch request: GenerateReqInput repeats the batch n times for parallel sampling."""
    first = (sampling_params[0] if isinstance(sampling_params, list) and sampling_params
             else sampling_params)
    n = first.get("n", 1) if isinstance(first, dict) else 1
    return n if isinstance(n, int) and n > 1 else 1


def make_generate_req(body: dict, spec: ModelSpec, store: SpanStore | None = None,
                      ignore_unknown: bool = False) -> Any:
    """A ``GenerateReqInput`` for a body with span fields; ``ValueError`` on any bad field.

    ``ignore_unknown`` (HTTP): fields ``GenerateReqInput`` does not have are dropped, as stock
    ``/generate`` drops them (a gateway in front adds ``model``, for one). The ``Engine`` keeps
    them, so a misspelt keyword is an error there, as it is for the stock ``Engine.generate``."""
    from sglang.srt.managers.io_struct import GenerateReqInput  # SGLang not ready at plugin load

    kwargs = to_generate_kwargs(body, spec, store)
    if ignore_unknown:
        known = {f.name for f in dataclasses.fields(GenerateReqInput)}
        kwargs = {k: v for k, v in kwargs.items() if k in known}
    try:
        return GenerateReqInput(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad request field: {e}") from None
