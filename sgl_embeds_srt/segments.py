"""The prompt model, shared by both sides of the wire: segments and span markers.

A prompt is a list of segments: ``Text`` (tokenized by the server like a plain prompt), ``Ids``
(token ids, used as they are) and ``Span`` (an ``[n, hidden]`` span of embedding rows). On the
wire each is a JSON object (``{"type": "text" | "input_ids" | "embeds", ...}``; tensors as in
``wire.py``): the client writes them (``backend.py``), the server reads them (``srt/parse.py``).

Where a span stands inside text (program text on the client, a rendered chat on the server) it is
a *marker*: Unicode private-use characters around an index into a table of spans;
``split_at_markers`` turns such text back into segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

import torch

MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


@dataclass
class Text:
    text: str


@dataclass
class Ids:
    ids: list[int]


@dataclass(frozen=True)
class Span:
    """A span: ``[n, hidden]`` embedding rows at ``n`` consecutive prompt positions. Frozen: what
    the server learns of it (its content key, its row digests) makes a new ``Span``
    (``dataclasses.replace``), and the grid is checked here, where it enters."""

    rows: torch.Tensor  # [n, hidden]
    # keys.content_key of the rows as sent: set where the server decodes or holds them
    content_key: str | None = None
    row_digests: bytes | None = None  # keys.row_digests of the rows, set where the server decodes them
    # an image's patch grid [t, h, w] before the spatial merge, on M-RoPE VLMs (image_spans.py)
    image_grid_thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_grid_thw", image_grid(self.image_grid_thw))

    def __len__(self) -> int:
        return self.rows.shape[0]


Segment = Union[Text, Ids, Span]


def image_grid(value: object) -> tuple[int, int, int] | None:
    """A ``Span.image_grid_thw`` as given (None when absent): ``[t, h, w]`` of positive ints,
    else ``ValueError``; whether it fits the rows and the model is the server's check."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"image_grid_thw must be [t, h, w] of positive ints, got {value!r}")
    return int(value[0]), int(value[1]), int(value[2])


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
