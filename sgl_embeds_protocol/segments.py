"""The prompt model, shared by both sides of the wire: segments and span markers.

A ``Prompt`` is a list of ``Text``, ``Ids`` and ``Span`` (frozen ``[n, hidden]`` rows, with a
``Grid`` on M-RoPE VLMs, checked when made); on the wire each is a JSON object (docs/concepts.md,
"Segments"). In text a span is a ``marker`` (private-use characters around an index into a table
of spans); ``split_at_markers`` turns such text back into segments.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch

MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


@dataclass
class Text:
    text: str


@dataclass
class Ids:
    ids: list[int]


# A grid's fields on the wire (a span segment's or a chat part's keys beside its rows), HF's names
IMAGE_GRID, VIDEO_GRID, SECONDS_PER_STEP, TIMESTAMPS = (
    "image_grid_thw", "video_grid_thw", "second_per_grid_t", "video_timestamps")
GRID_FIELDS = (IMAGE_GRID, VIDEO_GRID, SECONDS_PER_STEP, TIMESTAMPS)


@dataclass(frozen=True)
class Grid:
    """Where an M-RoPE VLM (Qwen-VL) places a span's rows: the patch grid ``(t, h, w)`` before
    the spatial merge of an image (``t`` = 1) or of a clip (``video``: ``t`` temporal steps of
    ``temporal_patch_size`` frames each), and a clip's time as its model reads it:
    ``second_per_grid_t`` (Qwen2.5-VL: seconds per temporal step, which space the steps' rotary
    positions) or ``timestamps`` (Qwen3-VL: each step's time in seconds, written as text before
    its frame). Checked here, where it enters; whether it fits the rows and the model is the
    server's check (``image_spans.check_grid_span``)."""

    thw: tuple[int, int, int]
    video: bool = False
    second_per_grid_t: float | None = None
    timestamps: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        name = VIDEO_GRID if self.video else IMAGE_GRID
        thw = self.thw
        if (not isinstance(thw, (list, tuple)) or len(thw) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in thw)):
            raise ValueError(f"{name} must be [t, h, w] of positive ints, got {thw!r}")
        object.__setattr__(self, "thw", tuple(int(v) for v in thw))
        if not self.video and (self.second_per_grid_t is not None or self.timestamps is not None):
            raise ValueError(f"{SECONDS_PER_STEP} and {TIMESTAMPS} are a clip's time: "
                             f"give them with {VIDEO_GRID}, not {IMAGE_GRID}")
        if self.second_per_grid_t is not None:
            value = self.second_per_grid_t
            if not _is_number(value) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"{SECONDS_PER_STEP} must be a finite number of seconds > 0, got {value!r}")
            object.__setattr__(self, "second_per_grid_t", float(value))
        if self.timestamps is not None:
            stamps = self.timestamps
            if (not isinstance(stamps, (list, tuple)) or len(stamps) != thw[0]
                    or not all(_is_number(v) and math.isfinite(v) and v >= 0 for v in stamps)):
                raise ValueError(f"{TIMESTAMPS} must be one time in seconds (finite, >= 0) per temporal "
                                 f"step: {thw[0]} for {VIDEO_GRID} {list(thw)}, got {stamps!r}")
            object.__setattr__(self, "timestamps", tuple(float(v) for v in stamps))

    @classmethod
    def of_fields(cls, fields: Mapping[str, Any]) -> Grid | None:
        """The grid written in ``fields`` (a span segment or chat part); None where it has none."""
        image, video = fields.get(IMAGE_GRID), fields.get(VIDEO_GRID)
        seconds, stamps = fields.get(SECONDS_PER_STEP), fields.get(TIMESTAMPS)
        if image is not None and video is not None:
            raise ValueError(f"a span is an image ({IMAGE_GRID}) or a clip ({VIDEO_GRID}), not both")
        if video is None and image is None:
            if seconds is not None or stamps is not None:
                raise ValueError(f"{SECONDS_PER_STEP} and {TIMESTAMPS} are a clip's time: give them "
                                 f"with its {VIDEO_GRID}")
            return None
        if image is not None:
            return cls(image, second_per_grid_t=seconds, timestamps=stamps)
        return cls(video, video=True, second_per_grid_t=seconds, timestamps=stamps)

    def fields(self) -> dict[str, Any]:
        """The grid as a span segment's or a chat part's fields (what ``of_fields`` reads)."""
        out: dict[str, Any] = {VIDEO_GRID if self.video else IMAGE_GRID: list(self.thw)}
        if self.second_per_grid_t is not None:
            out[SECONDS_PER_STEP] = self.second_per_grid_t
        if self.timestamps is not None:
            out[TIMESTAMPS] = list(self.timestamps)
        return out

    def n_rows(self, merge_size: int) -> int:
        """The rows of a span on this grid: t*h*w / merge**2 (exact when h, w divide by merge)."""
        return math.prod(self.thw) // (merge_size * merge_size)


