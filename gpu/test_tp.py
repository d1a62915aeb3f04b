"""Tensor parallelism (--tp-size 2): the plugin is active in every TP rank. Needs 2 GPUs; SGLang
0.5.23's CPU path cannot run TP here (its communicator initialises NCCL), so this file is outside
the default test paths and runs from scripts/gpu_check.sh."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import LOGPROBS, OUTPUT_LOGPROBS, body, generate, reference_embeds, to_segments, with_other_spans  # noqa: E402
from sgl_embeds_testing import reference as ref  # noqa: E402
from sgl_embeds_testing.models import tiny_model_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_span_prompts_match_hf_and_cache():
    model = tiny_model_dir("llama")
    parts = ["the quick fox", torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * 0.05, " is"]
    with Server(model, extra_args=["--tp-size", "2"]) as s:
        first = generate(s, body(to_segments(parts), 8, **LOGPROBS))
        again = generate(s, body(to_segments(parts), 8, **OUTPUT_LOGPROBS))  # input logprobs bypass the cache
    # tokens and logprobs against HF, whose answer must change with the span
    ref.assert_matches_hf(first, model, reference_embeds(model, parts), 8, "tp2: ",
                          other_span_embeds=reference_embeds(model, with_other_spans(parts)))
    assert again["output_ids"] == first["output_ids"] and again["meta_info"]["cached_tokens"] >= 9
