"""Vision encoders for ``sgl.region`` / ``sgl.image``: boxes, masks, crops, the cache, a default.

A ``VisionEncoder`` is any callable ``PIL.Image -> [n, hidden]``, or ``-> VisionRows`` when the
rows carry the image's grid; ``as_vision_rows`` checks either where it enters. A region is a box
(all ints: pixels; all floats in [0, 1]: fractions; docs/reference.md) or a mask (its bounding
box, the outside in the encoder's ``mean_color``). ``EncoderCache`` keeps outputs by encoder,
image and region; ``OpenClipEncoder`` is an open_clip tower + projector (docs/vision-encoders.md).
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, Union

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol import wire
from sgl_embeds_protocol.lru import LRU, nbytes

# Where an encoder has no image processor of its own: the CLIP mean colour (0.481, 0.458, 0.408).
DEFAULT_MEAN_COLOR = (123, 117, 104)


@dataclass(frozen=True)
class VisionRows:
    """An encoder's rows of one image, region or clip and, on M-RoPE VLMs, its grid
    (``segments.Grid``: the patch grid ``(t, h, w)`` before the spatial merge, and a clip's
    time), which goes with the span to the server. A plain ``(t, h, w)`` is an image's grid."""

    rows: torch.Tensor  # [n, hidden], on the CPU once checked
    grid: seg.Grid | None = None

    def __post_init__(self) -> None:
        if self.grid is not None and not isinstance(self.grid, seg.Grid):
            object.__setattr__(self, "grid", seg.Grid(self.grid))


class VisionEncoder(Protocol):
    """Optional attributes: ``identity`` (names weights and settings, for ``EncoderCache``),
    ``mean_color`` (fills the outside of a mask), ``merge_size`` (checks rows against a grid) and
    ``family`` (the VLM family it is the vision half of: ``connect`` checks it, and an image span of
    a family with ``Family.image_block`` is one bidirectional block), ``image_text`` and
    ``bos_token`` (how its processor expands an image part, and the bos its chat template writes
    first: ``connect``'s chat template reads them)."""

    def __call__(self, image: Image.Image) -> torch.Tensor | VisionRows:  # rows: [n, hidden]
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
        raise ValueError(f"box {tuple(box)} mixes ints (pixels) and floats (fractions): "
                         "use one kind")
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


MaskLike = Union[np.ndarray, torch.Tensor, Image.Image]


def is_mask(region: Any) -> bool:
    return isinstance(region, (np.ndarray, torch.Tensor, Image.Image))


def check_mask(mask: MaskLike) -> np.ndarray:
    """A binary mask as a 2-D bool array; ``ValueError`` for anything else or an empty mask.

    Accepted values: bool, or numbers that are all 0/1 or all 0/255 (an "L" or "1" PIL image)."""
    if isinstance(mask, Image.Image):
        if mask.mode not in ("1", "L"):
            raise ValueError("a mask image must be mode '1' or 'L' (one channel), "
                             f"got mode {mask.mode!r}")
        array = np.asarray(mask)
    elif isinstance(mask, torch.Tensor):
        array = mask.detach().cpu().numpy()
    else:
        array = np.asarray(mask)
    if array.ndim != 2:
        raise ValueError(f"a mask must be 2-D (height, width), got shape {list(array.shape)}")
    if array.dtype != bool:
        if array.dtype.kind not in "fiu":
            raise ValueError(f"a mask must hold bools or numbers, got dtype {array.dtype}")
        values = np.unique(array)
        if not (set(values.tolist()) <= {0, 1} or set(values.tolist()) <= {0, 255}):
            raise ValueError("a mask must be binary (0/1, 0/255 or bool), "
                             f"found values {values[:6].tolist()}")
        array = array != 0
    if not array.any():
        raise ValueError("the mask is empty: no pixel is selected")
    return array


def mask_image(image: Image.Image, mask: np.ndarray, fill: Sequence[int]) -> Image.Image:
    """The mask's bounding box of ``image``, with pixels outside the mask set to ``fill``."""
    if mask.shape != (image.height, image.width):
        raise ValueError(f"the mask has shape {list(mask.shape)} but the image is "
                         f"{image.height}x{image.width} "
                         "(height x width): a mask must have the image's size")
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    y0, y1, x0, x1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    pixels = np.array(image.convert("RGB").crop((x0, y0, x1, y1)))
    pixels[~mask[y0:y1, x0:x1]] = np.asarray(fill, dtype=np.uint8)
    return Image.fromarray(pixels)


