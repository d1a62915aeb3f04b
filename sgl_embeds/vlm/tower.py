"""A LLaVA vision half in open_clip: CLIP tower + feature-layer selection + MLP projector.

``LlavaEncoder`` (``PIL.Image -> [rows, llm_hidden]``) gives the rows a LLaVA checkpoint feeds its
language model for one image: the checkpoint's image processing (``pixels.py``), an open_clip
tower carrying its CLIP weights (``clip_to_open_clip`` maps the names), the hidden states of
``VisionConfig.feature_layers`` and the projector ``linear_1 -> act -> linear_2``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from open_clip.transformer import LayerNorm, QuickGELU, VisionTransformer
from PIL import Image
from safetensors.torch import load_file

from sgl_embeds.vision import load_state, note_dtype, vision_dtype
from sgl_embeds.vlm.files import CONFIG_NAME, WEIGHTS_NAME
from sgl_embeds.vlm.files import LLAVA_FORMAT as FORMAT
from sgl_embeds.vlm.pixels import ImageProcessing


# HF activation names (``hidden_act``, ``projector_hidden_act``) -> a module factory.
ACTIVATIONS: dict[str, Callable[[], torch.nn.Module]] = {
    "quick_gelu": QuickGELU,
    "gelu": torch.nn.GELU,
    "gelu_pytorch_tanh": partial(torch.nn.GELU, approximate="tanh"),
    "gelu_new": partial(torch.nn.GELU, approximate="tanh"),
    "relu": torch.nn.ReLU,
    "silu": torch.nn.SiLU,
}


@dataclass(frozen=True)
class TowerGeometry:
    image_size: int
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_width: int
    act: str
    layer_norm_eps: float

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class VisionConfig:
    """Everything ``load_llava_encoder`` needs but the weights (``sgl_embeds_vision.json``)."""

    tower: TowerGeometry
    feature_layers: tuple[int, ...]  # HF hidden-state indices, concatenated in this order
    select_strategy: str  # "default" drops the class token, "full" keeps it
    projector_act: str
    projector_bias: bool
    llm_hidden_size: int
    processing: ImageProcessing
    image_token: str
    image_token_id: int

    def __post_init__(self) -> None:
        if self.select_strategy not in ("default", "full"):
            raise ValueError("vision_feature_select_strategy must be 'default' or 'full', "
                             f"got {self.select_strategy!r}")
        for name, act in (("tower activation", self.tower.act), ("projector_hidden_act", self.projector_act)):
            if act not in ACTIVATIONS:
                raise ValueError(f"{name} {act!r} is not supported: use one of {list(ACTIVATIONS)}")
        n = self.tower.layers
        for layer in self.feature_layers:
            if not -(n + 1) <= layer <= n:
                raise ValueError(f"vision_feature_layer {layer} is outside the tower's hidden "
                                 f"states [-{n + 1}, {n}]")
            if layer % (n + 1) == 0:
                raise ValueError("vision_feature_layer 0 (the patch embeddings, before any block) "
                                 "is not supported")

    @property
    def rows_per_image(self) -> int:
        return self.tower.grid ** 2 + (1 if self.select_strategy == "full" else 0)

    @property
    def projector_width(self) -> int:
        """The projector's input width: the tower's, once per feature layer."""
        return self.tower.width * len(self.feature_layers)

    @property
    def blocks(self) -> list[int]:
        """open_clip block index of each feature layer (HF hidden state k is the output of block k-1).

        ``feature_layers`` are HF's ``vision_feature_layer`` indices: 0 is the embeddings after
        the pre-norm, ``-2`` the output of the second to last block."""
        n = self.tower.layers
        return [(layer % (n + 1)) - 1 for layer in self.feature_layers]

    def to_json(self) -> str:
        d = asdict(self)
        d["processing"] = self.processing.to_dict()
        return json.dumps({"format": FORMAT, "rows_per_image": self.rows_per_image, **d}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "VisionConfig":
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not an sgl_embeds LLaVA vision config (expected format {FORMAT!r})")
        d.pop("rows_per_image", None)
        return cls(
            tower=TowerGeometry(**d.pop("tower")), feature_layers=tuple(d.pop("feature_layers")),
            processing=ImageProcessing.from_dict(d.pop("processing")), **d,
        )


def build_tower(geometry: TowerGeometry) -> torch.nn.Module:
    """An open_clip ``VisionTransformer`` of this geometry (random weights, no output projection)."""
    tower = VisionTransformer(
        image_size=geometry.image_size, patch_size=geometry.patch_size, width=geometry.width,
        layers=geometry.layers, heads=geometry.heads, mlp_ratio=geometry.mlp_width / geometry.width,
        output_dim=geometry.width, act_layer=ACTIVATIONS[geometry.act],
        norm_layer=partial(LayerNorm, eps=geometry.layer_norm_eps),
    )
    built = tower.transformer.resblocks[0].mlp.c_fc.out_features
    if built != geometry.mlp_width:
        raise ValueError(f"open_clip builds an MLP of width {built} for this tower, the checkpoint "
                         f"has {geometry.mlp_width}")
    tower.proj = None  # LLaVA reads hidden states; CLIP's contrastive projection is not used
    return tower


class ProjectorConfig(Protocol):
    """What ``Projector`` reads of a vision config."""

    projector_width: int
    llm_hidden_size: int
    projector_act: str
    projector_bias: bool


class Projector(torch.nn.Module):
    """LLaVA's ``multi_modal_projector``: ``linear_1 -> act -> linear_2`` (the same weight names),
    as ``config`` (``VisionConfig``, or ``anyres.AnyresConfig``) describes it."""

    def __init__(self, config: ProjectorConfig):
        super().__init__()
        width, hidden = config.projector_width, config.llm_hidden_size
        self.linear_1 = torch.nn.Linear(width, hidden, bias=config.projector_bias)
        self.act = ACTIVATIONS[config.projector_act]()
        self.linear_2 = torch.nn.Linear(hidden, hidden, bias=config.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


# HF CLIP vision names (after the ``vision_model.`` prefix) -> open_clip names.
_CLIP_NAMES = {
    "embeddings.patch_embedding.weight": "conv1.weight",
    "embeddings.class_embedding": "class_embedding",
    "embeddings.position_embedding.weight": "positional_embedding",
    "pre_layrnorm.weight": "ln_pre.weight", "pre_layrnorm.bias": "ln_pre.bias",
    "post_layernorm.weight": "ln_post.weight", "post_layernorm.bias": "ln_post.bias",
}
_CLIP_LAYER_NAMES = {
    "layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
_IGNORED = ("embeddings.position_ids",)


def clip_to_open_clip(hf: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """HF ``CLIPVisionModel`` weights (keys without the ``vision_model.`` prefix) as an open_clip
    ``VisionTransformer`` state dict; q/k/v projections become one ``in_proj``. Unknown keys raise."""
    out: dict[str, torch.Tensor] = {}
    used = set(_IGNORED)
    for hf_name, oc_name in _CLIP_NAMES.items():
        if hf_name in hf:
            out[oc_name] = hf[hf_name]
            used.add(hf_name)
    for i in range(layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for hf_part, oc_part in _CLIP_LAYER_NAMES.items():
            for p in ("weight", "bias"):
                key = f"{src}{hf_part}.{p}"
                if key in hf:
                    out[f"{dst}{oc_part}.{p}"] = hf[key]
                    used.add(key)
        for p in ("weight", "bias"):
            qkv = [f"{src}self_attn.{n}_proj.{p}" for n in "qkv"]
            missing = [k for k in qkv if k not in hf]
            if missing:
                raise ValueError(f"CLIP tower weight {missing[0]!r} is missing")
            out[f"{dst}attn.in_proj_{p}"] = torch.cat([hf[k] for k in qkv])
            used.update(qkv)
    unknown = sorted(k for k in hf if k not in used)
    if unknown:
        raise ValueError(f"CLIP tower weight {unknown[0]!r} has no open_clip counterpart "
                         f"({len(unknown)} unmapped; is this a CLIP ViT?)")
    return out


class ImageTextOfSettings:
    """For an encoder whose settings (``self.config``) say how its processor writes an image
    (``image_text``) and which bos its chat template writes first (``bos_token``): the two that
    ``connect``'s chat template reads (Gemma 3, Gemma 4)."""

    @property
    def image_text(self) -> Any:
        """How the processor writes an image (a ``family.ImageText``): ``connect``'s chat
        template writes an image part so."""
        return self.config.image_text

    @property
    def bos_token(self) -> str:
        """The bos the chat template writes first and the server writes instead."""
        return self.config.bos_token


