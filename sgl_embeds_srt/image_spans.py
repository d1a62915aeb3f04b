"""Grid spans (an image's or a clip's rows with its ``segments.Grid``) on natively served M-RoPE
VLMs, on the tokenizer side: their checks, the ids they put in a prompt, and the precomputed
image items (identity: content key + grid) with the prompt's M-RoPE positions. The scheduler
moves the rows into the items (``scheduler.handle_generate_request``); the model runner embeds
them as they are (``model_runner``). docs/architecture.md, "Spans with a grid".
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch
from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding
from sglang.srt.managers.schedule_batch import (
    Modality,
    MultimodalDataItem,
    MultimodalInputFormat,
    MultimodalProcessorOutput,
)

from sgl_embeds_protocol.family import BY_NAME, NATIVE, Family, family_of
from sgl_embeds_protocol.info import VisionInfo
from sgl_embeds_srt.encoder_prompts import served_encoder_decoder, without_spans
from sgl_embeds_srt.prompt_rows import PromptRows
from sgl_embeds_protocol.segments import IMAGE_GRID, SECONDS_PER_STEP, TIMESTAMPS, VIDEO_GRID, Grid

SPAN_ITEM_KEY = "sgl_embeds_span"  # marks our items in model_specific_data
_IDENTITY_TAG = b"sgl_embeds/grid/v4"  # v4: images and clips; content keys of blake3-rows/v3


@dataclass(frozen=True)
class VisionSpec:
    """What a natively served M-RoPE VLM needs of an image span."""

    model_type: str
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    merge_size: int
    tokens_per_second: float | None
    # Qwen3-VL: the tower's deepstack layers, whose rows an image's span carries after its main
    # rows along the width (the LLM adds layer i's after its decoder layer i)
    deepstack_layers: int = 0

    @classmethod
    def of(cls, hf_config: Any) -> VisionSpec | None:
        """The spec of an M-RoPE VLM's config; None for any other model."""
        model_type = getattr(hf_config, "model_type", None)
        family = family_of(model_type)
        if family is None or not family.mrope:
            return None
        vision = hf_config.vision_config
        return cls(model_type, hf_config.image_token_id, hf_config.video_token_id,
                   hf_config.vision_start_token_id, hf_config.vision_end_token_id,
                   vision.spatial_merge_size, getattr(vision, "tokens_per_second", None),
                   len(getattr(vision, "deepstack_visual_indexes", None) or ()))

    @property
    def family(self) -> Family:
        return BY_NAME[self.model_type]

    def largest_image_rows(self, processor: Any) -> int:
        """The rows of the largest image ``processor`` (the checkpoint's, as SGLang loaded it)
        makes: its most pixels (``size["longest_edge"]``, as transformers 5 writes it, or
        ``max_pixels``) over a merged patch's; 0 where it does not say."""
        image = getattr(processor, "image_processor", None)
        size = getattr(image, "size", None)  # a SizeDict in transformers 5, a dict before
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        pixels = longest or getattr(image, "max_pixels", None)
        patch = getattr(image, "patch_size", None)
        if not isinstance(pixels, int) or not isinstance(patch, int) or pixels <= 0 or patch <= 0:
            return 0
        return pixels // (patch * self.merge_size) ** 2

    def span_width(self, hidden_size: int) -> int:
        """The width of an image's span: the LLM's hidden size, times 1 + the deepstack layers."""
        return hidden_size * (1 + self.deepstack_layers)

    def width_error(self, width: int, hidden_size: int) -> str:
        """Why a span of ``width`` does not fit (the width the model wants, and why)."""
        want = self.span_width(hidden_size)
        if not self.deepstack_layers:
            return f"an image span of this model ({self.model_type}) is [n, {want}] (the LLM's hidden size); got width {width}"
        return (f"an image span of this model ({self.model_type}) is [n, {hidden_size} x (1 + {self.deepstack_layers})] = "
                f"[n, {want}]: the image's rows, then the rows of each of its {self.deepstack_layers} deepstack layers "
                "along the width (HF get_image_features: pooler_output, then deepstack_features, SGLang's layout), "
                "which the LLM adds after its first layers; without them it is another model. Got width "
                f"{width}")

    def info(self, hidden_size: int, largest_image_rows: int) -> VisionInfo:
        """For ``/sgl_embeds/info``: what a client needs to send image spans."""
        return VisionInfo(
            mrope=True, model_type=self.model_type, served=self.family.served_as == NATIVE,
            merge_size=self.merge_size, image_token_id=self.image_token_id,
            video_token_id=self.video_token_id, vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id, deepstack_layers=self.deepstack_layers,
            span_width=self.span_width(hidden_size), video_time=self.family.clip_time,
            largest_image_rows=largest_image_rows)


