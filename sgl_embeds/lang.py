"""The DSL's constructors (``sgl.embeds``, ``sgl.region``, ``sgl.video``, ``image_part``) and the
interpreter hooks that run them (``executor_init``, ``execute``, ``fork``).

A span enters program text as a marker (``segments.marker``) while its rows stay in the
executor's ``ProgramSpans``, declared once and copied on ``fork`` as SGLang does its ``images_``;
``program_prompt`` splits the text at the markers (docs/architecture.md, steps 1-2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from PIL import Image
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import get_chat_template
from sglang.lang.choices import ChoicesDecision
from sglang.lang.api import video as _stock_video
from sglang.lang.ir import SglArgument, SglExpr, SglImage
from sglang.lang.api import image as _stock_image

from sgl_embeds import vision
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol import wire
from sgl_embeds_protocol.family import family_of


class SglSpan(SglExpr):
    """A span of precomputed embeddings, ``[n, hidden]``: what ``sgl.embeds`` puts in a program."""

    def __init__(self, rows: torch.Tensor, grid: seg.Grid | None = None, bidirectional: bool = False):
        super().__init__()
        self.rows = rows
        self.grid = grid  # on M-RoPE VLMs: an image's or a clip's (segments.Grid)
        self.bidirectional = bidirectional  # its rows attend each other both ways

    def __repr__(self) -> str:
        return f"SglSpan(shape={list(self.rows.shape)})"


class SglRegion(SglExpr):
    """The embeddings of a box or mask region of an image, computed when the program runs."""

    def __init__(self, box: Any, image: Any = None, encoder: Callable | None = None):
        super().__init__()
        self.box, self.image, self.encoder = box, image, encoder

    def __repr__(self) -> str:
        if vision.is_mask(self.box):
            return f"SglRegion(mask of shape {list(self.box.shape)})"
        return f"SglRegion(box={self.box})"


def embeds(x: Any, image_grid_thw: Any = None, video_grid_thw: Any = None,
           second_per_grid_t: float | None = None, video_timestamps: Any = None,
           attention: str = seg.CAUSAL) -> SglSpan:
    """A span of embeddings: a torch tensor, numpy array or nested list, ``[n, hidden]`` or
    ``[hidden]``. On a VLM served natively with M-RoPE (Qwen-VL) a span is an image, with its
    ``image_grid_thw`` (t, h, w: the patch grid before the spatial merge), or a clip, with its
    ``video_grid_thw`` and the time its model reads (Qwen2.5-VL ``second_per_grid_t``, Qwen3-VL
    ``video_timestamps``; docs/vision-encoders.md); write it between the vision-start and
    vision-end tokens. ``attention="bidirectional"``: the span's rows attend each other both ways,
    as one block (text before and after it stays causal; docs/engine.md, "Bidirectional
    blocks")."""
    bidirectional = seg.bidirectional_of({seg.ATTENTION: attention})
    grid = seg.Grid.of_fields({seg.IMAGE_GRID: image_grid_thw, seg.VIDEO_GRID: video_grid_thw,
                               seg.SECONDS_PER_STEP: second_per_grid_t, seg.TIMESTAMPS: video_timestamps})
    if isinstance(x, SglArgument):  # run_batch traces programs with placeholder arguments
        return SglSpan(x, grid, bidirectional)
    t = wire.as_2d_tensor(x)
    wire.check_tensor(t)
    return SglSpan(t.detach().cpu(), grid, bidirectional)


class SglClip(SglExpr):
    """A clip's embeddings, computed on the client when the program runs (``sgl.video``)."""

    def __init__(self, frames: Any, fps: float, encoder: Callable | None = None):
        super().__init__()
        self.frames, self.fps, self.encoder = frames, fps, encoder

    def __repr__(self) -> str:
        return f"SglClip({len(self.frames)} frames at {self.fps:g} fps)"


def video(frames: Any, fps: Any = None, encoder: Callable | None = None) -> Any:
    """A clip's span: ``frames`` (a list of PIL images of one size, or a ``[t, height, width, 3]``
    uint8 array), sampled at ``fps`` frames per second, encoded when the program runs by
    ``encoder`` (default: the backend's ``vision_encoder``; one with ``.clip(frames, fps)``, as
    ``vlm.QwenVLEncoder``), with its video grid and time. Write it between the vision-start and
    vision-end tokens, as the chat template writes a video. A path (``str``) is stock SGLang's
    ``sgl.video(path, num_frames)``, for a server that decodes the file itself."""
    if isinstance(frames, str):
        return _stock_video(frames, fps)
    if fps is None:
        raise ValueError("sgl.video(frames, fps): give the frames' rate (frames per second)")
    frames = vision.clip_frames(frames)
    return SglClip(frames, vision.check_fps(fps), encoder)


def region(box: Any, image: Any = None, encoder: Callable | None = None) -> SglRegion:
    """The embeddings of a region of ``image`` (default: the program's last ``sgl.image``).

    ``box`` is ``(x0, y0, x1, y1)`` (ints are pixels, floats in [0, 1] are fractions of the image
    size, see ``vision.to_pixel_box``) or a binary mask of the image's size (numpy array, torch
    tensor or PIL image; see ``vision.mask_image``). ``encoder`` defaults to the backend's
    ``vision_encoder``.
    """
    if vision.is_mask(box):
        vision.check_mask(box)
    elif not isinstance(box, SglArgument):
        vision.check_box_form(box)
    return SglRegion(box, image, encoder)


# What an image part writes around the image's rows when the chat template does not say (not a
# model's own, read by ``vlm.model_chat_template``): the rows, then a new line
PLAIN_IMAGE_PART = ("", "\n")


class SglImagePart(SglExpr):
    """An image in a chat turn: its rows with the model's own text around them (``image_part``)."""

    def __init__(self, rows: SglExpr):
        super().__init__()
        self.rows = rows

    def __repr__(self) -> str:
        return f"SglImagePart({self.rows!r})"


def image_part(x: Any) -> SglImagePart:
    """An image part of a chat turn, written as the served model's chat template writes one: its
    vision tokens (Qwen-VL: vision-start, the rows, vision-end) or its separator (LLaVA: the rows
    and a new line) around the rows of ``x``: an image (PIL, path or base64: ``sgl.image``), a
    tensor (``sgl.embeds``) or an ``sgl.image`` / ``sgl.region`` / ``sgl.embeds`` expression.
    The text is the backend's chat template's ``image_part`` (``sgl_embeds.connect`` sets the
    model's own); with another template, the rows and a new line."""
    if isinstance(x, SglImagePart):
        raise ValueError("image_part(image_part(...)): an image part holds an image, not a part")
    if isinstance(x, SglExpr):
        return SglImagePart(x)
    if not isinstance(x, (str, bytes, os.PathLike, Image.Image)):
        return SglImagePart(embeds(x))  # rows (a placeholder argument when run_batch traces)
    return SglImagePart(_stock_image(str(x) if isinstance(x, os.PathLike) else x))


@dataclass
class ProgramSpans:
    """What an executor (``StreamExecutor``) carries for sgl_embeds, attached in its ``__init__``
    (``executor_init``) and copied to every branch by ``fork``."""

    table: dict[int, seg.Span] = field(default_factory=dict)  # marker index -> the span
    images: list[Any] = field(default_factory=list)  # the source of every sgl.image, in order

    def copy(self) -> ProgramSpans:
        return ProgramSpans(dict(self.table), list(self.images))


def program_spans(executor: Any) -> ProgramSpans:
    """The executor's ``ProgramSpans``."""
    try:
        return executor.sgl_embeds_spans
    except AttributeError:
        raise RuntimeError(f"this {type(executor).__name__} has no sgl_embeds_spans: it was made"
                           " before `import sgl_embeds` hooked SGLang's interpreter; import"
                           " sgl_embeds before running programs") from None


def program_prompt(executor: Any, text: str) -> seg.Prompt:
    """The prompt ``text`` (the executor's program text, or a request built from it) stands for:
    its text and, at each marker, the span from the executor's table."""
    return seg.split_at_markers(text, program_spans(executor).table)


def add_span(executor: Any, span: seg.Span) -> None:
    """``span`` into the executor's table, and its marker into the program text."""
    table = program_spans(executor).table
    index = len(table)
    table[index] = span
    executor._execute_fill(seg.marker(index))


def image_block(encoder: Callable) -> bool:
    """Whether the rows ``encoder`` gives for an image are one bidirectional block: its family's
    ``Family.image_block`` (Gemma 3), or the encoder's own ``image_block`` where its checkpoint
    decides (Gemma 4 26B / 31B); False for an encoder that names no known ``family``."""
    family = family_of(getattr(encoder, "family", None))  # optional (vision.VisionEncoder)
    return family is not None and (family.image_block or getattr(encoder, "image_block", False))


def _add_encoded(executor: Any, encoder: Callable, image: Any, region: Any = None) -> None:
    """A span of the encoder's rows of an image or a region, with the grid when the encoder gives
    one, attended as one block where its family's are (``image_block``), through the backend's
    ``encoder_cache`` if it has one."""
    image = vision.load_image(image)
    cache = getattr(executor.backend, "encoder_cache", None)
    if cache is not None:
        encoded = cache.encode(encoder, image, region)
    else:
        encoded = vision.encode_region(image, region, encoder)
    add_span(executor, seg.Span(encoded.rows, grid=encoded.grid,
                                bidirectional=image_block(encoder)))


def _execute_region(executor: Any, expr: SglRegion) -> None:
    image = expr.image
    if image is None:
        images = program_spans(executor).images
        if not images:
            raise ValueError("sgl.region needs an image: pass image=... or put sgl.image(...) "
                             "before it")
        image = images[-1]
    encoder = expr.encoder or getattr(executor.backend, "vision_encoder", None)
    if encoder is None:
        raise ValueError("sgl.region needs a VisionEncoder: pass encoder=... or give the "
                         "backend one")
    _add_encoded(executor, encoder, image, expr.box)


def _execute_video(executor: Any, expr: SglClip) -> None:
    encoder = expr.encoder or getattr(executor.backend, "vision_encoder", None)
    if encoder is None:
        raise ValueError("sgl.video needs a VisionEncoder with .clip(frames, fps): pass encoder=... or "
                         "give the backend one")
    cache = getattr(executor.backend, "encoder_cache", None)
    if cache is not None:
        encoded = cache.encode_clip(encoder, expr.frames, expr.fps)
    else:
        encoded = vision.encode_clip(expr.frames, expr.fps, encoder)
    add_span(executor, seg.Span(encoded.rows, grid=encoded.grid))


def executor_init(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND hook of ``StreamExecutor.__init__``: the executor's ``ProgramSpans``, attached before
    its worker thread starts."""
    self.sgl_embeds_spans = ProgramSpans()
    original(self, *args, **kwargs)


def execute(original: Callable, self: Any, other: Any) -> Any:
    """AROUND hook of ``StreamExecutor._execute``: our nodes, and images for encoder backends."""
    if isinstance(other, SglSpan):
        return add_span(self, seg.Span(other.rows, grid=other.grid, bidirectional=other.bidirectional))
    if isinstance(other, SglClip):
        return _execute_video(self, other)
    if isinstance(other, SglRegion):
        return _execute_region(self, other)
    if isinstance(other, SglImagePart):
        before, after = getattr(self.chat_template, "image_part", PLAIN_IMAGE_PART)
        self._execute_fill(before)
        self._execute(other.rows)
        return self._execute_fill(after)
    if isinstance(other, SglImage):
        program_spans(self).images.append(other.path)  # loaded only if a region asks for it
        encoder = getattr(self.backend, "vision_encoder", None)
        if encoder is not None:
            return _add_encoded(self, encoder, other.path)
    return original(self, other)


def fork(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``StreamExecutor.fork``: every branch sees the parent's spans and images.

    Syncing first matters: stock ``fork`` decides whether to commit the shared prefix (one
    prefill that all branches then hit in the cache) by reading ``text_`` *before* it syncs the
    executor thread, so it often sees an empty text and the branches race to prefill it.
    """
    self.sync()
    children = original(self, *args, **kwargs)
    for child in children:
        child.sgl_embeds_spans = program_spans(self).copy()
    return children


def program_segments(state: Any) -> list[seg.Segment]:
    """The segments a program state would send next (text and spans), for inspection and tests."""
    executor = getattr(state, "stream_executor", state)
    executor.sync()
    return program_prompt(executor, executor.text_).segments


def compile_program(program: Any, like: Any = None, vision_encoder: Callable | None = None,
                    **arguments: Any) -> list[list[seg.Segment]]:
    """Run ``program`` offline and return the segment list it would send at each ``gen`` and
    ``select`` (generations come back empty, selects pick the first choice), then its final
    segments. No server is contacted; for inspection and tests. ``like``: a backend whose chat
    template and vision encoder to use (default: the "default" template, ``vision_encoder``)."""
    recorded: list[list[seg.Segment]] = []

    class Recorder(BaseBackend):
        def __init__(self) -> None:
            super().__init__()
            self.vision_encoder = vision_encoder or getattr(like, "vision_encoder", None)
            self.chat_template = (like.chat_template if like is not None
                                  else get_chat_template("default"))

        def _record(self, s: Any) -> None:
            recorded.append(program_prompt(s, s.text_).segments)

        def generate(self, s: Any, sampling_params: Any) -> tuple[str, dict]:
            self._record(s)
            return "", {}

        def select(self, s: Any, choices: list, temperature: float, choices_method: Any) -> Any:
            self._record(s)
            return ChoicesDecision(decision=choices[0], meta_info={})

    state = program.run(backend=Recorder(), **arguments)
    executor = state.stream_executor
    executor.sync()
    return recorded + [program_prompt(executor, executor.text_).segments]