def region_image(image: Image.Image, region: Any, encoder: Any) -> Image.Image:
    """What the encoder sees for ``region``: a box or a mask (see the module docstring), or None
    for the whole image."""
    if region is None:
        return image
    if is_mask(region):
        fill = getattr(encoder, "mean_color", DEFAULT_MEAN_COLOR)
        return mask_image(image, check_mask(region), fill)
    return crop(image, region)


def encode_region(image: Image.Image, region: Any, encoder: VisionEncoder) -> VisionRows:
    """``encoder`` applied to the region (a box, a mask, or None for the whole image), checked by
    ``as_vision_rows``."""
    out = encoder(region_image(image, region, encoder))
    return as_vision_rows(out, getattr(encoder, "merge_size", None))


def as_vision_rows(out: Any, merge_size: int | None = None) -> VisionRows:
    """An encoder's output (rows, or ``VisionRows``) checked where it enters: rows ``[n, hidden]``,
    finite, moved to the CPU; a grid ``[t, h, w]`` of positive ints that, when the encoder gives
    its ``merge_size``, accounts for every row (``t*h*w / merge_size**2``)."""
    grid = None
    if isinstance(out, VisionRows):
        out, grid = out.rows, out.grid
    t = wire.as_2d_tensor(out)
    wire.check_tensor(t)
    if grid is not None and merge_size is not None and math.prod(grid.thw) != len(t) * merge_size**2:
        raise ValueError(f"the encoder gave {len(t)} rows for the grid {list(grid.thw)}, which "
                         f"makes t*h*w/merge**2 = {math.prod(grid.thw) / merge_size**2:g} rows "
                         f"(merge size {merge_size})")
    return VisionRows(t.detach().cpu(), grid)


class EncoderCache:
    """Encoder outputs by (encoder identity, image content hash, box or mask), LRU, at most
    ``max_bytes``. An encoder's identity is its ``identity`` attribute (``LlavaEncoder`` hashes its
    weights and settings) or, failing that, the object itself; ``hits`` and ``misses`` count
    calls."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._lru: LRU[VisionRows] = LRU(max_bytes, lambda encoded: nbytes(encoded.rows))
        self._encoders: dict[int, Any] = {}  # keeps encoders alive so their ids stay unique

    def encode(self, encoder: VisionEncoder, image: Image.Image,
               region: Any = None) -> VisionRows:
        key = (self._identity(encoder), image_digest(image), _region_key(region, image))
        return self._cached(key, lambda: encode_region(image, region, encoder))

    def encode_clip(self, encoder: VisionEncoder, frames: Any, fps: float) -> VisionRows:
        """``encode_clip`` through the cache: a clip is keyed by its frames' content (their
        shape and bytes, in order) and its frame rate."""
        array, fps = clip_frames(frames), check_fps(fps)
        key = (self._identity(encoder), "clip", array.shape, fps, hashlib.sha256(array.tobytes()).hexdigest())
        return self._cached(key, lambda: encode_clip(array, fps, encoder))

    def _cached(self, key: tuple, encode: Callable[[], VisionRows]) -> VisionRows:
        encoded = self._lru.get(key)
        if encoded is not None:
            self.hits += 1
            return encoded
        self.misses += 1
        encoded = encode()
        self._lru.put(key, encoded)
        return encoded

    def _identity(self, encoder: Any) -> Any:
        identity = getattr(encoder, "identity", None)
        if identity is None:
            self._encoders[id(encoder)] = encoder
            identity = ("object", id(encoder))
        return identity

    def clear(self) -> None:
        self._lru.clear()
        self._encoders.clear()

    def stats(self) -> dict:
        entries, size = self._lru.sizes()
        return {"hits": self.hits, "misses": self.misses, "entries": entries, "bytes": size}


def clip_frames(frames: Any) -> np.ndarray:
    """A clip's frames as one ``[t, height, width, 3]`` uint8 RGB array: from a list of PIL images
    of one size, or such an array; ``ValueError`` for anything else."""
    if isinstance(frames, (list, tuple)):
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise ValueError("a clip is a non-empty list of PIL images or a [t, height, width, 3] uint8 array")
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"a clip's frames must have one size, got {sorted(sizes)}")
        return np.stack([np.asarray(f.convert("RGB")) for f in frames])
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or not frames.shape[0]:
        raise ValueError("a clip is a non-empty list of PIL images or a [t, height, width, 3] uint8 array, got "
                         f"{type(frames).__name__} of shape {list(getattr(frames, 'shape', []))}")
    if frames.dtype != np.uint8:
        raise ValueError(f"a clip's frames must be uint8 RGB, got {frames.dtype}")
    return np.ascontiguousarray(frames)


def check_fps(fps: Any) -> float:
    """A clip's frame rate (its frames' rate as given, after any sampling): a finite number > 0."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a finite number of frames per second > 0, got {fps!r}")
    return float(fps)


