"""Object detection as PaliGemma does it: ``detect cat ; dog`` answered with location tokens.

PaliGemma answers ``detect <label> ; <label>`` with one group per object, the groups joined by
``" ; "``: four location tokens ``<locYYYY><locXXXX><locYYYY><locXXXX>`` (y_min, x_min, y_max,
x_max, each in 1024ths of the model's square input), a space, the label. SigLIP's image
processor resizes the whole image to that square without keeping its aspect, so x scales back by
width / 1024 and y by height / 1024 (``to_pixels``). The program constrains generation with the
regex of that answer (``detection_regex``): the output always parses, whatever the model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import sglang as sgl
from PIL import Image

from sgl_embeds.vlm.paligemma import prompt_text
from sgl_embeds.vlm.prompt import image_prompt

LOC_BINS = 1024  # <loc0000> .. <loc1023>
SEPARATOR = " ; "  # between the groups of an answer, and between the labels of a prompt
# one location token, 0000 .. 1023 only
LOC = "<loc(?:0[0-9]{3}|10[01][0-9]|102[0-3])>"
_LOC_TOKEN = re.compile(r"<loc(\d{4})>")
_GROUP = re.compile(r"((?:<loc\d{4}>){4}) (.+)", re.DOTALL)

Box = tuple[int, int, int, int]  # (x0, y0, x1, y1) in pixels: sgl.region's box form


@dataclass(frozen=True)
class Detection:
    """One object of a detection answer: its label, its box in the image's pixels (``(x0, y0,
    x1, y1)``, as ``sgl.region`` takes it) and the model's four location bins (y_min, x_min,
    y_max, x_max, in 1024ths of its square input)."""

    label: str
    box: Box
    locs: tuple[int, int, int, int]


def detect_prompt(labels: Sequence[str]) -> str:
    """PaliGemma's prompt for ``labels``: ``"detect cat ; dog"``."""
    return "detect " + SEPARATOR.join(checked_labels(labels))


def label_regex(labels: Sequence[str]) -> str:
    """A regex matching exactly one of ``labels``."""
    return "(?:" + "|".join(re.escape(label) for label in checked_labels(labels)) + ")"


def detection_regex(labels: Sequence[str], max_objects: int = 4) -> str:
    """The answers PaliGemma gives to ``detect_prompt(labels)``: 1 to ``max_objects`` groups of
    four location tokens, a space and one of ``labels``, joined by ``" ; "``."""
    return repeated(f"(?:{LOC}){{4}} {label_regex(labels)}", max_objects)


def repeated(group: str, max_objects: int) -> str:
    """1 to ``max_objects`` of ``group``, joined by ``SEPARATOR`` (which holds no regex syntax)."""
    if max_objects < 1:
        raise ValueError(f"max_objects must be at least 1, got {max_objects}")
    more = f"(?:{SEPARATOR}{group}){{0,{max_objects - 1}}}" if max_objects > 1 else ""
    return group + more


def parse_locs(text: str) -> tuple[int, ...]:
    """The bins of a run of location tokens (``"<loc0012><loc1023>"`` -> ``(12, 1023)``); a bin past
    1023 or anything between the tokens raises ``ValueError``."""
    bins, end = [], 0
    for m in _LOC_TOKEN.finditer(text):
        if m.start() != end:
            raise ValueError(f"{text[end:m.start()]!r} between location tokens in {text!r}")
        value = int(m.group(1))
        if value >= LOC_BINS:
            raise ValueError(f"location token {m.group(0)} is past <loc{LOC_BINS - 1:04d}>")
        bins.append(value)
        end = m.end()
    if end != len(text):
        raise ValueError(f"{text[end:]!r} after the location tokens in {text!r}: expected "
                         "only <locNNNN> tokens")
    return tuple(bins)


def loc_tokens(bins: Sequence[int]) -> str:
    """The tokens of ``bins`` (inverse of ``parse_locs``)."""
    for b in bins:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < LOC_BINS:
            raise ValueError(f"a location bin is an int in [0, {LOC_BINS}), got {b!r}")
    return "".join(f"<loc{b:04d}>" for b in bins)


