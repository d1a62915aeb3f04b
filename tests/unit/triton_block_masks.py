"""Triton's extend kernel, run in Triton's interpreter on the CPU, over the batches of
``sgl_embeds_testing.kernel_masks``: prints, as JSON, each case's largest difference from the
dense reference for each way of calling it. Run by tests/unit/test_gpu_block_masks.py in a process
of its own: the interpreter must be chosen before Triton is imported."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from sgl_embeds_testing import kernel_masks  # noqa: E402

if __name__ == "__main__":
    names = sys.argv[1:] or list(kernel_masks.CASES)
    ways = {name: ("hooked", "no_mask", "hooked_every_layer") if kernel_masks.CASES[name].get("sliding_only")
            else ("hooked", "no_mask", "stock_flag") for name in names}
    print(json.dumps({name: {how: kernel_masks.triton(kernel_masks.CASES[name], how) for how in ways[name]}
                      for name in names}))
