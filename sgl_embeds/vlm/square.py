"""The vision half of a split family that turns every image into the same number of rows: the
checkpoint's image processor (a square resize), its SigLIP tower and the family's projector
(PaliGemma, Gemma 3). A family's module subclasses ``SquareImageEncoder`` with its settings record,
its processor check and its projector; the rest is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModel
from transformers.image_processing_backends import TorchvisionBackend

from sgl_embeds.vlm.pixels import BACKENDS
from sgl_embeds.vision import note_dtype, vision_dtype
from sgl_embeds.vlm.tower import place_vision_half, read_vision_dir


class SquareImageEncoder:
    """``image -> [rows_per_image, llm_hidden]`` rows, as the family's HF class computes them.

    ``backend``: the image processor's transformers backend, ``"torchvision"`` or ``"pil"``
    (default: what ``AutoImageProcessor.from_pretrained`` picks); ``device``: cuda when available.
    """

    family: str  # what the server it fits serves (sgl_embeds.connect checks it)
    settings: Any  # the family's settings record: from_json, vision_config, llm_hidden_size, ...
    check_processor: Callable[[Any, int], None]  # the family's image-processor check

    def __init__(self, vision_dir: str | Path, backend: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
        self.dtype = vision_dtype(dtype)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        text, weights, digest = read_vision_dir(vision_dir)
        self.config = self.settings.from_json(text)
        self.processor = AutoImageProcessor.from_pretrained(
            vision_dir, **({} if backend is None else {"backend": backend}))
        type(self).check_processor(self.processor, self.config.vision_config["image_size"])
        self.backend = "torchvision" if isinstance(self.processor, TorchvisionBackend) else "pil"
        vision = AutoConfig.for_model(**self.config.vision_config)
        self.tower = AutoModel.from_config(vision)
        self.projector = self.make_projector(vision)
        self.device = place_vision_half(self.tower, self.projector, weights, f"{vision_dir}: ", device,
                                        self.dtype)
        digest.update(f"{self.backend}\n{self.processor.to_json_string()}".encode())
        note_dtype(digest, self.dtype)
        self.identity = f"{self.family}-{digest.hexdigest()[:16]}"  # for encoder caches

    def make_projector(self, vision: Any) -> torch.nn.Module:
        """The family's projector, of HF's weight names, for the tower config ``vision``."""
        raise NotImplementedError

    @property
    def span_width(self) -> int:
        return self.config.llm_hidden_size

    @property
    def image_token(self) -> str:
        """Where the family's ``prompt_text`` puts each image's rows (``image_prompt``'s token)."""
        return self.config.image_token

    @property
    def rows_per_image(self) -> int:
        return self.config.rows_per_image

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour that normalizes to (nearly) zero: what masked-out pixels become."""
        return tuple(int(round(m * 255)) for m in self.processor.image_mean)

    def rows_for(self, width: int, height: int) -> int:
        """How many rows an image of this size becomes: ``rows_per_image``, whatever its size."""
        return self.config.rows_per_image

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """``[3, size, size]``: what the checkpoint's image processor gives for ``image``."""
        (pixels,) = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        return pixels

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[batch, rows_per_image, llm_hidden]`` rows of ``[batch, 3, size, size]`` pixels."""
        out = self.tower(pixel_values=pixel_values.to(self.device, self.dtype))
        return self.projector(out.last_hidden_state)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.features(self.pixel_values(image).unsqueeze(0))[0].float().cpu()