def to_pixels(locs: Sequence[int], width: int, height: int) -> Box:
    """``(y_min, x_min, y_max, x_max)`` bins as ``(x0, y0, x1, y1)`` pixels of a ``width`` x
    ``height`` image: the box spanned by the two corners (in either order: a trained model writes
    the min first, an untrained one under the regex may not), its min edges floored and its max
    edges ceiled, so that it covers every pixel the bins touch and at least one."""
    if width < 1 or height < 1:
        raise ValueError(f"the image must have a positive size, got {width}x{height}")
    ya, xa, yb, xb = locs

    def edges(a: int, b: int, size: int) -> tuple[int, int]:
        low = min(math.floor(min(a, b) * size / LOC_BINS), size - 1)
        return low, min(size, max(low + 1, math.ceil(max(a, b) * size / LOC_BINS)))

    (x0, x1), (y0, y1) = edges(xa, xb, width), edges(ya, yb, height)
    return x0, y0, x1, y1


def to_locs(box: Sequence[int], width: int, height: int) -> tuple[int, int, int, int]:
    """The bins (y_min, x_min, y_max, x_max) of a pixel box ``(x0, y0, x1, y1)``: the first bin
    at or past each min edge, the last bin at or before each max edge (at most 1023), so that
    ``to_pixels`` gives the box back exactly on images under 1024 pixels a side (a bin finer
    than a pixel; on larger ones, to within a bin)."""
    x0, y0, x1, y1 = box
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise ValueError(f"box {tuple(box)} is not (x0, y0, x1, y1) with an area inside a "
                         f"{width}x{height} image")

    def low(v: int, size: int) -> int:
        return min(LOC_BINS - 1, math.ceil(v * LOC_BINS / size))

    def high(v: int, size: int) -> int:
        return min(LOC_BINS - 1, math.floor(v * LOC_BINS / size))

    return low(y0, height), low(x0, width), high(y1, height), high(x1, width)


def parse_detections(text: str, width: int, height: int) -> list[Detection]:
    """The objects of a detection answer about a ``width`` x ``height`` image (an empty answer:
    none); a malformed group raises ``ValueError`` naming it."""
    if not text.strip():
        return []
    out = []
    for i, group in enumerate(text.split(SEPARATOR)):
        m = _GROUP.fullmatch(group)
        if m is None:
            raise ValueError(f"group {i} of the answer, {group!r}, is not four <locNNNN> tokens, "
                             "a space and a label")
        label = m.group(2).strip()
        if not label:
            raise ValueError(f"group {i} of the answer, {group!r}, has no label")
        try:
            locs = parse_locs(m.group(1))
        except ValueError as e:
            raise ValueError(f"group {i} of the answer, {group!r}: {e}") from None
        out.append(Detection(label, to_pixels(locs, width, height), locs))
    return out


def format_detections(detections: Sequence[Detection]) -> str:
    """The answer that lists ``detections`` (by their bins): ``parse_detections`` inverts it."""
    return SEPARATOR.join(f"{loc_tokens(d.locs)} {d.label}" for d in detections)


def checked_labels(labels: Sequence[str]) -> list[str]:
    """``labels`` as a list, each checked to be a name the answer's grammar can hold."""
    if isinstance(labels, str):
        raise ValueError(f"labels is a list of names, got the string {labels!r}")
    labels = list(labels)
    if not labels:
        raise ValueError("labels is empty: name at least one thing to look for")
    for label in labels:
        if not label.strip() or label != label.strip() or ";" in label or "<" in label:
            raise ValueError(f"label {label!r}: a label is a non-empty name without surrounding "
                             "spaces, ';' or '<'")
    return labels


@sgl.function
def detect(s, image, labels: Sequence[str], bos_token: str, max_objects: int = 4,
           max_tokens: int = 64):
    """Ask a PaliGemma endpoint (``sgl_embeds.connect``) to detect ``labels`` in ``image`` (a PIL
    image, path or base64, or an ``sgl.region``); ``bos_token``: the checkpoint's
    (``backend.vision_encoder.bos_token``). The answer is ``s["answer"]``, held to
    ``detection_regex(labels, max_objects)`` so that it parses; ``max_tokens`` must cover
    ``max_objects`` groups. ``run_detect`` runs it and parses the answer."""
    s += image_prompt(prompt_text(detect_prompt(labels), bos_token), [image])
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0,
                 regex=detection_regex(labels, max_objects))


def run_detect(backend, image: Image.Image | str, labels: Sequence[str], max_objects: int = 4,
               max_tokens: int = 64) -> list[Detection]:
    """``detect`` of ``image`` (PIL or a path) on ``backend``, its answer parsed in the image's
    pixels."""
    image = Image.open(image) if isinstance(image, str) else image
    state = detect.run(image=image, labels=labels, bos_token=backend.vision_encoder.bos_token,
                       max_objects=max_objects, max_tokens=max_tokens, backend=backend)
    return parse_detections(state["answer"], image.width, image.height)
