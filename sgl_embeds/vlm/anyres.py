"""The vision half of a LLaVA-NeXT or LLaVA-OneVision checkpoint: any-resolution tiling.

``AnyresEncoder(DST/vision)`` (also ``load_encoder``) gives an image's rows in HF's order: the
checkpoint's own image processor (transformers'), its tower built by transformers from the saved
``vision_config``, the projector, then ``tiling.Tiling.pack``. ``checkpoint_settings`` reads what
``split`` saves (``AnyresConfig``) and refuses, by name, what the encoder could not reproduce
exactly (docs/vision-encoders.md, section 6).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoProcessor
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.llava_next.image_processing_llava_next import LlavaNextImageProcessor
from transformers.models.llava_next.image_processing_pil_llava_next import (
    LlavaNextImageProcessorPil,
)
from transformers.models.llava_onevision.image_processing_llava_onevision import (
    LlavaOnevisionImageProcessor,
)
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from sgl_embeds.vlm.files import ANYRES_FORMAT as FORMAT
from sgl_embeds.vlm.pixels import BACKENDS
from sgl_embeds.vlm.tiling import Tiling
from sgl_embeds.vision import note_dtype, vision_dtype
from sgl_embeds.vlm.tower import ACTIVATIONS, Projector, place_vision_half, read_vision_dir
from sgl_embeds_protocol.family import family_of

# model_type -> the image processors (torchvision, PIL) whose tiling the encoder reproduces
IMAGE_PROCESSORS = {
    "llava_next": (LlavaNextImageProcessor, LlavaNextImageProcessorPil),
    "llava_onevision": (LlavaOnevisionImageProcessor, LlavaOnevisionImageProcessorPil),
}
# Each tower type and the one feature-selection strategy its tiles can be laid out with: CLIP's
# class token is dropped ("default"), SigLIP has none ("full"). HF's pack_image_features fails on
# the other pairs (a tile's rows would not make a grid x grid square).
TOWER_STRATEGY = {"clip_vision_model": "default", "siglip_vision_model": "full"}
_ASPECT_RATIO = re.compile(r"anyres_max_([1-9][0-9]*)")


@dataclass(frozen=True)
class AnyresConfig:
    """Everything ``AnyresEncoder`` needs but the weights and the image processor's settings."""

    family: str  # the checkpoint's model_type: "llava_next" or "llava_onevision"
    vision_config: dict  # the tower's config, as transformers saves it
    feature_layers: tuple[int, ...]  # HF hidden-state indices, concatenated in this order
    select_strategy: str
    projector_act: str
    projector_bias: bool
    llm_hidden_size: int
    pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels
    vision_aspect_ratio: str | None  # OneVision's "anyres_max_N"; None on LLaVA-NeXT
    image_token: str
    image_token_id: int

    def __post_init__(self) -> None:
        if self.family not in IMAGE_PROCESSORS:
            raise ValueError(f"model_type {self.family!r} is not an any-resolution LLaVA: use one "
                             f"of {list(IMAGE_PROCESSORS)}")
        tower = self.vision_config.get("model_type")
        if tower not in TOWER_STRATEGY:
            raise ValueError(f"vision_config.model_type is {tower!r}: only the towers "
                             f"{list(TOWER_STRATEGY)} are supported")
        if self.select_strategy != TOWER_STRATEGY[tower]:
            raise ValueError(f"vision_feature_select_strategy={self.select_strategy!r} with a "
                             f"{tower} tower is not supported: its tiles are laid out with "
                             f"{TOWER_STRATEGY[tower]!r} only")
        if (family_of(self.family).tiling == "anyres_max") != (self.vision_aspect_ratio is not None):
            raise ValueError("vision_aspect_ratio goes with llava_onevision checkpoints only")
        if self.vision_aspect_ratio is not None and not _ASPECT_RATIO.fullmatch(
                self.vision_aspect_ratio):
            raise ValueError(f"vision_aspect_ratio={self.vision_aspect_ratio!r} is not "
                             "supported: only 'anyres_max_N' (N tiles' features at most)")
        if self.projector_act not in ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_act!r} is not supported: use "
                             f"one of {list(ACTIVATIONS)}")
        n = self.vision_config["num_hidden_layers"]
        for layer in self.feature_layers:
            if not -(n + 1) <= layer <= n:
                raise ValueError(f"vision_feature_layer {layer} is outside the tower's hidden "
                                 f"states [-{n + 1}, {n}]")
        tile = self.vision_config["image_size"]
        for pinpoint in self.pinpoints:
            if len(pinpoint) != 2 or any(side <= 0 or side % tile for side in pinpoint):
                raise ValueError(f"image_grid_pinpoints entry {list(pinpoint)} is not a "
                                 f"(height, width) in whole tiles of {tile} px")

    @property
    def projector_width(self) -> int:
        """The projector's input width: the tower's, once per feature layer."""
        return self.vision_config["hidden_size"] * len(self.feature_layers)

    @property
    def tiling(self) -> Tiling:
        v = self.vision_config
        max_tiles = None
        if self.vision_aspect_ratio is not None:
            max_tiles = int(_ASPECT_RATIO.fullmatch(self.vision_aspect_ratio).group(1))
        return Tiling(v["image_size"], v["image_size"] // v["patch_size"], self.pinpoints, max_tiles)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> AnyresConfig:
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not an sgl_embeds any-resolution vision config (expected format "
                             f"{FORMAT!r})")
        return cls(**{**d, "feature_layers": tuple(d["feature_layers"]),
                      "pinpoints": tuple(tuple(p) for p in d["pinpoints"])})


def check_image_processor(family: str, processor: object) -> None:
    """The image processor is the family's own (either backend): its tiling is the one
    ``tiling.Tiling`` lays out."""
    if not isinstance(processor, IMAGE_PROCESSORS[family]):
        names = [c.__name__ for c in IMAGE_PROCESSORS[family]]
        raise ValueError(f"the image processor is a {type(processor).__name__}: a {family} "
                         f"checkpoint needs one of {names}")


def checkpoint_settings(src: Path, config, projector_bias: bool) -> tuple[AnyresConfig, object]:
    """The settings of the LLaVA-NeXT / LLaVA-OneVision checkpoint ``src`` (``config``: its
    ``AutoConfig``) and its image processor, checked against each other: both tile alike and
    count the same rows per image (``split`` saves both to ``DST/vision``)."""
    family = config.model_type
    processor = AutoProcessor.from_pretrained(src)
    image_processor = processor.image_processor
    check_image_processor(family, image_processor)
    max_tiles = family_of(family).tiling == "anyres_max"  # OneVision: features of N tiles at most
    layers = config.vision_feature_layer
    vision = AnyresConfig(
        family=family, vision_config=config.vision_config.to_dict(),
        feature_layers=tuple([layers] if isinstance(layers, int) else layers),
        select_strategy=config.vision_feature_select_strategy,
        projector_act=config.projector_hidden_act,
        projector_bias=projector_bias,
        llm_hidden_size=config.text_config.hidden_size,
        pinpoints=tuple(tuple(p) for p in config.image_grid_pinpoints),
        vision_aspect_ratio=config.vision_aspect_ratio if max_tiles else None,
        image_token=processor.image_token, image_token_id=config.image_token_id,
    )
    pairs = [("image_grid_pinpoints", image_processor.image_grid_pinpoints, config.image_grid_pinpoints),
             ("vision_feature_select_strategy", processor.vision_feature_select_strategy,
              vision.select_strategy),
             ("image_token_id", processor.image_token_id, vision.image_token_id)]
    if max_tiles:
        pairs.append(("vision_aspect_ratio", processor.vision_aspect_ratio, vision.vision_aspect_ratio))
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"the processor's {name} {theirs!r} differs from the model config's "
                             f"{ours!r}")
    _check_tiles(image_processor, vision.tiling)
    _check_rows(processor, vision.tiling)
    return vision, image_processor


