"""PaliGemma's mask decoder (``sgl_embeds.vlm.paligemma_masks``) on random weights of
``vae-oid.npz``'s layout: equal to the same network computed with JAX's convolutions as
big_vision calls them (a golden written by scripts/mask_decoder_golden.py), read from an ``.npz``
without pickle, sensitive to each code, and placed in its box as big_vision's evaluator does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sgl_embeds.vlm.paligemma_masks import MaskDecoder, mask_in_image
from sgl_embeds_testing.paligemma import mask_decoder_weights

GOLDEN = Path(__file__).resolve().parent / "paligemma_mask_decoder_golden.npy"
GOLDEN_CODES = [[3, 17, 127, 0, 64, 5, 9, 88, 1, 2, 100, 45, 77, 12, 30, 6],
                [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def decoder() -> MaskDecoder:
    return MaskDecoder(mask_decoder_weights(0))


def test_the_decoder_equals_jax_run_as_big_vision_runs_it(decoder):
    ours = decoder(GOLDEN_CODES)
    golden = torch.from_numpy(np.load(GOLDEN, allow_pickle=False))
    assert ours.shape == golden.shape == (2, 64, 64)
    assert golden.std() > 0.05, "a degenerate golden"
    torch.testing.assert_close(ours, golden, rtol=1e-4, atol=1e-5)


def test_each_code_changes_the_mask(decoder):
    base = decoder(GOLDEN_CODES[:1])
    for i in range(16):
        codes = [list(GOLDEN_CODES[0])]
        codes[0][i] = (codes[0][i] + 1) % 128
        assert (decoder(codes) - base).abs().max() > 1e-3, f"code {i} does not reach the mask"


def test_the_weights_load_from_an_npz_without_pickle(decoder, tmp_path):
    path = tmp_path / "vae-oid.npz"
    np.savez(path, **mask_decoder_weights(0))
    assert torch.equal(MaskDecoder.from_npz(path)(GOLDEN_CODES), decoder(GOLDEN_CODES))
    np.savez(tmp_path / "objects.npz", **{"_vq_vae._embedding": np.array([object()], dtype=object)})
    with pytest.raises(ValueError, match="Object arrays cannot be loaded"):
        MaskDecoder.from_npz(tmp_path / "objects.npz")


def test_bad_weights_and_codes_are_named(decoder):
    weights = mask_decoder_weights(0)
    del weights["decoder.8.bias"]
    with pytest.raises(ValueError, match="no 'decoder.8.bias'"):
        MaskDecoder(weights)
    with pytest.raises(ValueError, match="16 per object"):
        decoder([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"in \[0, 128\)"):
        decoder([[128] + [0] * 15])


def test_a_mask_is_resized_into_its_box_and_nowhere_else():
    logits = np.full((64, 64), -1.0, dtype=np.float32)
    logits[:, 32:] = 1.0  # the right half of the box
    mask = mask_in_image(logits, (10, 4, 30, 14), width=40, height=20)
    assert mask.shape == (20, 40) and mask.dtype == bool
    assert not mask[:4].any() and not mask[14:].any() and not mask[:, :10].any() and not mask[:, 30:].any()
    assert mask[4:14, 21:30].all() and not mask[4:14, 10:19].any()
    expected = np.asarray(Image.fromarray(logits, mode="F").resize((20, 10), Image.BILINEAR)) > 0
    assert np.array_equal(mask[4:14, 10:30], expected)
    with pytest.raises(ValueError, match="not inside a 40x20 image"):
        mask_in_image(logits, (10, 4, 41, 14), width=40, height=20)