def place_vision_half(tower: torch.nn.Module, projector: torch.nn.Module, weights: dict[str, torch.Tensor],
                      where: str, device: str | torch.device | None,
                      dtype: torch.dtype = torch.float32) -> torch.device:
    """Loads ``tower.*`` and ``projector.*`` of a split checkpoint's ``weights`` into the two
    modules (a mismatch: ``ValueError`` naming ``where``), moves them to ``device`` (default: CUDA
    when there is one) and ``dtype`` in eval mode, and returns that device. The modules take
    ``dtype`` before the weights (``from_config`` may build them in the config's dtype, whose
    copy of float32 weights would lose bits)."""
    for name, module in (("tower", tower), ("projector", projector)):
        module.to(dtype)
        prefix = name + "."
        state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        load_state(module, state, f"{where}{name} weights")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tower.to(device).eval()
    projector.to(device).eval()
    return device


class LlavaEncoder:
    """The vision half of a split LLaVA checkpoint (see ``load_llava_encoder``)."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor], identity: str,
                 device: str | torch.device | None = None, dtype: torch.dtype = torch.float32):
        self.config = config
        self.identity = identity  # names the weights, settings and dtype, for encoder-output caches
        self.tower = build_tower(config.tower)
        self.projector = Projector(config)
        self.dtype = dtype
        self.device = place_vision_half(self.tower, self.projector, weights, "", device, dtype)

    # what the server it fits serves (sgl_embeds.connect checks it)
    family = "llava"

    @property
    def span_width(self) -> int:
        return self.config.llm_hidden_size

    @property
    def image_token(self) -> str:
        return self.config.image_token

    @property
    def rows_per_image(self) -> int:
        return self.config.rows_per_image

    @property
    def mean_color(self) -> tuple[int, int, int]:
        return self.config.processing.mean_color

    def rows_for(self, width: int, height: int) -> int:
        """How many rows an image of this size becomes: ``rows_per_image``, whatever its size."""
        return self.config.rows_per_image

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """``[3, H, W]``: what the checkpoint's image processor gives for ``image``."""
        return self.config.processing(image)

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[batch, rows, llm_hidden]`` projected features of ``[batch, 3, H, W]`` pixels."""
        blocks = self.config.blocks
        out = self.tower.forward_intermediates(
            pixel_values.to(self.device, self.dtype), indices=sorted(set(blocks)), stop_early=True,
            intermediates_only=True, output_fmt="NLC", output_extra_tokens=True,
        )
        by_block = {}
        full = self.config.select_strategy == "full"  # keep the class token
        for b, patches, cls in zip(sorted(set(blocks)), out["image_intermediates"],
                                   out["image_intermediates_prefix"]):
            by_block[b] = torch.cat([cls, patches], dim=1) if full else patches
        return self.projector(torch.cat([by_block[b] for b in blocks], dim=-1))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.features(self.pixel_values(image).unsqueeze(0))[0].float().cpu()


def read_vision_dir(vision_dir: str | Path) -> tuple[str, dict[str, torch.Tensor], "hashlib._Hash"]:
    """What ``split`` wrote to ``DST/vision``: the settings (the text of ``CONFIG_NAME``), the
    weights, and a SHA-256 of both that an encoder's ``identity`` is made from."""
    vision_dir = Path(vision_dir)
    config_path, weights_path = vision_dir / CONFIG_NAME, vision_dir / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: is {vision_dir} the vision/ folder of a "
                                    "split checkpoint?")
    text = config_path.read_text()
    digest = hashlib.sha256(text.encode())
    with open(weights_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return text, load_file(str(weights_path)), digest


def load_llava_encoder(vision_dir: str | Path, device: str | torch.device | None = None,
                       dtype: str | torch.dtype | None = None) -> LlavaEncoder:
    """The ``VisionEncoder`` of ``DST/vision`` written by ``python -m sgl_embeds.vlm split``."""
    dtype = vision_dtype(dtype)
    text, weights, digest = read_vision_dir(vision_dir)
    note_dtype(digest, dtype)
    identity = "llava-" + digest.hexdigest()[:16]
    return LlavaEncoder(VisionConfig.from_json(text), weights, identity, device, dtype)
