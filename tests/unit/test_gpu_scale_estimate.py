"""``benchmarks/vlm_workload_at_gpu_scale.py``: its FLOP counts (a position's prefill and an image's
tower cost two FLOPs per weight of a Qwen2.5-VL checkpoint whose config ``Sizes.from_config``
read, so the estimate counts what a model of those sizes computes), and its bound (the slowest
stage, host stages in it; a ratio known as a range concludes only when both ends agree)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from sgl_embeds_testing.qwen_vl import tiny_qwen2_5_vl_dir

import vlm_workload_at_gpu_scale as gpu_scale  # benchmarks/ (pyproject: pythonpath)


def _matrix_weights(model_dir: Path, prefix: str) -> int:
    """The checkpoint's matrix (and convolution) weights under ``prefix``: what a FLOP count
    multiplies by (norms and biases left out)."""
    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                if key.startswith(prefix) and key.endswith(".weight"):
                    shape = f.get_slice(key).get_shape()
                    if len(shape) > 1:
                        total += math.prod(shape)
    return total


def test_flops_are_two_per_weight_of_a_checkpoint():
    model_dir = tiny_qwen2_5_vl_dir()  # the formula is the same at every size; this one is built already
    sizes = gpu_scale.Sizes.from_config(json.loads((model_dir / "config.json").read_text()))
    lm = _matrix_weights(model_dir, "model.layers.")
    # one position with no prefix: the weights alone (plus attention to itself)
    attention_to_itself = 4 * sizes.lm_layers * sizes.lm_heads * sizes.head_dim
    assert sizes.lm_flops(0, 1) - attention_to_itself == 2 * lm
    # a row of an image: its patches through every block and the patch embedding, then the merger
    blocks_and_embed = _matrix_weights(model_dir, "visual.blocks.") + _matrix_weights(model_dir, "visual.patch_embed.")
    merger = _matrix_weights(model_dir, "visual.merger.")
    no_attention = gpu_scale.Sizes(**{**sizes.__dict__, "tower_full_layers": 0, "window_patches": 0})
    assert no_attention.tower_flops(1) == 2 * (sizes.merge * blocks_and_embed + merger)


def _episode(stages: dict, prompt_tokens: int, cached_tokens: int, tower_rows: int) -> dict:
    """A one-turn episode of one image, as the benches record it."""
    return {"turns": 1, "stages_s": {"client tower": 0.0, "queue": 0.0, "prefill forward": 1.0, **stages},
            "answers": [{"item": {"image": 0}, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
                         "output_tokens": 8}],
            "tower_passes_per_item": 1.0, "client_tower_rows": tower_rows, "ttft_s": [1.0]}


def test_the_bound_is_the_slowest_stage_with_the_host_in_it():
    sizes = gpu_scale.QWEN2_5_VL_7B
    host = {"client request, less the tower": 0.010, "to the route": 0.020, "tokenize and return": 0.030,
            "request process": 0.001}
    rate = gpu_scale.GPU_FLOPS * gpu_scale.MFU
    one = gpu_scale.per_turn([_episode(host, 300, 0, 256)], "ours by handle", sizes, 256, 1.0)
    assert one["host_s"] == pytest.approx(sum(host.values()))
    assert one["prefill_s"] == sizes.lm_flops(0, 300) / rate and one["tower_s"] == sizes.tower_flops(256) / rate
    # at 7B on an H200 the tokenizer manager's 60 ms outweighs a few ms of device work
    assert one["bound_by"] == "tokenizer manager" and one["requests_per_s_bound"] == pytest.approx(1 / 0.060)
    # ours' request and trip grow with the rows' width; stock's do not
    wide = gpu_scale.per_turn([_episode(host, 300, 0, 256)], "ours by handle", sizes, 256, 3.5)
    assert wide["busy_s"]["tokenizer manager"] == pytest.approx((0.010 + 0.020) * 3.5 + 0.030)
    stock = gpu_scale.per_turn([_episode(host, 300, 0, 0)], "stock tuned", sizes, 256, 3.5)
    assert stock["busy_s"]["tokenizer manager"] == pytest.approx(0.060)
    assert stock["tower_s"] == one["tower_s"]  # stock's tower ran on the same new image
    # a host of nothing leaves the scheduler and the GPU to bound it
    idle = gpu_scale.per_turn([_episode(dict.fromkeys(host, 0.0), 300, 0, 256)], "ours by handle", sizes, 256, 1.0)
    assert idle["bound_by"] == "scheduler and GPU"


def test_a_ratio_known_as_a_range_concludes_only_when_both_ends_agree():
    assert gpu_scale.verdict(0.4, 0.8) == "below stock's"
    assert gpu_scale.verdict(1.1, 2.0) == "above stock's"
    assert gpu_scale.verdict(0.8, 1.2) == "not determined"
