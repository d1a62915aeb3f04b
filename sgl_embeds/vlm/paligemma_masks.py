"""PaliGemma's segmentation masks: the 16 ``<segNNN>`` codes of an answer, decoded by big_vision's
VQ-VAE mask decoder into a 64x64 mask and placed in the object's box. The decoder's weights
(``vae-oid.npz``) come from the user; docs/vision-encoders.md, section 7, says where.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn

CODEBOOK = "_vq_vae._embedding"
GRID = 4  # the 16 codes are a 4x4 grid, row-major
RESIDUAL_BLOCKS = ("decoder.2.net", "decoder.3.net")  # each: 3x3 conv, 3x3 conv, 1x1 conv
UPSAMPLES = ("decoder.4", "decoder.6", "decoder.8", "decoder.10")  # each doubles the side


class _Residual(nn.Module):
    def __init__(self, convs: Sequence[nn.Conv2d]):
        super().__init__()
        self.convs = nn.ModuleList(convs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second, last = self.convs
        return x + last(torch.relu(second(torch.relu(first(x)))))


class MaskDecoder(nn.Module):
    """big_vision's decoder of PaliGemma's mask codes (``vae-oid.npz``, a PyTorch state saved as
    NumPy arrays): codebook rows on a 4x4 grid, a 1x1 conv, two residual blocks, four transposed
    convolutions (4x4 kernels, stride 2: 4 -> 64 pixels a side), a 1x1 conv to one channel. Its
    output is in about [-1, 1]; a pixel is in the mask where it is above 0. Layer widths are read
    from the weights."""

    def __init__(self, weights: Mapping[str, np.ndarray]):
        super().__init__()

        def tensor(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the mask decoder's weights have no {name!r} (is this vae-oid.npz?)")
            return torch.from_numpy(np.asarray(weights[name], dtype=np.float32))

        def layer(prefix: str, kind: type, **options) -> nn.Module:
            weight, bias = tensor(prefix + ".weight"), tensor(prefix + ".bias")
            if weight.dim() != 4:
                raise ValueError(f"{prefix}.weight has shape {tuple(weight.shape)}, not a 2-D convolution's")
            # a Conv2d's weight is [out, in, k, k]; a ConvTranspose2d's [in, out, k, k]
            channels = weight.shape[:2] if kind is nn.Conv2d else weight.shape[1::-1]
            module = kind(channels[1], channels[0], weight.shape[2], **options)
            module.weight.data.copy_(weight)
            module.bias.data.copy_(bias)
            return module

        codebook = tensor(CODEBOOK)
        self.register_buffer("codebook", codebook)
        self.conv_in = layer("decoder.0", nn.Conv2d)
        self.residual = nn.Sequential(*(_Residual([layer(f"{p}.0", nn.Conv2d, padding=1),
                                                   layer(f"{p}.2", nn.Conv2d, padding=1),
                                                   layer(f"{p}.4", nn.Conv2d)]) for p in RESIDUAL_BLOCKS))
        self.upsample = nn.ModuleList(layer(p, nn.ConvTranspose2d, stride=2, padding=1) for p in UPSAMPLES)
        self.conv_out = layer("decoder.12", nn.Conv2d)

    @classmethod
    def from_npz(cls, path: str | Path) -> "MaskDecoder":
        """The decoder from ``vae-oid.npz``, a zip of ``.npy`` arrays, each read by numpy's
        ``read_array``, which refuses an array of Python objects (a pickle)."""
        arrays = {}
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if not name.endswith(".npy"):
                    raise ValueError(f"{path}: {name!r} is not an .npy array")
                with archive.open(name) as f:
                    arrays[name.removesuffix(".npy")] = np.lib.format.read_array(f)
        return cls(arrays)

    @property
    def codes(self) -> int:
        return self.codebook.shape[0]

    @torch.no_grad()
    def forward(self, codes: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """``[objects, 16]`` codes -> ``[objects, 64, 64]`` mask logits (above 0: in the mask)."""
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.dim() != 2 or codes.shape[1] != GRID * GRID:
            raise ValueError(f"mask codes come {GRID * GRID} per object, got shape {tuple(codes.shape)}")
        if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) < self.codes):
            raise ValueError(f"mask codes are in [0, {self.codes}), got {codes.tolist()}")
        grid = self.codebook[codes].view(codes.shape[0], GRID, GRID, -1).permute(0, 3, 1, 2)
        x = self.residual(torch.relu(self.conv_in(grid)))
        for upsample in self.upsample:
            x = torch.relu(upsample(x))
        return self.conv_out(x)[:, 0]


def mask_in_image(logits: torch.Tensor | np.ndarray, box: Sequence[int], width: int, height: int) -> np.ndarray:
    """A decoded mask (``[64, 64]`` logits) as a ``height`` x ``width`` bool image: resized
    bilinearly into ``box`` (``(x0, y0, x1, y1)`` pixels), as big_vision's evaluator does,
    above 0 inside the box, False outside it."""
    x0, y0, x1, y1 = (int(v) for v in box)
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise ValueError(f"box {tuple(box)} is not inside a {width}x{height} image")
    logits = np.asarray(logits, dtype=np.float32)
    inside = np.asarray(Image.fromarray(logits, mode="F").resize((x1 - x0, y1 - y0), Image.BILINEAR))
    out = np.zeros((height, width), dtype=bool)
    out[y0:y1, x0:x1] = inside > 0
    return out
