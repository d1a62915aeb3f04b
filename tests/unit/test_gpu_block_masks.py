"""Bidirectional blocks on the GPU backends (``gpu_block_attention``), checked on the CPU: the mask's
layout against the dense one; Triton's own extend kernel run in Triton's interpreter with it;
FlashInfer's planning given each wrapper's mask (its kernels need CUDA: gpu/test_block_masks.py
runs them where a GPU is lent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_embeds_srt import gpu_block_attention as gpu
from sgl_embeds_srt.block_attention import allowed_keys
from sgl_embeds_srt.blocks import BLOCKS_ATTR
from sgl_embeds_testing import kernel_masks

HERE = Path(__file__).resolve().parent


def test_the_flat_mask_holds_each_request_row_by_row_from_its_first_key_read():
    prefixes, extends, blocks = [0, 5, 2], [6, 3, 4], [[(1, 4)], [], [(2, 6)]]
    mask, indptr = gpu.flat_mask(prefixes, extends, blocks, kv_starts=[0, 2, 1])
    assert mask.dtype == torch.bool and indptr.dtype == torch.int32
    assert indptr.tolist() == [0, 6 * 6, 36 + 3 * 6, 54 + 4 * 5]
    for i, (p, n, start) in enumerate(zip(prefixes, extends, [0, 2, 1])):
        part = mask[indptr[i]:indptr[i + 1]].view(n, p + n - start)
        assert torch.equal(part, allowed_keys(p, n, blocks[i])[:, start:])
    first = mask[:36].view(6, 6)
    assert first[1, 3] and first[3, 1] and not first[0, 1] and not first[4, 5], "both ways in the block only"


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE.parents[1] / "testing")])}
    done = subprocess.run([sys.executable, str(HERE / "triton_block_masks.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(kernel_masks.CASES))
def test_tritons_extend_kernel_with_our_mask_equals_the_dense_reference(interpreted, case):
    """Each case through our hook equals HF's attention (``kernel_masks.expected_keys``); a full
    layer of a model whose blocks hold on its sliding layers only is causal."""
    worst = interpreted[case]
    assert worst["hooked"] < 1e-5, f"{case}: {worst}"
    if case == "sliding_only_full_layer":
        assert worst["hooked_every_layer"] > 0.1, f"{case}: the blocks on a full layer must change the answer"
    else:
        assert worst["no_mask"] > 0.1, f"{case}: the blocks must change the answer, so a dropped mask fails"


def test_tritons_causal_flag_drops_the_keys_of_a_block_past_a_query_tile(interpreted):
    """What stock Gemma 3 does on Triton (its mask with the causal flag): the long block loses its
    later keys, so our hook runs the kernel without the flag."""
    assert interpreted["long_block"]["stock_flag"] > 0.1
    assert interpreted["two_blocks_capped"]["stock_flag"] > 0.1


def _batch(mode: str = "EXTEND", blocks=((), ((1, 3),))):
    modes = {"EXTEND": (True, False), "DECODE": (False, False), "TARGET_VERIFY": (True, True)}
    extend, verify = modes[mode]
    forward_mode = SimpleNamespace(is_extend=lambda: extend, is_target_verify=lambda: verify,
                                   is_dllm_extend=lambda: False)
    batch = SimpleNamespace(forward_mode=forward_mode, extend_prefix_lens_cpu=[2, 0], extend_seq_lens_cpu=[3, 4])
    if blocks is not None:
        setattr(batch, BLOCKS_ATTR, list(blocks))
    return batch


def test_tritons_metadata_carries_the_mask_of_a_prefill_batch_with_a_block_only():
    backend = SimpleNamespace(device="cpu")

    def stock(self, forward_batch):
        self.forward_metadata = SimpleNamespace(custom_mask=None, mask_indptr=None)

    gpu.triton_init_forward_metadata(stock, backend, _batch())
    expected, indptr = gpu.flat_mask([2, 0], [3, 4], [(), ((1, 3),)])
    assert torch.equal(backend.forward_metadata.custom_mask, expected)
    assert torch.equal(backend.forward_metadata.mask_indptr, indptr)
    assert getattr(backend.forward_metadata, gpu.MASKED)
    for other in (_batch(blocks=None), _batch("DECODE"), _batch("TARGET_VERIFY")):
        gpu.triton_init_forward_metadata(stock, backend, other)
        assert backend.forward_metadata.custom_mask is None and not hasattr(backend.forward_metadata, gpu.MASKED)


def test_tritons_kernel_keeps_its_causal_flag_for_a_mask_not_ours():
    seen = []
    metadata = SimpleNamespace(custom_mask=torch.ones(1, dtype=torch.bool))
    backend = SimpleNamespace(forward_metadata=metadata)
    args = [None] * 9 + [torch.ones(1, dtype=torch.bool), True, None]  # a speculative tree's mask
    gpu.triton_extend_kernel(lambda self, layer, *a, **k: seen.append(a[gpu.TRITON_CAUSAL_ARG]), backend, None, *args)
    setattr(metadata, gpu.MASKED, True)
    gpu.triton_extend_kernel(lambda self, layer, *a, **k: seen.append(a[gpu.TRITON_CAUSAL_ARG]), backend, None, *args)
    args[gpu.TRITON_MASK_ARG] = metadata.custom_mask
    gpu.triton_extend_kernel(lambda self, layer, *a, **k: seen.append(a[gpu.TRITON_CAUSAL_ARG]), backend, None, *args)
    assert seen == [True, True, False]


def _plan_args(kv_start_idx=None, use_ragged=False, spec_info=None):
    seq_lens = torch.tensor([5, 4])
    return (None, None, torch.tensor([0, 1]), seq_lens, 9, seq_lens, torch.tensor([2, 0]), kv_start_idx,
            None, None, use_ragged, spec_info)


def test_flashinfer_plans_each_paged_wrapper_with_the_mask_of_the_keys_it_reads():
    planned = []

    def stock(self, *args, **kwargs):
        planned.append(kwargs.get("cross_attention_custom_mask"))

    planner = SimpleNamespace()
    setattr(planner, gpu.PLANNING, ([2, 0], [3, 4], [(), ((1, 3),)]))
    gpu.flashinfer_plan(stock, planner, *_plan_args())  # the full-attention wrapper: every key
    gpu.flashinfer_plan(stock, planner, *_plan_args(kv_start_idx=torch.tensor([1, 0])), window_left=3)
    assert torch.equal(planned[0], gpu.flat_mask([2, 0], [3, 4], [(), ((1, 3),)])[0])
    assert torch.equal(planned[1], gpu.flat_mask([2, 0], [3, 4], [(), ((1, 3),)], [1, 0])[0])
    gpu.flashinfer_plan(stock, planner, *_plan_args(spec_info=object()))  # a verify plan is its own
    gpu.flashinfer_plan(stock, SimpleNamespace(), *_plan_args())  # a batch without a block
    assert planned[2:] == [None, None]
    with pytest.raises(RuntimeError, match="mask of its own"):
        gpu.flashinfer_plan(stock, planner, *_plan_args(), cross_attention_custom_mask=torch.ones(1))


def test_flashinfer_plans_a_batch_with_a_block_on_the_paged_wrapper_alone():
    planner = SimpleNamespace()
    backend = SimpleNamespace(indices_updater_prefill=planner, is_multimodal=False)
    seen = []

    def stock(self, forward_batch):
        seen.append((self.is_multimodal, getattr(planner, gpu.PLANNING, None)))

    gpu.flashinfer_init_forward_metadata(stock, backend, _batch())
    gpu.flashinfer_init_forward_metadata(stock, backend, _batch("DECODE"))
    assert seen == [(True, ([2, 0], [3, 4], [(), ((1, 3),)])), (False, None)]
    assert backend.is_multimodal is False and not hasattr(planner, gpu.PLANNING)


def test_the_prefill_cuda_graph_does_not_replay_a_batch_with_a_block():
    assert gpu.prefill_graph_can_run(lambda self, fb: True, None, _batch()) is False
    assert gpu.prefill_graph_can_run(lambda self, fb: True, None, _batch(blocks=None)) is True
