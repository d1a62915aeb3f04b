"""Florence-2's own tasks on a Florence-2 endpoint (``sgl_embeds.connect``: the checkpoint's DaViT
tower and projector on the client, its BART on the server): detection, OCR with regions, a region's
description, phrase grounding, each answer parsed by the checkpoint's own post-processor into the
image's pixels. They call ``backend.run`` rather than ``sgl.gen``: Florence-2 writes its boxes as
``<loc_N>`` tokens, which a checkpoint's tokenizer may hold as special tokens, and a program's
``gen`` cannot ask for them to be kept (``skip_special_tokens=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image


# one to three labelled boxes, as <OD> answers them: a label, then its four <loc_N> corners
BOXES = r"(?:[a-z][a-z ]{0,15}(?:<loc_(?:[0-9]|[1-9][0-9]{1,2})>){4}){1,3}"


@dataclass(frozen=True)
class TaskAnswer:
    """A task's answer: its text as generated (special tokens kept), its token ids, and what the
    checkpoint's post-processor parses from it (``{task: ...}``: boxes in the image's pixels)."""

    text: str
    ids: list[int]
    parsed: dict[str, Any]


def run_task(backend, image: Image.Image | str, task: str, text_input: str | None = None,
             max_tokens: int = 256, regex: str | None = None, **fields: Any) -> TaskAnswer:
    """``task`` (``"<OD>"``, ``"<OCR_WITH_REGION>"``, ``"<CAPTION>"`` ...) about ``image`` (PIL or
    a path), greedy; ``text_input``: the input a task reads (a phrase, or a region's ``<loc_N>``
    tokens: ``describe_region``); ``regex``: the answer held to it (``BOXES``: labelled boxes);
    ``fields``: more ``/generate`` fields (``return_logprob``)."""
    image = Image.open(image).convert("RGB") if isinstance(image, str) else image
    encoder = backend.vision_encoder
    segments = encoder.prompt_segments(encoder(image), task, text_input)
    sampling = {"temperature": 0, "max_new_tokens": max_tokens, "skip_special_tokens": False}
    out = backend.run(input_segments=segments, sampling_params={**sampling, **({"regex": regex} if regex else {})},
                      **fields)
    return TaskAnswer(out["text"], out["output_ids"], encoder.parse_answer(out["text"], task, image.size))


def detect_objects(backend, image: Image.Image, max_tokens: int = 256) -> list[tuple[str, list[float]]]:
    """``<OD>``: (label, (x0, y0, x1, y1) in pixels) of each object Florence-2 names."""
    found = run_task(backend, image, "<OD>", max_tokens=max_tokens).parsed["<OD>"]
    return list(zip(found["labels"], found["bboxes"]))


def read_text_with_regions(backend, image: Image.Image, max_tokens: int = 256) -> list[tuple[str, list[float]]]:
    """``<OCR_WITH_REGION>``: (text, its quadrilateral's 8 pixel coordinates) of each line."""
    found = run_task(backend, image, "<OCR_WITH_REGION>", max_tokens=max_tokens).parsed["<OCR_WITH_REGION>"]
    return list(zip(found["labels"], found["quad_boxes"]))


def describe_region(backend, image: Image.Image, box: Sequence[float], max_tokens: int = 64) -> str:
    """``<REGION_TO_DESCRIPTION>`` of ``box`` (pixels as ints, or fractions as floats), the region
    written as the four ``<loc_N>`` tokens the model was trained on (the whole image stays the
    encoder's input; ``sgl.region`` would give it the crop instead)."""
    region = backend.vision_encoder.region_input(box, image.width, image.height)
    return run_task(backend, image, "<REGION_TO_DESCRIPTION>", region, max_tokens).parsed["<REGION_TO_DESCRIPTION>"]


def ground_phrases(backend, image: Image.Image, caption: str, max_tokens: int = 256) -> list[tuple[str, list[float]]]:
    """``<CAPTION_TO_PHRASE_GROUNDING>``: (phrase, box in pixels) for the phrases of ``caption``."""
    task = "<CAPTION_TO_PHRASE_GROUNDING>"
    found = run_task(backend, image, task, caption, max_tokens).parsed[task]
    return list(zip(found["labels"], found["bboxes"]))
