"""Bidirectional blocks on the GPU backends, where a GPU is lent (scripts/gpu_check.sh): Triton's
extend kernel and FlashInfer's paged prefill wrapper with our masks against the dense reference,
and a server on each backend against HF run with the same 4-D mask (tests/unit/test_gpu_block_masks.py
checks what the CPU can: the masks' layout, Triton's kernel in its interpreter, FlashInfer's plans)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import OUTPUT_LOGPROBS, body, generate, reference_embeds  # noqa: E402
from sgl_embeds_testing import reference as ref  # noqa: E402
from sgl_embeds_testing import kernel_masks  # noqa: E402
from sgl_embeds_testing.models import tiny_model_dir  # noqa: E402
from sgl_embeds_testing.server import Server  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("case", list(kernel_masks.CASES))
def test_tritons_kernel_on_the_gpu_with_our_mask(case):
    """As tests/unit/test_gpu_block_masks.py in Triton's interpreter: a full layer of a model whose
    blocks hold on its sliding layers only is causal, so there the blocks on every layer differ."""
    wrong = "hooked_every_layer" if case == "sliding_only_full_layer" else "no_mask"
    worst = {how: kernel_masks.triton(kernel_masks.CASES[case], how, device="cuda") for how in ("hooked", wrong)}
    assert worst["hooked"] < 1e-3 < worst[wrong], worst


# FlashInfer plans one mask for all layers: blocks on the sliding layers only are refused there
@pytest.mark.parametrize("case", [name for name, case in kernel_masks.CASES.items() if not case.get("sliding_only")])
def test_flashinfers_paged_wrapper_with_our_mask(case):
    pytest.importorskip("flashinfer")
    assert kernel_masks.flashinfer(kernel_masks.CASES[case]) < 2e-2  # float16 against float32


@pytest.mark.parametrize("backend, dtype", [("triton", torch.float32), ("flashinfer", torch.bfloat16)])
def test_a_server_on_a_gpu_backend_attends_blocks_as_hf(backend, dtype):
    """Tokens and logprobs as HF's run in the same dtype with the same mask (FlashInfer runs no
    float32), at a chunk size that would cut the blocks; HF's causal answer differs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
    from test_bidirectional_spans import MAX_TOKENS, PROMPTS, _blocks, _segments

    model = tiny_model_dir("llama")
    with Server(model, extra_args=["--attention-backend", backend, "--dtype", str(dtype).split(".")[1],
                                   "--chunked-prefill-size", "8"]) as server:
        for name, parts in PROMPTS.items():
            out = generate(server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
            embeds = reference_embeds(model, parts)
            expected = ref.assert_matches_hf(out, model, embeds, MAX_TOKENS, f"{backend}, {name}: ",
                                             dtype=dtype, blocks=_blocks(model, parts))
            assert ref.greedy_after(model, embeds, MAX_TOKENS, dtype=dtype).tokens != expected.tokens
