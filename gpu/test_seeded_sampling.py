"""Seeded sampling with spans. SGLang honours a per-request ``sampling_seed`` only with
``--enable-deterministic-inference``, which needs a GPU attention backend (fa3, flashinfer,
triton), so this runs from scripts/gpu_check.sh, not in the CPU suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import generate, span, text  # noqa: E402
from sgl_embeds_testing.models import tiny_model_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU attention backend")
def test_seeded_sampling_is_reproducible_and_seed_dependent():
    parts = [text("the red fox"), span(torch.randn(6, 64, generator=torch.Generator().manual_seed(9)) * 0.05), text(" near")]
    with Server(tiny_model_dir("llama"), extra_args=["--enable-deterministic-inference", "--attention-backend", "triton"]) as s:
        def sample(seed):
            sp = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": seed}
            return generate(s, {"input_segments": parts, "sampling_params": sp})["output_ids"]

        assert sample(7) == sample(7)
        assert len({tuple(sample(k)) for k in range(5)}) > 1
