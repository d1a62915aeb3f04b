"""Hypothesis strategies shared by the fuzzers (``unit/test_fuzz_wire.py``, ``server/test_fuzz_http.py``):
any JSON value, wire tensors well-formed or not, and whole prompts for a served model (text,
ids, spans with and without image and clip grids, spans by handle)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sgl_embeds_protocol.segments import (ATTENTION, BIDIRECTIONAL, CAUSAL, GRID_FIELDS, IMAGE_GRID, SECONDS_PER_STEP,
                                          TIMESTAMPS, VIDEO_GRID)

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))
scalars = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=5))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=40)
shapes = st.one_of(st.lists(st.integers(-5, 2**40), min_size=0, max_size=4), json_values)
datas = st.one_of(st.binary(max_size=256).map(lambda b: base64.b64encode(b).decode()), st.text(max_size=64), json_values)
binary_objects = st.fixed_dictionaries(
    {"data": datas, "dtype": st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int8", "float64", ""]), json_values), "shape": shapes},
    optional={"encoding": st.one_of(st.just("base64"), json_values), "extra": json_values},
)
rows = st.lists(st.lists(numbers, min_size=0, max_size=8), min_size=0, max_size=6)
payloads = st.one_of(binary_objects, rows, json_values)


# -- whole prompts for a served model, from what its /sgl_embeds/info says ---------------------
# Mostly of the right form (span width, t = 1 for an image, grid sides multiples of the merge size,
# the family's time field on a clip, the grid's row count, vision tokens around a grid span), so
# that the deepest checks are reached and some prompts are served; otherwise one thing wrong.

VISION_TEXT = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
WORDS = ("the", " red", " fox", " is", "\n")
HELD_ROWS = 4  # the rows of the span a fuzzed server holds by handle: a [1, 2m, 2m] image grid's
UNKNOWN_HANDLE = "span-" + "0" * 64
DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16)


def held_grid(merge: int) -> list[int]:
    """The image grid of ``HELD_ROWS`` rows at merge size ``merge``."""
    return [1, 2 * merge, 2 * merge]


# What a grid span gets wrong, one thing at a time (None: nothing), so that each check is reached
# rather than hidden behind another's refusal
FAULTS = (None, "time", "rows", None, "time", "rows", None, "time", "t", "side", "width")
TIME_NAMES = ([], [SECONDS_PER_STEP], [TIMESTAMPS], [SECONDS_PER_STEP, TIMESTAMPS])


def _spread(draw, choices):
    """One of ``choices``, near uniformly: the residue of a wide integer, where ``sampled_from``
    draws its first choices so often that a run of 100 prompts left whole faults unseen."""
    return choices[draw(st.integers(0, 2**20)) % len(choices)]


def _time_fields(draw, t: int, names: list[str], bad_values: bool) -> dict:
    """The time fields ``names`` of a clip of ``t`` steps: good values, or else bad ones (zero,
    negative or NaN seconds; a time per step too many or too few, or negative)."""
    fields = {}
    if SECONDS_PER_STEP in names:
        fields[SECONDS_PER_STEP] = draw(st.sampled_from([0.0, -1.0, float("nan")]) if bad_values else st.floats(0.1, 4))
    if TIMESTAMPS in names:
        times, t = st.floats(0, 20), max(t, 0)  # a grid's faulty t may be zero or negative
        fields[TIMESTAMPS] = draw(st.lists(times, min_size=t + 1, max_size=t + 2) | st.lists(times, max_size=max(t - 1, 0))
                                  | st.just([-1.0] * t) if bad_values else st.lists(times, min_size=t, max_size=t))
    return fields


def _rows(draw, n: int, width: int) -> torch.Tensor:
    """``n`` random rows of ``width`` at the tiny models' scale, in a drawn wire dtype."""
    seed = draw(st.integers(0, 2**16))
    return (torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 0.05).to(draw(st.sampled_from(DTYPES)))


