"""Vision encoders for ``sgl.region`` / ``sgl.image``: boxes, crops, and the open_clip default.

A ``VisionEncoder`` is any callable ``PIL.Image -> Tensor[n, hidden]``. The default,
``OpenClipEncoder``, is a VLM's front half: an open_clip vision tower followed by a projector to
the LLM's hidden size (LLaVA-style), with weights loaded from the developer's own checkpoint.

Boxes are ``(x0, y0, x1, y1)`` with ``x0 < x1`` and ``y0 < y1``:

* all ``int``: pixels, ``0 <= x0 < x1 <= width`` (the right/bottom edges are exclusive);
* all ``float`` in ``[0, 1]``: fractions of the width and height.

Mixing ints and floats, or floats outside ``[0, 1]``, is ambiguous and raises ``ValueError``.
"""

from __future__ import annotations

import base64
import io
import math
import warnings
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from PIL import Image


class VisionEncoder(Protocol):
    def __call__(self, image: Image.Image) -> torch.Tensor:  # [n, hidden]
        ...


def check_box_form(box: Sequence[float]) -> str:
    """``"pixels"`` or ``"normalized"``; ``ValueError`` for anything ambiguous or malformed."""
    if len(box) != 4:
        raise ValueError(f"a box is (x0, y0, x1, y1), got {len(box)} values: {tuple(box)}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in box):
        raise ValueError(f"box values must be numbers, got {tuple(box)}")
    if any(isinstance(v, float) and not math.isfinite(v) for v in box):
        raise ValueError(f"box values must be finite, got {tuple(box)}")
    kinds = {isinstance(v, int) for v in box}
    if len(kinds) > 1:
        raise ValueError(f"box {tuple(box)} mixes ints (pixels) and floats (fractions): use one kind")
    if kinds == {True}:
        return "pixels"
    if not all(0.0 <= v <= 1.0 for v in box):
        raise ValueError(f"float boxes are fractions in [0, 1]; for pixels use ints: {tuple(box)}")
    return "normalized"


def to_pixel_box(box: Sequence[float], width: int, height: int) -> tuple[int, int, int, int]:
    """The box in pixels, checked against the image; zero-area and outside boxes raise."""
    if check_box_form(box) == "normalized":
        x0, y0, x1, y1 = (round(v * s) for v, s in zip(box, (width, height, width, height)))
    else:
        x0, y0, x1, y1 = box
    if not (0 <= x0 and 0 <= y0 and x1 <= width and y1 <= height):
        raise ValueError(f"box {tuple(box)} lies outside the {width}x{height} image")
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"box {tuple(box)} has zero area (needs x0 < x1 and y0 < y1)")
    return int(x0), int(y0), int(x1), int(y1)


def crop(image: Image.Image, box: Sequence[float]) -> Image.Image:
    return image.crop(to_pixel_box(box, *image.size))


def encode_region(image: Image.Image, box: Sequence[float], encoder: VisionEncoder) -> torch.Tensor:
    """``encoder`` applied to the crop, checked to be a finite ``[n, hidden]`` tensor."""
    from sgl_embeds import wire

    out = encoder(crop(image, box))
    t = wire.as_2d_tensor(out)
    wire.check_tensor(t)
    return t.detach().cpu()


def load_image(source: Any) -> Image.Image:
    """A PIL image from a PIL image, a local path, raw bytes or a base64 string (no URLs)."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, bytes):
        return Image.open(io.BytesIO(source)).convert("RGB")
    if isinstance(source, (str, Path)):
        text = str(source)
        if text.startswith("data:") and "," in text:
            text = text.split(",", 1)[1]
        if Path(text).exists():
            return Image.open(text).convert("RGB")
        try:
            return Image.open(io.BytesIO(base64.b64decode(text, validate=True))).convert("RGB")
        except Exception:
            raise ValueError(f"cannot load an image from {text[:60]!r}: not a file, nor base64 image data") from None
    raise ValueError(f"cannot load an image from a {type(source).__name__}")


class OpenClipEncoder:
    """open_clip vision tower + linear projector to the LLM's hidden size.

    ``tower_weights`` / ``projector_weights`` are ``.safetensors`` files of the developer's own
    checkpoint (the tower's ``visual.*`` keys, the projector's ``weight``/``bias``). Random
    weights only with ``allow_random=True``, and then with a warning: they make a span of noise.
    ``tokens="patches"`` gives one row per patch (LLaVA-style); ``"pooled"`` gives one row.
    """

    def __init__(
        self,
        hidden_size: int,
        model_name: str = "ViT-B-32",
        tower_weights: str | Path | None = None,
        projector_weights: str | Path | None = None,
        tokens: str = "patches",
        allow_random: bool = False,
        device: str | None = None,
    ):
        import open_clip

        if (tower_weights is None or projector_weights is None) and not allow_random:
            raise ValueError(
                "OpenClipEncoder needs tower_weights and projector_weights from your checkpoint; "
                "pass allow_random=True to use random weights (for tests only)"
            )
        if tokens not in ("patches", "pooled"):
            raise ValueError(f"tokens must be 'patches' or 'pooled', got {tokens!r}")
        model, _, self.preprocess = open_clip.create_model_and_transforms(model_name, pretrained=None)
        self.tower = model.visual.eval()
        self.tower.output_tokens = tokens == "patches"
        self.tokens = tokens
        width = self._feature_width()
        self.projector = torch.nn.Linear(width, hidden_size)
        if tower_weights is not None:
            _load_safetensors(self.tower, tower_weights, prefix="visual.")
        if projector_weights is not None:
            _load_safetensors(self.projector, projector_weights)
        if tower_weights is None or projector_weights is None:
            warnings.warn("OpenClipEncoder uses random weights: its spans carry no meaning", stacklevel=2)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tower.to(self.device)
        self.projector.to(self.device).eval()

    def _feature_width(self) -> int:
        size = getattr(self.tower, "image_size", (224, 224))
        size = size if isinstance(size, (tuple, list)) else (size, size)
        with torch.no_grad():
            out = self.tower(torch.zeros(1, 3, *size))
        return (out[1] if self.tokens == "patches" else out).shape[-1]

    @torch.no_grad()
    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = self.preprocess(image.convert("RGB")).unsqueeze(0).to(self.device)
        out = self.tower(pixels)
        feats = out[1][0] if self.tokens == "patches" else out  # [patches, width] or [1, width]
        return self.projector(feats.reshape(-1, feats.shape[-1])).float().cpu()


def _load_safetensors(module: torch.nn.Module, path: str | Path, prefix: str = "") -> None:
    from safetensors.torch import load_file

    state = load_file(str(path))
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{path}: {e}") from None
    if missing or unexpected:
        raise ValueError(f"{path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
