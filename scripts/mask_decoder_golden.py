"""Writes tests/unit/paligemma_mask_decoder_golden.npy: the mask logits of big_vision's decoder,
computed with JAX's convolutions called as big_vision's Flax modules call them (``nn.Conv``;
``nn.ConvTranspose`` with ``transpose_kernel=True`` and ``padding=2``, kernels transposed from
the PyTorch layout by (2, 3, 1, 0)), for ``sgl_embeds_testing.paligemma.mask_decoder_weights(0)``
and ``GOLDEN_CODES``. An independent check of ``sgl_embeds.vlm.paligemma_masks.MaskDecoder``
(tests/unit/test_paligemma_masks.py). Needs jax (not a project dependency):
    python -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax numpy
    PYTHONPATH=.:testing /tmp/jaxenv/bin/python scripts/mask_decoder_golden.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "unit" / "paligemma_mask_decoder_golden.npy"


def weights() -> dict:
    # the testing package imports torch; read the one function's source instead
    source = (ROOT / "testing" / "sgl_embeds_testing" / "paligemma.py").read_text()
    tree = ast.parse(source)
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name == "mask_decoder_weights")
            or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "MASK_DECODER_WIDTHS")]
    scope: dict = {}
    exec(compile(ast.Module(keep, []), "paligemma.py", "exec"), scope)
    return scope["mask_decoder_weights"](0)


def golden_codes() -> list:
    tree = ast.parse((ROOT / "tests" / "unit" / "test_paligemma_masks.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "GOLDEN_CODES":
            return ast.literal_eval(node.value)
    raise LookupError("GOLDEN_CODES")


def conv(x, w, name, padding):
    kernel = np.transpose(w[name + ".weight"], (2, 3, 1, 0))
    y = lax.conv_general_dilated(x, kernel, (1, 1), ((padding, padding), (padding, padding)),
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + w[name + ".bias"]


def conv_transpose(x, w, name):
    kernel = np.transpose(w[name + ".weight"], (2, 3, 1, 0))
    y = lax.conv_transpose(x, kernel, (2, 2), ((2, 2), (2, 2)),
                           dimension_numbers=("NHWC", "HWIO", "NHWC"), transpose_kernel=True)
    return y + w[name + ".bias"]


def relu(x):
    return np.maximum(np.asarray(x), 0)


def decode(codes, w):
    x = w["_vq_vae._embedding"][np.asarray(codes).reshape(-1)].reshape(len(codes), 4, 4, -1)
    x = relu(conv(x, w, "decoder.0", 0))
    for block in ("decoder.2.net", "decoder.3.net"):
        y = relu(conv(x, w, block + ".0", 1))
        y = relu(conv(y, w, block + ".2", 1))
        x = x + np.asarray(conv(y, w, block + ".4", 0))
    for name in ("decoder.4", "decoder.6", "decoder.8", "decoder.10"):
        x = relu(conv_transpose(x, w, name))
    return np.asarray(conv(x, w, "decoder.12", 0))[..., 0]


if __name__ == "__main__":
    out = decode(golden_codes(), weights()).astype(np.float32)
    np.save(GOLDEN, out)
    print(GOLDEN, out.shape, float(np.abs(out).max()))
