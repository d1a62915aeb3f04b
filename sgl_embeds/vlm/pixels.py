"""Pixel values exactly as the checkpoint's own image processor computes them.

A LLaVA checkpoint preprocesses images with transformers' CLIP image processor: resize (shortest
edge, or to a fixed size), center crop, rescale to [0, 1], normalize. transformers 5 has two
backends that differ in the last bits of the resize: ``"torchvision"`` (the default whenever
torchvision is installed) and ``"pil"``. ``ImageProcessing`` records which one the checkpoint is
matched against and repeats its operations in the same order with the same library calls, so
the pixel values are equal, not just close (``tests/vlm/test_llava15_encoder.py`` checks both backends).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

# PIL resample codes (as saved in processor configs) -> torchvision interpolation names.
_RESAMPLE = {0: "NEAREST_EXACT", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}
BACKENDS = ("torchvision", "pil")


@dataclass(frozen=True)
class ImageProcessing:
    """The settings of a CLIP-style image processor, as saved next to a split vision tower."""

    backend: str = "torchvision"
    do_convert_rgb: bool = True
    do_resize: bool = True
    shortest_edge: int | None = 336  # resize the shortest edge to this, keeping the aspect ratio
    resize_to: tuple[int, int] | None = None  # or to exactly (height, width)
    resample: int = 3  # PIL's BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (336, 336)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"image processing backend must be one of {BACKENDS}, "
                             f"got {self.backend!r}")
        if self.resample not in _RESAMPLE:
            raise ValueError(f"unknown resample code {self.resample!r}: "
                             f"use one of {sorted(_RESAMPLE)}")
        if self.do_resize and (self.shortest_edge is None) == (self.resize_to is None):
            raise ValueError("give exactly one of shortest_edge and resize_to when do_resize "
                             "is set")

    @classmethod
    def from_hf(cls, processor, backend: str) -> "ImageProcessing":
        """From a loaded transformers image processor (``AutoImageProcessor.from_pretrained``)."""
        size, crop = processor.size, processor.crop_size
        if getattr(size, "longest_edge", None) or getattr(size, "max_height", None):
            raise ValueError(f"image processor 'size' {dict(size)} is not supported: "
                             "use shortest_edge or height/width")
        return cls(
            backend=backend, do_convert_rgb=bool(processor.do_convert_rgb),
            do_resize=bool(processor.do_resize),
            shortest_edge=size.shortest_edge,
            resize_to=None if size.shortest_edge else (size.height, size.width),
            resample=int(processor.resample), do_center_crop=bool(processor.do_center_crop),
            crop_size=(crop.height, crop.width), do_rescale=bool(processor.do_rescale),
            rescale_factor=float(processor.rescale_factor),
            do_normalize=bool(processor.do_normalize),
            image_mean=tuple(float(v) for v in processor.image_mean),
            image_std=tuple(float(v) for v in processor.image_std),
        )

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessing":
        d = dict(d)
        for key in ("resize_to", "crop_size", "image_mean", "image_std"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour that normalizes to (nearly) zero: what masked-out pixels become."""
        return tuple(int(round(m * 255)) for m in self.image_mean)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """``[3, height, width]`` float32 pixel values of one image."""
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.backend == "torchvision":
            return self._torchvision(image)
        return self._pil(image)

    def _resized_hw(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _torchvision(self, image: Image.Image) -> torch.Tensor:
        x = tvF.pil_to_tensor(image)
        if self.do_resize:
            mode = getattr(InterpolationMode, _RESAMPLE[self.resample])
            size = list(self._resized_hw(*x.shape[-2:]))
            x = tvF.resize(x, size, interpolation=mode, antialias=True)
        if self.do_center_crop:
            x = _center_crop_tv(x, *self.crop_size)
        if self.do_normalize:
            mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
            if self.do_rescale:  # the processor folds the rescale into mean and std
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            return tvF.normalize(x.to(torch.float32), mean.tolist(), std.tolist())
        x = x.to(torch.float32)
        return x * self.rescale_factor if self.do_rescale else x

    def _pil(self, image: Image.Image) -> torch.Tensor:
        if self.do_resize:
            height, width = self._resized_hw(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        x = np.asarray(image).transpose(2, 0, 1)
        if self.do_center_crop:
            x = _center_crop_np(x, *self.crop_size)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x.astype(np.float32)
            mean = np.array(self.image_mean, dtype=x.dtype)[:, None, None]
            std = np.array(self.image_std, dtype=x.dtype)[:, None, None]
            x = (x - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def _center_crop_tv(x: torch.Tensor, crop_h: int, crop_w: int) -> torch.Tensor:
    height, width = x.shape[-2:]
    if crop_w > width or crop_h > height:  # pad with zeros first, as the processor does
        pad = [max(crop_w - width, 0) // 2, max(crop_h - height, 0) // 2,
               (max(crop_w - width, 0) + 1) // 2, (max(crop_h - height, 0) + 1) // 2]
        x = tvF.pad(x, pad, fill=0)
        height, width = x.shape[-2:]
    top, left = int((height - crop_h) / 2.0), int((width - crop_w) / 2.0)
    return tvF.crop(x, top, left, crop_h, crop_w)


def _center_crop_np(x: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    height, width = x.shape[-2:]
    if crop_w > width or crop_h > height:
        new_h, new_w = max(crop_h, height), max(crop_w, width)
        padded = np.zeros((x.shape[0], new_h, new_w), dtype=x.dtype)
        top, left = int(np.ceil((new_h - height) / 2)), int(np.ceil((new_w - width) / 2))
        padded[:, top:top + height, left:left + width] = x
        x, height, width = padded, new_h, new_w
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return x[:, top:top + crop_h, left:left + crop_w]