# How a span's rows attend (a span segment's field beside its rows): causally, like text (the
# default), or both ways among themselves, as one block (docs/engine.md, "Bidirectional blocks")
ATTENTION, CAUSAL, BIDIRECTIONAL = "attention", "causal", "bidirectional"


def bidirectional_of(fields: Mapping[str, Any]) -> bool:
    """Whether ``fields`` (a span segment) ask for its rows to attend both ways."""
    value = fields.get(ATTENTION)
    if value is None:
        return False
    if value not in (CAUSAL, BIDIRECTIONAL):
        raise ValueError(f"{ATTENTION} must be {CAUSAL!r} or {BIDIRECTIONAL!r}, got {value!r}")
    return value == BIDIRECTIONAL


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Span:
    """A span: ``[n, hidden]`` embedding rows at ``n`` consecutive prompt positions (a Qwen3-VL
    clip's frame by frame, each after its time). Frozen: what the server learns of it (its
    content key, its row digests) makes a new ``Span`` (``dataclasses.replace``)."""

    rows: torch.Tensor  # [n, hidden]
    # keys.content_key of the rows as sent: set where the server decodes or holds them
    content_key: str | None = None
    row_digests: bytes | None = None  # keys.row_digests of the rows, set where the server decodes them
    grid: Grid | None = None  # an image's or a clip's, on M-RoPE VLMs (image_spans.py)
    bidirectional: bool = False  # its rows attend each other both ways, as one block

    def __post_init__(self) -> None:
        if self.grid is not None and not isinstance(self.grid, Grid):
            raise TypeError(f"Span.grid is a segments.Grid, got {type(self.grid).__name__}")
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"Span.bidirectional is a bool, got {self.bidirectional!r}")

    def __len__(self) -> int:
        return self.rows.shape[0]


Segment = Union[Text, Ids, Span]


@dataclass
class Prompt:
    """An ordered list of segments; adjacent text is merged as it is appended."""

    segments: list[Segment] = field(default_factory=list)

    def append(self, seg: Segment) -> None:
        if isinstance(seg, Text):
            if not seg.text:
                return
            if self.segments and isinstance(self.segments[-1], Text):
                self.segments[-1] = Text(self.segments[-1].text + seg.text)
                return
        self.segments.append(seg)


def marker(index: int) -> str:
    return f"{MARK_OPEN}{index}{MARK_CLOSE}"


def has_markers(text: str) -> bool:
    return MARK_OPEN in text


def split_at_markers(text: str, table: dict[int, torch.Tensor | Span]) -> Prompt:
    """Text with span markers -> a prompt of text and span segments (empty text dropped)."""
    prompt = Prompt()
    pos = 0
    for m in _MARKER.finditer(text):
        prompt.append(Text(text[pos : m.start()]))
        index = int(m.group(1))
        if index not in table:
            raise ValueError(f"span marker {index} has no tensor")
        span = table[index]
        prompt.append(span if isinstance(span, Span) else Span(span))
        pos = m.end()
    prompt.append(Text(text[pos:]))
    return prompt


def strip_markers(text: str) -> str:
    return _MARKER.sub("", text)
