"""Any-resolution tiling (LLaVA-NeXT, LLaVA-OneVision): the rows an image becomes, and how many.

``Tiling.pack`` lays the tiles' features out as transformers' ``pack_image_features`` does (the
base tile, the tiles as one feature map unpadded to the image's aspect ratio, OneVision's
down-scaling, an ``image_newline`` row after each row) with the same tensor operations in HF's
order, so the rows are equal, not close; ``Tiling.rows_for`` counts them with the processor's
arithmetic before anything is encoded (docs/vision-encoders.md, section 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.image_processing_utils import select_best_resolution

# OneVision down-scales a feature map only when it exceeds max_tiles tiles' features by this ratio
DOWNSCALE_ABOVE = 1.1


@dataclass(frozen=True)
class Tiling:
    """The tiling of one checkpoint: ``tile`` (the tower's input edge, pixels), ``grid`` (patches
    per tile edge), ``pinpoints`` (``(height, width)`` in pixels, multiples of ``tile``) and
    ``max_tiles`` (OneVision's ``anyres_max_N``; None on LLaVA-NeXT: never down-scaled)."""

    tile: int
    grid: int
    pinpoints: tuple[tuple[int, int], ...]
    max_tiles: int | None = None

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint ``(height, width)`` an image of this size is resized into."""
        return tuple(select_best_resolution((height, width), [list(p) for p in self.pinpoints]))

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """``(tiles high, tiles wide)`` of an image of this size (the base tile not counted)."""
        best_h, best_w = self.best_resolution(height, width)
        return best_h // self.tile, best_w // self.tile

    def feature_map(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, columns)`` of the image's feature map after unpadding and down-scaling (the
        newline rows not counted)."""
        tiles_h, tiles_w = self.tiles(height, width)
        rows, cols = _unpadded(height, width, tiles_h * self.grid, tiles_w * self.grid)
        ratio = self._downscale_ratio(rows, cols)
        if ratio is not None:
            rows, cols = int(rows // ratio), int(cols // ratio)
        return rows, cols

    def rows_for(self, width: int, height: int) -> int:
        """How many rows (image tokens in HF's prompt) an image of ``width x height`` becomes."""
        rows, cols = self.feature_map(height, width)
        return self.grid * self.grid + rows * (cols + 1)

    def pack(self, features: torch.Tensor, height: int, width: int,
             newline: torch.Tensor) -> torch.Tensor:
        """One image's rows from its projected tile features ``[1 + tiles, grid*grid, hidden]``
        (the base tile first, then the tiles row by row, as the image processor orders them)."""
        tiles_h, tiles_w = self.tiles(height, width)
        if features.shape[:2] != (1 + tiles_h * tiles_w, self.grid * self.grid):
            raise ValueError(f"tile features {list(features.shape)} do not fit an image of "
                             f"{width}x{height}: expected 1 + {tiles_h}x{tiles_w} tiles of "
                             f"{self.grid * self.grid} rows")
        base, grid = features[0], self.grid
        x = features[1:].view(tiles_h, tiles_w, grid, grid, -1)
        x = x.permute(4, 0, 2, 1, 3).contiguous().flatten(1, 2).flatten(2, 3)  # [hidden, H, W]
        rows, cols = _unpadded(height, width, *x.shape[1:])
        top, left = (x.shape[1] - rows) // 2, (x.shape[2] - cols) // 2
        x = x[:, top:top + rows, left:left + cols]
        ratio = self._downscale_ratio(rows, cols)
        if ratio is not None:
            size = [int(rows // ratio), int(cols // ratio)]
            x = torch.nn.functional.interpolate(x[None], size, mode="bilinear")[0]
        column = newline[:, None, None].expand(*x.shape[:-1], 1).to(x.device, x.dtype)
        x = torch.cat((x, column), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((base, x), dim=0)

    def _downscale_ratio(self, rows: int, cols: int) -> float | None:
        if self.max_tiles is None:
            return None
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.grid**2))
        return ratio if ratio > DOWNSCALE_ABOVE else None


def _unpadded(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """The ``rows x cols`` feature map of a padded pinpoint, with the padding cut off: the size
    transformers' ``unpad_image`` leaves (the same float arithmetic, rounded at 7 digits)."""
    if width / height > cols / rows:  # padded above and below
        padding = (rows - int(round(height * (cols / width), 7))) // 2
        return rows - 2 * padding, cols
    padding = (cols - int(round(width * (rows / height), 7))) // 2
    return rows, cols - 2 * padding
