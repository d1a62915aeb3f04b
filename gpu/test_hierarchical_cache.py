"""Spans with the hierarchical cache (``--enable-hierarchical-cache``: KV evicted from device
memory is kept in host memory and loaded back). SGLang's host pool registers pinned memory with
CUDA (``pool_host/common.py: _cuda_host_register``), so on CPU the server does not start
("Found no NVIDIA driver", measured on SGLang 0.5.23); this runs from scripts/gpu_check.sh."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import body, generate, seeded_rows, span, text  # noqa: E402
from sgl_embeds_testing.models import tiny_model_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hierarchical cache's host pool needs CUDA")
def test_a_span_evicted_to_host_memory_comes_back_as_a_hit_with_the_same_output():
    args = ["--enable-hierarchical-cache", "--enable-cache-report", "--max-total-tokens", "512", "--page-size", "1"]
    rows = seeded_rows(1, 100)
    prompt = [text("Look:"), span(rows), text(" what is it?")]
    with Server(tiny_model_dir("llama")) as plain:  # the reference: same prompt, no offloading
        expected = generate(plain, body(prompt, 8))["output_ids"]
    with Server(tiny_model_dir("llama"), extra_args=args) as s:
        first = generate(s, body(prompt, 8))
        for i in range(8):  # 1200 other positions through a 512-token device pool: the span is evicted
            generate(s, body([text(f"filler {i}"), span(seeded_rows(100 + i, 150))], 2))
        again = generate(s, body(prompt, 8))
    assert first["output_ids"] == again["output_ids"] == expected
    details = again["meta_info"].get("cached_tokens_details") or {}
    assert again["meta_info"]["cached_tokens"] >= 100, again["meta_info"]
    assert details.get("host", 0) > 0, f"the span should come back from host memory: {details}"