@st.composite
def grid_spans(draw, info: dict) -> dict:
    """A span segment (rows a tensor) with an image grid, a clip grid (with its time fields) or
    none, right or with one fault: t > 1 image grids, zeros and negatives, wrong row counts, time
    fields missing, foreign or of bad values, another width."""
    vision = info["vision"]
    merge = vision["merge_size"] if vision else 2
    kind = _spread(draw, ["clip", "image", "clip", "plain"] if vision else ["plain", "image", "plain", "clip"])
    fault = _spread(draw, FAULTS)
    t = 1 if kind == "image" else draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 3)) * merge, draw(st.integers(1, 3)) * merge
    if fault == "t":
        t = draw(st.sampled_from([0, -1, 2 if kind == "image" else -2]))
    elif fault == "side":
        h = draw(st.sampled_from([0, -merge, merge + 1]))
    right = max(1, t * h * w // merge**2) if kind != "plain" else draw(st.integers(1, 12))
    fields: dict = {} if kind == "plain" else {IMAGE_GRID if kind == "image" else VIDEO_GRID: [t, h, w]}
    wanted = vision["video_time"] if vision and kind == "clip" else None
    names = [wanted] if wanted else []
    if fault == "time":  # the family's own fields of bad values as often as all the wrong fields
        others = [other for other in TIME_NAMES if other != names]
        names = _spread(draw, others + [names] * len(others))
    fields.update(_time_fields(draw, t, names, bad_values=fault == "time" and names == ([wanted] if wanted else [])))
    n = draw(st.integers(0, 30).filter(lambda k: k != right)) if fault == "rows" else right
    width = info["span_width"]
    if fault == "width":
        width = draw(st.sampled_from([width + 1, info["hidden_size"] if info["hidden_size"] != width else width - 1]))
    return {"type": "embeds", "embeds": _rows(draw, n, width), **fields}


# a span's attention: often bidirectional (a served block needs the prompt's other spans served
# too: a held handle, no grid), some unsaid or causal, some of a bad value. A natively
# served VLM refuses a block (tests/server/test_bidirectional_spans.py), so its spans are drawn
# without one and its fuzzing keeps reaching its images and clips
ATTENTIONS = [None, None, CAUSAL, BIDIRECTIONAL, BIDIRECTIONAL, BIDIRECTIONAL, "sideways", 1]


def attended(spans, attentions: list):
    """``spans`` with an ``attention`` field drawn from ``attentions`` (none where unsaid)."""
    return st.tuples(spans, st.integers(0, 2**20)).map(
        lambda pair: _with_attention(pair[0], attentions[pair[1] % len(attentions)]))


def _with_attention(span: dict, attention) -> dict:
    return span if attention is None else {**span, ATTENTION: attention}


def held_spans(info: dict, handle: str):
    """A span by handle: the one the server holds (with its image grid or none) or an unknown one."""
    merge = info["vision"]["merge_size"] if info["vision"] else 2
    return st.builds(lambda h, grid: {"type": "embeds", "embeds": {"handle": h}, **grid},
                     st.sampled_from([handle, handle, UNKNOWN_HANDLE]),
                     st.sampled_from([{IMAGE_GRID: held_grid(merge)}, {}]))


def prompts(info: dict, handle: str):
    """Segment lists (span rows as tensors): random interleavings of text (vision tokens as text
    included), ids (the vision start, end and pad ids included, and ids out of the vocabulary),
    spans, held spans, and spans between the vision tokens as a chat template writes them."""
    vocab, vision = info["vocab_size"], info["vision"]
    special = [vision[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                   "video_token_id")] if vision else []
    one_id = st.integers(0, vocab - 1) | st.integers(0, vocab - 1) | st.sampled_from(special or [0]) | st.sampled_from([vocab, -1])
    words = st.lists(st.sampled_from(WORDS + WORDS + VISION_TEXT), min_size=1, max_size=3).map("".join)
    text = words.map(lambda t: {"type": "text", "text": t})
    ids = st.lists(one_id, min_size=1, max_size=3).map(lambda i: {"type": "input_ids", "input_ids": i})
    span = grid_spans(info) | held_spans(info, handle)
    span = span if vision else attended(span, ATTENTIONS)
    start_id, end_id = (special[:2] if vision else [0, 0])
    opening = (st.lists(st.sampled_from(WORDS), max_size=2).map(lambda w: {"type": "text", "text": "".join(w) + VISION_TEXT[0]})
               | st.just({"type": "input_ids", "input_ids": [start_id]}))
    closing = (st.lists(st.sampled_from(WORDS), max_size=2).map(lambda w: {"type": "text", "text": VISION_TEXT[1] + "".join(w)})
               | st.just({"type": "input_ids", "input_ids": [end_id]}))
    framed = st.tuples(opening, span, closing).map(list)
    unit = framed | text.map(lambda s: [s]) | framed | ids.map(lambda s: [s]) | framed | span.map(lambda s: [s])
    return st.lists(unit, min_size=1, max_size=3).map(lambda units: [s for u in units for s in u])


# -- prompts with their verdict: built valid, or with one fault and the refusal that names it ---
# A valid prompt is text (no vision text), ids of the vocabulary (no vision ids) and spans of the
# served form: on an M-RoPE VLM each an image or clip of the right rows and time between the vision
# tokens; elsewhere spans without a grid, attended either way. A faulty one is a valid one with
# exactly one thing wrong. ``Verdict.refusal``: a phrase the 400 must hold (None: a 200).


@dataclass(frozen=True)
class Verdict:
    fault: str | None
    refusal: str | None


VALID = Verdict(None, None)
# fault -> a phrase of the refusal that names it (sgl_embeds_protocol.segments, wire,
# sgl_embeds_srt.image_spans, prompts, parse)
VLM_FAULTS = {
    "grid rows": "rows (merge size",
    "image t = 2": "an image's grid has t = 1",
    "grid t = 0": "of positive ints",
    "grid side": "multiples of the merge size",
    "time on an image": "are a clip's time",
    "no vision start": "must follow the vision-start token",
    "no vision end": "must be followed by the vision-end token",
    "pad as text": "outside a grid span",
    "span without a grid": "give the span its",
    "block": "attends its image rows as its own model does",
    "width": "an image span of this model",  # and the width it takes: [n, hidden x (1 + deepstack layers)]
}
CLIP_TIME_FAULTS = {"clip without its time": "a clip on ", "bad seconds": "a finite number of seconds",
                    "bad timestamps": "one time in seconds"}
COMMON_FAULTS = {
    "unknown handle": "unknown span handle",
    "id out of vocabulary": "outside the vocabulary",
    "negative id": "must be a list of non-negative ints",
    "width": "hidden size",
    "not finite": "NaN or Inf",
    "attention value": "attention must be",
}
FLAT_FAULTS = {"grid on a 1-D model": "are for VLMs served natively with M-RoPE"}


def faults_of(info: dict) -> dict[str, str]:
    """The faults a prompt for this server may be built with, and the phrase of each refusal."""
    vision = info["vision"]
    if vision is None:
        return {**COMMON_FAULTS, **FLAT_FAULTS}
    clip_time = {}
    if vision["video_time"] is not None:
        bad_time = "bad seconds" if vision["video_time"] == SECONDS_PER_STEP else "bad timestamps"
        clip_time = {fault: CLIP_TIME_FAULTS[fault] for fault in ("clip without its time", bad_time)}
    return {**COMMON_FAULTS, **VLM_FAULTS, **clip_time}  # VLM_FAULTS' "width" phrase replaces COMMON_FAULTS'


@st.composite
def judged_prompts(draw, info: dict, handle: str, fault: str | None) -> tuple[list[dict], Verdict]:
    """A prompt built valid (``fault`` None), or valid but for ``fault`` (one of ``faults_of``),
    with its ``Verdict``; each prompt holds a span. Units: text, ids, and spans (on a VLM framed
    by the vision tokens as text or ids)."""
    vocab, vision, width = info["vocab_size"], info["vision"], info["span_width"]
    special = {vision[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                   "video_token_id")} if vision else set()
    merge = vision["merge_size"] if vision else 2

    def text() -> dict:
        return {"type": "text", "text": "".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)))}

    def ids() -> dict:
        pick = st.integers(0, vocab - 1).filter(lambda i: i not in special)
        return {"type": "input_ids", "input_ids": draw(st.lists(pick, min_size=1, max_size=3))}

    def span() -> dict:
        if draw(st.integers(0, 3)) == 0:  # the span the server holds
            return {"type": "embeds", "embeds": {"handle": handle}, **({IMAGE_GRID: held_grid(merge)} if vision else {})}
        if vision is None:
            attention = _spread(draw, [None, CAUSAL, BIDIRECTIONAL])
            return _with_attention({"type": "embeds", "embeds": _rows(draw, draw(st.integers(1, 8)), width)}, attention)
        clip = draw(st.booleans())
        t = draw(st.integers(1, 3)) if clip else 1
        h, w = draw(st.integers(1, 3)) * merge, draw(st.integers(1, 3)) * merge
        fields = {VIDEO_GRID if clip else IMAGE_GRID: [t, h, w]}
        if clip and vision["video_time"]:
            fields.update(_time_fields(draw, t, [vision["video_time"]], bad_values=False))
        return {"type": "embeds", "embeds": _rows(draw, t * h * w // merge**2, width), **fields}

    def framed() -> list[dict]:
        if vision is None:
            return [span()]
        as_ids = draw(st.booleans())
        opening = ({"type": "input_ids", "input_ids": [vision["vision_start_token_id"]]} if as_ids
                   else {"type": "text", "text": draw(st.sampled_from(WORDS)) + VISION_TEXT[0]})
        closing = ({"type": "input_ids", "input_ids": [vision["vision_end_token_id"]]} if as_ids
                   else {"type": "text", "text": VISION_TEXT[1] + draw(st.sampled_from(WORDS))})
        return [opening, span(), closing]

    units = draw(st.lists(st.sampled_from(["text", "ids", "span"]), max_size=3))
    units.insert(draw(st.integers(0, len(units))), "span")
    built = [framed() if u == "span" else [text() if u == "text" else ids()] for u in units]
    if fault is None:
        return [s for unit in built for s in unit], VALID
    spans = [unit for unit in built if any(s["type"] == "embeds" for s in unit)]
    unit = spans[draw(st.integers(0, len(spans) - 1))]
    _break(draw, fault, unit, built, info)
    return [s for unit in built for s in unit], Verdict(fault, faults_of(info)[fault])


def _break(draw, fault: str, unit: list[dict], built: list[list[dict]], info: dict) -> None:
    """Give the prompt ``built`` the one ``fault`` (at ``unit``, one of its spans with its framing)."""
    vision, width = info["vision"], info["span_width"]
    merge = vision["merge_size"] if vision else 2
    i = next(k for k, s in enumerate(unit) if s["type"] == "embeds")
    span = unit[i]
    inline = not isinstance(span["embeds"], dict)
    n = span["embeds"].shape[0] if inline else HELD_ROWS
    grid_name = VIDEO_GRID if VIDEO_GRID in span else IMAGE_GRID
    if fault == "grid rows":
        rows = span["embeds"] if inline else _rows(draw, n, width)
        unit[i] = {**span, "embeds": rows[: n - 1] if n > 1 else torch.cat([rows, rows])}
    elif fault in ("image t = 2", "time on an image"):
        t, h, w = span.get(grid_name)
        base = {k: v for k, v in span.items() if k not in GRID_FIELDS}
        if fault == "image t = 2":
            unit[i] = {**base, "embeds": _rows(draw, 2 * h * w // merge**2, width), IMAGE_GRID: [2, h, w]}
        else:
            unit[i] = {**base, "embeds": _rows(draw, h * w // merge**2, width), IMAGE_GRID: [1, h, w],
                       SECONDS_PER_STEP: 1.0}
    elif fault == "grid t = 0":
        unit[i] = {**span, grid_name: [0, *span[grid_name][1:]]}
    elif fault == "grid side":
        unit[i] = {**span, grid_name: [span[grid_name][0], merge + 1, span[grid_name][2]]}
    elif fault == "no vision start":
        del unit[0]
    elif fault == "no vision end":
        del unit[-1]
    elif fault == "pad as text":
        built.insert(draw(st.integers(0, len(built))), [{"type": "text", "text": "the" + VISION_TEXT[2]}])
    elif fault == "span without a grid":
        unit[i] = {k: v for k, v in span.items() if k not in GRID_FIELDS}
    elif fault in ("block", "attention value"):
        unit[i] = {**span, ATTENTION: BIDIRECTIONAL if fault == "block" else draw(st.sampled_from(["sideways", 1]))}
    elif fault in ("clip without its time", "bad seconds", "bad timestamps"):
        t, h, w = span.get(grid_name)
        plain = {k: v for k, v in span.items() if k not in GRID_FIELDS}
        time = {}  # bad values JSON can carry (a NaN in JSON is a malformed body: fuzzed above)
        if fault == "bad seconds":
            time = {SECONDS_PER_STEP: draw(st.sampled_from([0.0, -1.0]))}
        elif fault == "bad timestamps":
            time = {TIMESTAMPS: draw(st.sampled_from([[0.5] * (t + 1), [0.5] * (t - 1), [-1.0] * t]))}
        unit[i] = {**plain, "embeds": _rows(draw, t * h * w // merge**2, width), VIDEO_GRID: [t, h, w], **time}
    elif fault == "unknown handle":
        unit[i] = {**span, "embeds": {"handle": UNKNOWN_HANDLE}}
    elif fault in ("id out of vocabulary", "negative id"):
        wrong = st.sampled_from([info["vocab_size"], info["vocab_size"] + 7] if fault == "id out of vocabulary" else [-1, -7])
        built.insert(draw(st.integers(0, len(built))), [{"type": "input_ids", "input_ids": [draw(wrong)]}])
    elif fault == "width":
        unit[i] = {**span, "embeds": _rows(draw, n, draw(st.sampled_from([width + 1, width - 1])))}
    elif fault == "not finite":
        rows = (span["embeds"] if inline else _rows(draw, n, width)).clone()
        rows[draw(st.integers(0, n - 1)), draw(st.integers(0, width - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
        unit[i] = {**span, "embeds": rows}
    elif fault == "grid on a 1-D model":
        unit[i] = {**span, IMAGE_GRID: [1, 2, 2]}
    else:
        raise AssertionError(f"no such fault {fault!r}")
