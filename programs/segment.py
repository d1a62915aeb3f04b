"""Referring segmentation as PaliGemma does it: ``segment cat`` answered with a box and 16 codes.

PaliGemma answers ``segment <label>`` with one group per object, joined by ``" ; "``: four location
tokens (the box, as in ``detect.py``), sixteen ``<segNNN>`` tokens (000 .. 127) and, after a
space, the label. The sixteen codes are a 4x4 grid of indices into the codebook of big_vision's
VQ-VAE for masks; ``masks`` decodes them with that model's decoder (``MaskDecoder``, from the
``vae-oid.npz`` you download: docs/vision-encoders.md, section 7) into each object's mask.
Generation is held to ``segmentation_regex``: the answer always parses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import sglang as sgl
import numpy as np
from PIL import Image

from programs.detect import (
    LOC, SEPARATOR, Box, checked_labels, label_regex, loc_tokens,
    repeated, parse_locs, to_pixels,
)
from sgl_embeds.vlm.paligemma import prompt_text
from sgl_embeds.vlm.paligemma_masks import MaskDecoder, mask_in_image
from sgl_embeds.vlm.prompt import image_prompt

SEG_CODES = 128  # <seg000> .. <seg127>
CODES_PER_MASK = 16  # a 4x4 grid
SEG = "<seg(?:0[0-9][0-9]|1[01][0-9]|12[0-7])>"  # one segmentation token, 000 .. 127 only
_SEG_TOKEN = re.compile(r"<seg(\d{3})>")
_GROUP = re.compile(r"((?:<loc\d{4}>){4})((?:<seg\d{3}>)*) (.+)", re.DOTALL)


@dataclass(frozen=True)
class Segmentation:
    """One object of a segmentation answer: its label, its box in the image's pixels (``(x0, y0,
    x1, y1)``, as ``sgl.region`` takes it), the model's four location bins (y_min, x_min, y_max,
    x_max in 1024ths) and its 16 mask codes (row-major over a 4x4 grid: the input of
    big_vision's VQ-VAE mask decoder: ``masks`` decodes them)."""

    label: str
    box: Box
    locs: tuple[int, int, int, int]
    codes: tuple[int, ...]


def segment_prompt(label: str) -> str:
    """PaliGemma's prompt: ``"segment cat"``."""
    (label,) = checked_labels([label])
    return "segment " + label


def segmentation_regex(labels: Sequence[str], max_objects: int = 1) -> str:
    """The answers to ``segment_prompt``: 1 to ``max_objects`` groups of four location tokens,
    sixteen segmentation tokens, a space and one of ``labels``, joined by ``" ; "``."""
    group = f"(?:{LOC}){{4}}(?:{SEG}){{{CODES_PER_MASK}}} {label_regex(labels)}"
    return repeated(group, max_objects)


def parse_codes(text: str) -> tuple[int, ...]:
    """The codes of exactly 16 ``<segNNN>`` tokens; anything else raises ``ValueError``."""
    codes, end = [], 0
    for m in _SEG_TOKEN.finditer(text):
        if m.start() != end:
            raise ValueError(f"{text[end:m.start()]!r} between segmentation tokens in {text!r}")
        value = int(m.group(1))
        if value >= SEG_CODES:
            raise ValueError(f"segmentation token {m.group(0)} is past <seg{SEG_CODES - 1:03d}>")
        codes.append(value)
        end = m.end()
    if end != len(text):
        raise ValueError(f"{text[end:]!r} after the segmentation tokens in {text!r}")
    if len(codes) != CODES_PER_MASK:
        raise ValueError(f"{len(codes)} segmentation tokens in {text!r}: a mask has "
                         f"{CODES_PER_MASK}")
    return tuple(codes)


def seg_tokens(codes: Sequence[int]) -> str:
    """The tokens of 16 ``codes`` (inverse of ``parse_codes``)."""
    if len(codes) != CODES_PER_MASK:
        raise ValueError(f"a mask has {CODES_PER_MASK} codes, got {len(codes)}")
    for c in codes:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < SEG_CODES:
            raise ValueError(f"a mask code is an int in [0, {SEG_CODES}), got {c!r}")
    return "".join(f"<seg{c:03d}>" for c in codes)


def parse_segmentations(text: str, width: int, height: int) -> list[Segmentation]:
    """The objects of a segmentation answer about a ``width`` x ``height`` image (an empty
    answer: none); a malformed group raises ``ValueError`` naming it."""
    if not text.strip():
        return []
    out = []
    for i, group in enumerate(text.split(SEPARATOR)):
        m = _GROUP.fullmatch(group)
        if m is None:
            raise ValueError(f"group {i} of the answer, {group!r}, is not four <locNNNN> "
                             "tokens, sixteen <segNNN> tokens, a space and a label")
        label = m.group(3).strip()
        if not label:
            raise ValueError(f"group {i} of the answer, {group!r}, has no label")
        try:
            locs = parse_locs(m.group(1))
            codes = parse_codes(m.group(2))
        except ValueError as e:
            raise ValueError(f"group {i} of the answer, {group!r}: {e}") from None
        out.append(Segmentation(label, to_pixels(locs, width, height), locs, codes))
    return out


def format_segmentations(segmentations: Sequence[Segmentation]) -> str:
    """The answer that lists ``segmentations``: ``parse_segmentations`` inverts it."""
    return SEPARATOR.join(f"{loc_tokens(s.locs)}{seg_tokens(s.codes)} {s.label}"
                          for s in segmentations)


@sgl.function
def segment(s, image, label: str, bos_token: str, max_objects: int = 1, max_tokens: int = 48):
    """Ask a PaliGemma endpoint to segment ``label`` in ``image`` (a PIL image, path or base64, or
    an ``sgl.region``); ``bos_token``: ``backend.vision_encoder.bos_token``. The answer is
    ``s["answer"]``, held to ``segmentation_regex([label], max_objects)``; ``run_segment`` runs
    it and parses the answer."""
    s += image_prompt(prompt_text(segment_prompt(label), bos_token), [image])
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0,
                 regex=segmentation_regex([label], max_objects))


def run_segment(backend, image: Image.Image | str, label: str, max_objects: int = 1,
                max_tokens: int = 48) -> list[Segmentation]:
    """``segment`` of ``image`` (PIL or a path) on ``backend``, its answer parsed in the image's
    pixels."""
    image = Image.open(image) if isinstance(image, str) else image
    state = segment.run(image=image, label=label, bos_token=backend.vision_encoder.bos_token,
                        max_objects=max_objects, max_tokens=max_tokens, backend=backend)
    return parse_segmentations(state["answer"], image.width, image.height)


def masks(segmentations: Sequence[Segmentation], decoder: MaskDecoder, width: int, height: int) -> list[np.ndarray]:
    """Each object's mask in the ``width`` x ``height`` image it was found in (``height`` x
    ``width`` bools), decoded from its codes and placed in its box."""
    if not segmentations:
        return []
    logits = decoder([s.codes for s in segmentations])
    return [mask_in_image(m, s.box, width, height) for m, s in zip(logits, segmentations)]