def _check_tiles(image_processor, tiling: Tiling) -> None:
    """The image processor cuts an image into the tiles the tower and ``tiling`` expect."""
    height, width = tiling.pinpoints[0]
    pixels = image_processor(images=[Image.new("RGB", (width, height))],
                             return_tensors="pt")["pixel_values"][0]
    tiles_h, tiles_w = tiling.tiles(height, width)
    want = (1 + tiles_h * tiles_w, 3, tiling.tile, tiling.tile)
    if tuple(pixels.shape) != want:
        raise ValueError(f"the image processor makes {list(pixels.shape)} pixel values of a "
                         f"{width}x{height} image, the tower takes {list(want)} (1 base tile + "
                         f"{tiles_h}x{tiles_w} tiles of {tiling.tile} px): check its size and "
                         "crop_size")


def _check_rows(processor, tiling: Tiling) -> None:
    """The processor expands the image token to ``tiling.rows_for`` rows, at every pinpoint and
    at sizes between them (``_get_num_multimodal_tokens``: the count its ``__call__`` expands the
    token to, without processing images)."""
    tile = tiling.tile
    sizes = [*tiling.pinpoints, (tile // 2 + 1, 3 * tile), (3 * tile, tile // 3 + 1), (7, 5)]
    counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    for (height, width), count in zip(sizes, counts):
        if count != tiling.rows_for(width, height):
            raise ValueError(f"the processor expands {processor.image_token!r} into {count} "
                             f"tokens for a {width}x{height} image but the tiles give "
                             f"{tiling.rows_for(width, height)} rows (check "
                             "num_additional_image_tokens, patch_size and num_image_tokens)")


class AnyresEncoder:
    """The vision half of a split LLaVA-NeXT / LLaVA-OneVision checkpoint (module docstring).

    ``backend``: the image processor's transformers backend, ``"torchvision"`` or ``"pil"``
    (default: what ``AutoImageProcessor.from_pretrained`` picks); ``device``: cuda when available.
    """

    def __init__(self, vision_dir: str | Path, backend: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
        self.dtype = vision_dtype(dtype)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        text, weights, digest = read_vision_dir(vision_dir)
        self.config = AnyresConfig.from_json(text)
        self.tiling = self.config.tiling
        self.processor = AutoImageProcessor.from_pretrained(
            vision_dir, **({} if backend is None else {"backend": backend}))
        check_image_processor(self.config.family, self.processor)
        self.backend = "torchvision" if isinstance(self.processor, TorchvisionBackend) else "pil"

        vision = AutoConfig.for_model(**self.config.vision_config)
        self.tower = AutoModel.from_config(vision)
        self.projector = Projector(self.config)
        self.device = place_vision_half(self.tower, self.projector, weights, f"{vision_dir}: ", device,
                                        self.dtype)
        digest.update(f"{self.backend}\n{self.processor.to_json_string()}".encode())
        note_dtype(digest, self.dtype)
        self.identity = f"{self.config.family}-{digest.hexdigest()[:16]}"  # for encoder caches
        self.image_newline = weights["image_newline"].to(self.device, self.dtype)  # [llm_hidden]

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def span_width(self) -> int:
        return self.config.llm_hidden_size

    @property
    def image_token(self) -> str:
        return self.config.image_token

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour that normalizes to (nearly) zero: what masked-out pixels become."""
        return tuple(int(round(m * 255)) for m in self.processor.image_mean)

    def rows_for(self, width: int, height: int) -> int:
        """How many rows (image tokens in HF's prompt) an image of this size becomes."""
        return self.tiling.rows_for(width, height)

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """``[1 + tiles, 3, tile, tile]``: the base tile and the tiles the checkpoint's image
        processor makes of ``image``."""
        (pixels,) = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        return pixels

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor, width: int, height: int) -> torch.Tensor:
        """``[rows_for(width, height), llm_hidden]`` float32 CPU rows of an image of this size
        from its ``pixel_values``."""
        out = self.tower(pixel_values.to(self.device, self.dtype), output_hidden_states=True)
        selected = torch.cat([out.hidden_states[i] for i in self.config.feature_layers], dim=-1)
        if self.config.select_strategy == "default":
            selected = selected[:, 1:]  # the class token
        rows = self.tiling.pack(self.projector(selected), height, width, self.image_newline)
        return rows.float().cpu()

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.features(self.pixel_values(image), image.width, image.height)