def encode_clip(frames: Any, fps: float, encoder: VisionEncoder) -> VisionRows:
    """``encoder.clip`` applied to the frames (``clip_frames``) at ``fps``, checked by
    ``as_vision_rows``: rows and a clip's grid."""
    clip = getattr(encoder, "clip", None)
    if clip is None:
        raise ValueError(f"this encoder ({type(encoder).__name__}) encodes images only: a clip needs one "
                         "with .clip(frames, fps), such as vlm.QwenVLEncoder")
    out = as_vision_rows(clip(clip_frames(frames), check_fps(fps)), getattr(encoder, "merge_size", None))
    if out.grid is None or not out.grid.video:
        raise ValueError("the encoder's clip() must give VisionRows with a video grid (segments.Grid, video=True)")
    return out


def image_digest(image: Image.Image) -> str:
    h = hashlib.sha256(f"{image.mode}{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _region_key(region: Any, image: Image.Image) -> tuple:
    if region is None:
        return ("image",)
    if is_mask(region):
        mask = check_mask(region)
        return ("mask", mask.shape, hashlib.sha256(np.packbits(mask).tobytes()).hexdigest())
    return ("box", to_pixel_box(region, *image.size))


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
            raise ValueError(f"cannot load an image from {text[:60]!r}: not a file, "
                             "nor base64 image data") from None
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
        if (tower_weights is None or projector_weights is None) and not allow_random:
            raise ValueError(
                "OpenClipEncoder needs tower_weights and projector_weights from your checkpoint; "
                "pass allow_random=True to use random weights (for tests only)"
            )
        if tokens not in ("patches", "pooled"):
            raise ValueError(f"tokens must be 'patches' or 'pooled', got {tokens!r}")
        import open_clip  # ~0.7 s of imports, paid by the programs that build this encoder only

        model, _, self.preprocess = open_clip.create_model_and_transforms(model_name,
                                                                          pretrained=None)
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
            warnings.warn("OpenClipEncoder uses random weights: its spans carry no meaning",
                          stacklevel=2)
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
    state = load_file(str(path))
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    load_state(module, state, str(path))


def load_state(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``module.load_state_dict(state)``, every mismatch a ``ValueError`` that starts with
    ``what``."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{what}: {e}") from None
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")


# What a vision half may compute in (``load_encoder(dtype=...)``); its rows come back float32
VISION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vision_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``dtype`` (a name of ``VISION_DTYPES``, one of its values, or None: float32) as a torch
    dtype; ``ValueError`` naming the choices otherwise."""
    if dtype is None:
        return torch.float32
    if dtype in VISION_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in VISION_DTYPES:
        return VISION_DTYPES[dtype]
    raise ValueError(f"a vision half computes in one of {sorted(VISION_DTYPES)}, got {dtype!r}")


def note_dtype(digest: "hashlib._Hash", dtype: torch.dtype) -> None:
    """Adds ``dtype`` to an identity's digest where it is not float32 (other rows, another cache
    entry; float32 identities stay as they were)."""
    if dtype != torch.float32:
        digest.update(f"\ndtype {dtype}".encode())