@dataclass(frozen=True)
class GridSpan:
    """A grid span placed in a prompt (an image, or a clip): its content key, its grid, the runs
    of positions its rows stand at (first, last; one run, or one per frame of a Qwen3-VL clip,
    whose frames are written apart with their times between), and ``end``, the position after
    the ids it placed."""

    content_key: str
    grid: Grid
    runs: tuple[tuple[int, int], ...]
    end: int

    @property
    def positions(self) -> list[int]:
        return [p for first, last in self.runs for p in range(first, last + 1)]


def check_grid_span(grid: Grid | None, n_rows: int, spec: VisionSpec | None, before: int | None,
                    where: str) -> None:
    """A span's grid against the served model: ``ValueError`` (HTTP 400) naming what is wrong.
    ``before``: the id just before the span (None at the start of the prompt)."""
    if spec is None:
        if grid is not None:
            raise ValueError(f"{where}{IMAGE_GRID} and {VIDEO_GRID} are for VLMs served natively with M-RoPE "
                             "(Qwen-VL); this model places rows at 1-D positions: send the span without them")
        return
    if spec.family.served_as != NATIVE:
        raise ValueError(f"{where}spans are not served on {spec.model_type} models: "
                         f"{spec.family.refused} (docs/vision-encoders.md)")
    if grid is None:
        raise ValueError(f"{where}this model ({spec.model_type}) places image rows at M-RoPE positions: "
                         f"give the span its {IMAGE_GRID} [t, h, w] (the patch grid before the merge), or a "
                         f"clip's {VIDEO_GRID}")
    name = VIDEO_GRID if grid.video else IMAGE_GRID
    if not grid.video and grid.thw[0] != 1:
        raise ValueError(f"{where}{IMAGE_GRID} {list(grid.thw)}: an image's grid has t = 1 (the image processor "
                         "repeats a still image over the temporal patch); t > 1 is a clip, whose frames need "
                         f"their time: send it as {VIDEO_GRID} with {_time_wanted(spec)}")
    if grid.video:
        _check_video_time(grid, spec, where)
    merge = spec.merge_size
    if grid.thw[1] % merge or grid.thw[2] % merge:
        raise ValueError(f"{where}{name} {list(grid.thw)}: h and w must be multiples of the merge size {merge}")
    expected = grid.n_rows(merge)
    if expected != n_rows:
        raise ValueError(f"{where}{name} {list(grid.thw)} makes t*h*w/merge**2 = {expected} rows "
                         f"(merge size {merge}), but the span has {n_rows}")
    if before != spec.vision_start_token_id:
        raise ValueError(f"{where}an image or clip span must follow the vision-start token (id "
                         f"{spec.vision_start_token_id}, '<|vision_start|>'), as the chat template writes it; "
                         "without it the rope index would place the rows as text")


def _time_wanted(spec: VisionSpec) -> str:
    return {None: "no time field (its steps are 1 position apart)",
            SECONDS_PER_STEP: f"{SECONDS_PER_STEP} (seconds per temporal step)",
            TIMESTAMPS: f"{TIMESTAMPS} (each temporal step's time in seconds)"}[spec.family.clip_time]


def _check_video_time(grid: Grid, spec: VisionSpec, where: str) -> None:
    given = [name for name, value in ((SECONDS_PER_STEP, grid.second_per_grid_t), (TIMESTAMPS, grid.timestamps))
             if value is not None]
    wanted = spec.family.clip_time
    if given != ([] if wanted is None else [wanted]):
        raise ValueError(f"{where}a clip on {spec.model_type} takes {_time_wanted(spec)}; got "
                         f"{' and '.join(given) or 'no time field'}")


def place(content_key: str, grid: Grid, n_rows: int, start: int, spec: VisionSpec,
          tokenizer: Any) -> tuple[list[int], GridSpan]:
    """The ids a checked grid span puts at prompt position ``start`` and where its rows stand: an
    image's or a Qwen2-VL / Qwen2.5-VL clip's pad token once per row; a Qwen3-VL clip frame by
    frame, each after its time as text (``<1.5 seconds>``, as its processor and SGLang's write
    it) and inside its own vision start and end (the span's own pair stays around them)."""
    if grid.timestamps is None:  # one run of rows (an image never has timestamps: segments.Grid)
        pad = spec.video_token_id if grid.video else spec.image_token_id
        return [pad] * n_rows, GridSpan(content_key, grid, ((start, start + n_rows - 1),), start + n_rows)
    if tokenizer is None:
        raise ValueError("this server runs without a tokenizer: it cannot write a clip's frame times")
    per_frame = n_rows // grid.thw[0]
    ids: list[int] = []
    runs = []
    for seconds in grid.timestamps:
        ids += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
        ids.append(spec.vision_start_token_id)
        runs.append((start + len(ids), start + len(ids) + per_frame - 1))
        ids += [spec.video_token_id] * per_frame + [spec.vision_end_token_id]
    return ids, GridSpan(content_key, grid, tuple(runs), start + len(ids))


