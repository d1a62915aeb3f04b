"""The FLOP counts behind ``benchmarks/vlm_workload_at_gpu_scale.py``: a position's prefill and an
image's tower cost two FLOPs per weight of a Qwen2.5-VL checkpoint (its matrices, counted from the
file) whose config ``Sizes.from_config`` read, so the estimate counts what a model of those sizes
computes."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
