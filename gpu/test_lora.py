"""Spans with LoRA (``--enable-lora``): two tiny adapters built here with PEFT; span prompts with a
per-request ``lora_path`` equal HF + PEFT (the adapter merged into the weights, float32, greedy),
and the radix cache never shares KV across adapters. SGLang's LoRA layers pin host memory with
CUDA (``lora/layers.py``: ``torch.tensor(..., pin_memory=True)``), so on CPU the server does not
start ("Found no NVIDIA driver", measured on SGLang 0.5.23 with ``--lora-backend torch_native``);
this runs from scripts/gpu_check.sh."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import body, generate, reference_embeds, seeded_rows, span, text  # noqa: E402
from sgl_embeds_testing import reference as ref  # noqa: E402
from sgl_embeds_testing.models import tiny_model_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402

TARGETS = ["q_proj", "v_proj"]


def _adapters(root: Path) -> dict[str, tuple[Path, Path]]:
    """name -> (adapter dir, merged model dir) for two random rank-4 adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_dir("llama")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                               LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
        gen = torch.Generator().manual_seed(seed)
        for pname, p in model.named_parameters():
            if "lora_" in pname:  # PEFT starts B at zero: make the adapter matter
                p.data = torch.randn(p.shape, generator=gen) * 0.2
        model.save_pretrained(root / name)
        merged = model.merge_and_unload()
        merged.save_pretrained(root / f"{name}-merged")
        AutoTokenizer.from_pretrained(base).save_pretrained(root / f"{name}-merged")
        out[name] = (root / name, root / f"{name}-merged")
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang's LoRA layers need CUDA (pinned memory)")
def test_span_prompts_with_two_adapters_equal_hf_peft_and_never_share_cache(tmp_path):
    adapters = _adapters(tmp_path)
    parts = ["Look:", seeded_rows(1, 10), " what is it?"]
    prompt = [text(parts[0]), span(parts[1]), text(parts[2])]
    args = ["--enable-lora", "--lora-paths", *(f"{n}={d}" for n, (d, _) in adapters.items()), "--max-lora-rank", "4",
            "--lora-target-modules", *TARGETS, "--max-loras-per-batch", "2", "--enable-cache-report"]
    with Server(tiny_model_dir("llama"), extra_args=args) as s:
        outs = {}
        for name in ("a", "b", "a"):
            out = generate(s, {**body(prompt, 8), "lora_path": name})
            if name in outs:  # the repeat hits its own adapter's cache
                assert out["meta_info"]["cached_tokens"] >= 10 and out["output_ids"] == outs[name]["output_ids"]
            else:  # never another adapter's KV: only what this adapter cached before (nothing)
                assert out["meta_info"]["cached_tokens"] == 0, (name, out["meta_info"])
            outs[name] = out
    for name, (_, merged) in adapters.items():
        ref.assert_matches_hf(outs[name]["output_ids"], merged, reference_embeds(merged, parts), 8, f"adapter {name}: ",
                              other_span_embeds=reference_embeds(merged, [parts[0], seeded_rows(2, 10), parts[2]]))
    assert outs["a"]["output_ids"] != outs["b"]["output_ids"]  # the adapters matter
