"""A deterministic toy ``VisionEncoder`` and a synthetic image, for tests and tutorials."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw


class GridEncoder:
    """One row per cell of a ``grid x grid`` split of the image: the cell's mean colour, tiled
    and scaled to ``hidden`` values. Deterministic, so tests can recompute what was sent."""

    def __init__(self, hidden: int = 64, grid: int = 2, scale: float = 0.2):
        self.hidden, self.grid, self.scale = hidden, grid, scale

    def __call__(self, image: Image.Image) -> torch.Tensor:
        side = 8 * self.grid
        px = torch.tensor(list(image.convert("RGB").resize((side, side)).getdata()), dtype=torch.float32)
        cells = px.reshape(self.grid, 8, self.grid, 8, 3).mean(dim=(1, 3)).reshape(-1, 3) / 255.0
        reps = -(-self.hidden // 3)
        return (cells.repeat(1, reps)[:, : self.hidden] - 0.5) * self.scale


def synthetic_scene(width: int = 96, height: int = 64) -> Image.Image:
    """Sky over grass, a red square and a blue disc: regions with clearly different colours."""
    img = Image.new("RGB", (width, height), (135, 206, 235))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, height // 2, width, height), fill=(34, 139, 34))
    draw.rectangle((8, 8, 32, 32), fill=(220, 20, 20))
    draw.ellipse((56, 36, 84, 60), fill=(20, 40, 220))
    return img


def scene_disc_mask(width: int = 96, height: int = 64) -> np.ndarray:
    """The blue disc of ``synthetic_scene(width, height)`` (at its default size) as a bool mask:
    a region that is not a box (its bounding box is 29x29 px)."""
    yy, xx = np.mgrid[:height, :width]
    return (yy - 48) ** 2 + (xx - 70) ** 2 <= 14 ** 2
