"""Runs span prompts through an in-process ``sglang.Engine`` and prints the results as JSON:
``engine_probe.py MODEL`` (text spans) or ``engine_probe.py QWEN_VL_MODEL ROWS_MODEL PROMPT
[QWEN_VL_MODEL ROWS_MODEL PROMPT ...]`` (image spans with grids on one engine after another, each
result under its ROWS_MODEL's family; PROMPT holds one ``IMAGE_PLACEHOLDER``).

A separate process on purpose: ``Engine.shutdown()`` kills every child process of its caller,
which inside pytest would include the shared test servers. ``test_engine_inprocess.py`` runs
this script and checks what it prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from helpers import OUTPUT_LOGPROBS, seeded_rows as rows
from sgl_embeds_testing.server import engine as make_engine


def main(model_dir: str) -> dict:
    eng = make_engine(model_dir)
    out: dict = {}
    try:
        segments = [{"type": "text", "text": "the small dog"}, {"type": "embeds", "embeds": rows(11, 7)}, {"type": "text", "text": " is"}]
        sp = {"temperature": 0, "max_new_tokens": 10}
        first = eng.generate(input_segments=segments, sampling_params=sp, **OUTPUT_LOGPROBS)
        again = eng.generate(input_segments=segments, sampling_params=sp)
        numbers = {k: first["meta_info"][k] for k in ("output_token_logprobs", "output_top_logprobs")}
        out["segments"] = {"ids": first["output_ids"], "again_ids": again["output_ids"], "meta_info": numbers,
                           "cached": again["meta_info"]["cached_tokens"], "prompt": again["meta_info"]["prompt_tokens"]}
        sp6 = {"temperature": 0, "max_new_tokens": 6}
        batch = eng.generate(input_embeds=[rows(1, 6), rows(2, 6)], sampling_params=sp6)
        out["batch"] = [b["output_ids"] for b in batch]
        chunks = list(eng.generate(input_embeds=rows(1, 6), sampling_params=sp6, stream=True))
        out["stream"] = {"chunks": len(chunks), "completion": chunks[-1]["meta_info"]["completion_tokens"]}
        errors = []
        for bad in (torch.zeros(2, 3), torch.full((2, 64), float("nan"))):
            try:
                eng.generate(input_embeds=bad, sampling_params={"max_new_tokens": 1})
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        for bad_ids in ([1, 2, 10**6], [1, -2], [[1], [2**62 + 5]]):  # out of the vocabulary, plain or batched
            try:
                eng.generate(input_ids=bad_ids, sampling_params={"max_new_tokens": 1})
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        out["errors"] = errors
        out["after_errors"] = len(eng.generate(prompt="the red fox", sampling_params={"temperature": 0, "max_new_tokens": 3})["output_ids"])
    finally:
        eng.shutdown()
    return out


def _family(model_dir: str) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


# the clip main_qwen_vl sends, by family: sample_clip(frames, width, height, seed=...) at fps
# (the sizes and seeds of qwen_vl_harness.CLIP_FAMILIES); at 4 fps a step is 0.5 s, not the 1 s
# SGLang assumes without the field (so dropping it changes the answer)
CLIPS = {"qwen2_5_vl": (4, 224, 56, 1, 4.0), "qwen3_vl": (4, 128, 64, 1, 4.0), "qwen2_vl": (4, 224, 56, 7, 4.0)}


def main_qwen_vl(model_dir: str, rows_dir: str, prompt: str) -> dict:
    """Image spans and a clip's (rows with their grid, as tensors) in ``prompt`` on a Qwen-VL
    engine over ``model_dir``; the rows come from HF's vision module on ``rows_dir``'s weights
    (the clip: the family's ``CLIPS`` of ``sample_clip``)."""
    from sgl_embeds_testing.qwen_vl import (  # HF's model: only this probe needs it
        IMAGE_PLACEHOLDER, VISION_END, VISION_START, clip_rows, image_rows, sample_clip, sample_images)

    eng = make_engine(model_dir, enable_multimodal=True, mm_attention_backend="sdpa",
                      chunked_prefill_size=8, enable_cache_report=True)
    out: dict = {}
    try:
        sp = {"temperature": 0, "max_new_tokens": 10}
        before, after = prompt.split(IMAGE_PLACEHOLDER)
        spans = {name: image_rows(rows_dir, sample_images()[name]) for name in ("stripes", "disc")}
        spans = {name: (rows, {"image_grid_thw": list(grid)}) for name, (rows, grid) in spans.items()}
        frames, width, height, seed, fps = CLIPS[_family(rows_dir)]
        spans["clip"] = clip_rows(rows_dir, sample_clip(frames, width, height, seed=seed), fps)
        for name, (rows, grid) in spans.items():
            segments = [{"type": "text", "text": before + VISION_START}, {"type": "embeds", "embeds": rows, **grid},
                        {"type": "text", "text": VISION_END + after}]
            first = eng.generate(input_segments=segments, sampling_params=sp, **OUTPUT_LOGPROBS)
            again = eng.generate(input_segments=segments, sampling_params=sp)
            numbers = {k: first["meta_info"][k] for k in ("output_token_logprobs", "output_top_logprobs")}
            out[name] = {"ids": first["output_ids"], "again_ids": again["output_ids"], "meta_info": numbers,
                         "cached": again["meta_info"]["cached_tokens"], "prompt": again["meta_info"]["prompt_tokens"]}
        rows = spans["disc"][0]
        try:
            eng.generate(input_segments=[{"type": "text", "text": before + VISION_START},
                                         {"type": "embeds", "embeds": rows, "image_grid_thw": [1, 2, 2]}],
                         sampling_params=sp)
            out["bad_grid"] = None
        except ValueError as e:
            out["bad_grid"] = str(e)
    finally:
        eng.shutdown()
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2:  # each family asked, one engine after another
        triples = [sys.argv[i:i + 3] for i in range(1, len(sys.argv), 3)]
        print(json.dumps({_family(rows_dir): main_qwen_vl(model_dir, rows_dir, prompt)
                          for model_dir, rows_dir, prompt in triples}))
    else:
        print(json.dumps(main(sys.argv[1])))