def check_vision_ids(ids: list[int], images: list[GridSpan], spec: VisionSpec) -> None:
    """The prompt's ids as SGLang's rope index will read them: an image or video pad id stands
    only at a grid span's rows (one written in text would be counted as another image, ending
    in an IndexError or rows at the wrong positions), and every grid span is closed by the
    vision-end token, as the chat template writes it. ``ValueError`` (HTTP 400) naming the place."""
    rows = {p for image in images for p in image.positions}
    pads = {spec.image_token_id: "image pad", spec.video_token_id: "video pad"}
    for position, token in enumerate(ids):
        if token in pads and position not in rows:
            raise ValueError(f"position {position} holds the {pads[token]} token (id {token}) outside a grid "
                             "span: the model's vision tokens stand only where a span's rows are; send the image "
                             "or clip as a span with its grid after the vision-start token, not its pad tokens")
    for image in images:
        if image.end >= len(ids) or ids[image.end] != spec.vision_end_token_id:
            raise ValueError(f"the {'clip' if image.grid.video else 'image'} span at position {image.runs[0][0]} "
                             f"must be followed by the vision-end token (id {spec.vision_end_token_id}, "
                             "'<|vision_end|>'), as the chat template writes it")


def identity(content_key: str, grid: Grid, run: int = 0) -> bytes:
    """The 32-byte cache identity of a grid span's item: its content key, its whole grid (kind,
    t, h, w, time) and which of its runs (a Qwen3-VL clip's frame) the item holds."""
    digest = hashlib.sha256(_IDENTITY_TAG + content_key.encode())
    digest.update(struct.pack("<?3qdq", grid.video, *grid.thw, grid.second_per_grid_t or 0.0, run))
    digest.update(struct.pack(f"<{len(grid.timestamps or ())}d", *(grid.timestamps or ())))
    return digest.digest()


def image_inputs(ids: list[int], images: list[GridSpan], spec: VisionSpec) -> MultimodalProcessorOutput:
    """SGLang's multimodal inputs of a prompt whose grid spans are ``images`` (rows not yet
    attached: the scheduler moves them in, ``handle_generate_request``): one item per run of
    rows (an image, a clip, a Qwen3-VL clip's frame, as SGLang's own processor makes them)."""
    items = []
    for image in images:
        grid = image.grid
        for run, (first, last) in enumerate(image.runs):
            thw = (1, *grid.thw[1:]) if len(image.runs) > 1 else grid.thw
            key = "video_grid_thw" if grid.video else "image_grid_thw"
            item = MultimodalDataItem(
                modality=Modality.VIDEO if grid.video else Modality.IMAGE,
                format=MultimodalInputFormat.PRECOMPUTED_EMBEDDING, offsets=[(first, last)],
                model_specific_data={key: torch.tensor([thw]), SPAN_ITEM_KEY: True})
            item.set_identity(identity(image.content_key, grid, run))
            items.append(item)
    stills = [image.grid.thw for image in images if not image.grid.video]
    clips = [image.grid for image in images if image.grid.video]
    seconds = [clip.second_per_grid_t for clip in clips]
    positions, delta = MRotaryEmbedding.get_rope_index(
        spatial_merge_size=spec.merge_size, image_token_id=spec.image_token_id,
        video_token_id=spec.video_token_id, vision_start_token_id=spec.vision_start_token_id,
        model_type=spec.model_type, tokens_per_second=spec.tokens_per_second,
        input_ids=torch.tensor([ids], dtype=torch.long),
        image_grid_thw=torch.tensor(stills) if stills else None,
        video_grid_thw=torch.tensor([clip.thw for clip in clips]) if clips else None,
        second_per_grid_ts=torch.tensor(seconds) if clips and None not in seconds else None)
    return MultimodalProcessorOutput(
        mm_items=items, input_ids=list(ids),
        padded_input_ids=MultimodalProcessorOutput.build_padded_input_ids(ids, items),
        im_token_id=spec.image_token_id, im_start_id=spec.vision_start_token_id,
        im_end_id=spec.vision_end_token_id, video_token_id=spec.video_token_id,
        mrope_positions=positions.squeeze(1), mrope_position_delta=delta)


def is_span_item(item: MultimodalDataItem) -> bool:
    """An item ``image_inputs`` made (its rows are a span's, never the tower's)."""
    return bool(item.model_specific_data.get(SPAN_ITEM_KEY))


def create_tokenized_object(original: Callable, self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``TokenizerManager._create_tokenized_object``: a prompt with image spans
    (or an encoder-decoder's encoder prompt) hands its items to the scheduler in SGLang's own field
    for processed multimodal inputs; an encoder-decoder's request without one is refused."""
    tokenized = original(self, obj, *args, **kwargs)
    prompt_rows = getattr(obj, "positional_embed_overrides", None)  # embedding requests have none
    if isinstance(prompt_rows, PromptRows) and prompt_rows.images is not None:
        tokenized.mm_inputs = prompt_rows.images
    elif served_encoder_decoder(self.model_config.hf_config.architectures):
        without_spans(self, obj, tokenized)
    return tokenized
