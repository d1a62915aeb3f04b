"""The vision half of a Qwen-VL checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) on the client.

``QwenVLEncoder(DIR)`` (also ``load_encoder``) gives an image's ``VisionRows``: the rows HF's
``get_image_features`` puts at its pad tokens (Qwen3-VL: its deepstack rows after them along the
width) and the grid the server places them by. They are HF's by construction: the checkpoint's
own image processor and transformers' vision module of the family (``TOWERS``), loaded with only
the ``visual.*`` weights (docs/vision-encoders.md, "The vision half on the client").
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, AutoVideoProcessor
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from sgl_embeds.vision import VisionRows, load_state, vision_dtype
from sgl_embeds_protocol.family import BY_NAME
from sgl_embeds_protocol.segments import SECONDS_PER_STEP, TIMESTAMPS, Grid
from sgl_embeds.vlm.files import Tensors, weight_index
from sgl_embeds.vlm.files import model_type
from sgl_embeds.vlm.pixels import BACKENDS

# The vision module of each family, as transformers builds it from the checkpoint's vision_config
TOWERS = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel,
          "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
          "qwen3_vl": Qwen3VLVisionModel,
          "qwen3_5": Qwen3_5VisionModel,  # Qwen3-VL's tower without deepstack
          "qwen3_5_moe": Qwen3_5MoeVisionModel}  # the same tower
MODEL_TYPES = tuple(TOWERS)
# The vision weights: ``visual.*`` as transformers saves them, ``model.visual.*`` as the modules
# of ``Qwen2_5_VLForConditionalGeneration`` name them.
VISUAL_PREFIXES = ("visual.", "model.visual.")


class QwenVLEncoder:
    """The vision half of a Qwen-VL checkpoint directory (see the module docstring).

    ``backend``: the image processor's transformers backend, ``"torchvision"`` or ``"pil"``
    (default: what ``AutoImageProcessor.from_pretrained(DIR)`` picks); ``dtype``: what the tower
    computes in (the rows come back float32 either way); ``device``: cuda when available.
    """

    def __init__(self, checkpoint: str | Path, backend: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
        dtype = vision_dtype(dtype)
        checkpoint = Path(checkpoint)
        found = model_type(checkpoint)
        if found not in TOWERS:
            raise ValueError(f"{checkpoint}/config.json: model_type is {found!r}, not one of "
                             f"{MODEL_TYPES} (the Qwen-VL families whose vision half runs here)")
        self.family = found  # the server it fits serves this model_type (sgl_embeds.connect)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        config = AutoConfig.from_pretrained(checkpoint)
        self.processor = AutoImageProcessor.from_pretrained(
            checkpoint, **({} if backend is None else {"backend": backend}))
        self.backend = "torchvision" if isinstance(self.processor, TorchvisionBackend) else "pil"
        _check_processor(self.processor, config.vision_config)
        self.merge_size: int = config.vision_config.spatial_merge_size

        ids = [config.vision_start_token_id, config.vision_end_token_id, config.image_token_id]
        tokens = AutoTokenizer.from_pretrained(checkpoint).convert_ids_to_tokens(ids)
        if None in tokens:
            raise ValueError(f"{checkpoint}: the tokenizer has no token for the config's vision "
                             f"start, vision end and image token ids {ids}")
        # what a prompt writes around the span, and the pad the chat template puts between them
        self.vision_start, self.vision_end, self.image_token = tokens

        # clips (``clip``): the checkpoint's own video processor, loaded when first needed
        self._checkpoint, self._video_processor = checkpoint, None
        self.temporal_patch_size: int = config.vision_config.temporal_patch_size

        weights = visual_weights(checkpoint)
        self.dtype = dtype
        self.tower = TOWERS[found](config.vision_config).to(dtype)
        self.deepstack_layers = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
        # an image's span: its rows, then each deepstack layer's, along the width
        self.span_width: int = config.text_config.hidden_size * (1 + self.deepstack_layers)
        load_state(self.tower, weights, f"{checkpoint}: vision weights")
        settings = {"vision_config": config.vision_config.to_dict(),
                    "processor": self.processor.to_dict(), "backend": self.backend,
                    "dtype": str(dtype)}
        self.identity = _identity(found, settings, weights)  # for encoder-output caches
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tower.to(self.device).eval()

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour that normalizes to (nearly) zero: what masked-out pixels become."""
        return tuple(int(round(m * 255)) for m in self.processor.image_mean)

    def rows_for(self, width: int, height: int) -> int:
        """How many rows (pad tokens in HF's prompt) an image of this size becomes."""
        return self.processor.get_number_of_image_patches(height, width) // self.merge_size**2

    def pixel_values(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``([patches, channels * temporal_patch * patch**2], (t, h, w))``: what the checkpoint's
        image processor gives for ``image``."""
        out = self.processor(images=[image], return_tensors="pt")
        (grid,) = out["image_grid_thw"].tolist()
        return out["pixel_values"], tuple(grid)

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[t*h*w / merge**2, width]`` float32 CPU rows of one image's patches (Qwen3-VL: the
        deepstack layers' rows after the main ones)."""
        grid_thw = torch.tensor([grid], device=self.device)
        out = self.tower(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw)
        deepstack = list(getattr(out, "deepstack_features", None) or [])
        return torch.cat([out.pooler_output, *deepstack], dim=1).float().cpu()

    def __call__(self, image: Image.Image) -> VisionRows:
        pixel_values, grid = self.pixel_values(image)
        return VisionRows(self.features(pixel_values, grid), Grid(grid))

    def clip(self, frames: np.ndarray, fps: float) -> VisionRows:
        """A clip's rows (``[t*h*w / merge**2, width]``, frame after frame, as HF's
        ``get_video_features`` gives them) and its video grid with the time the family reads:
        ``frames`` ``[n, height, width, 3]`` uint8 (``vision.clip_frames``), sampled at ``fps``
        frames per second. The checkpoint's video processor groups ``temporal_patch_size``
        frames per temporal step (the last one repeated to fill a step)."""
        if self._video_processor is None:
            self._video_processor = AutoVideoProcessor.from_pretrained(self._checkpoint)
        out = self._video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
        (thw,) = out["video_grid_thw"].tolist()
        rows = self.features(out["pixel_values_videos"], tuple(thw))
        return VisionRows(rows, Grid(tuple(thw), video=True, **clip_time(self.family, len(frames), fps,
                                                                         self.temporal_patch_size)))


def clip_time(model_type: str, n_frames: int, fps: float, temporal_patch: int) -> dict:
    """A clip's time as the family's processor writes it (``segments.Grid`` fields; the family's
    ``clip_time``): ``second_per_grid_t`` = seconds per temporal step (Qwen2.5-VL); ``timestamps``,
    each step's time: the mean of its first and last frame's, the last frame repeated to fill a
    step (Qwen3-VL's processor); none (Qwen2-VL: its steps are 1 position apart)."""
    wanted = BY_NAME[model_type].clip_time
    if wanted == SECONDS_PER_STEP:
        return {"second_per_grid_t": temporal_patch / fps}
    if wanted == TIMESTAMPS:
        frames = list(range(n_frames)) + [n_frames - 1] * (-n_frames % temporal_patch)
        seconds = [frame / fps for frame in frames]  # HF's order of operations, for its rounding
        return {"timestamps": tuple((seconds[i] + seconds[i + temporal_patch - 1]) / 2
                                    for i in range(0, len(seconds), temporal_patch))}
    return {}


def _check_processor(processor: object, vision_config: object) -> None:
    """The image processor is a Qwen2-VL one that patchifies as the tower expects."""
    if not isinstance(processor, (Qwen2VLImageProcessor, Qwen2VLImageProcessorPil)):
        raise ValueError(f"the image processor is a {type(processor).__name__}, not a "
                         "Qwen2VLImageProcessor")
    if not processor.do_resize:
        raise ValueError("image processor do_resize=False is not supported: images must be "
                         "resized to multiples of patch_size * merge_size")
    pairs = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
             ("merge_size", "spatial_merge_size"))
    for ours, theirs in pairs:
        if getattr(processor, ours) != getattr(vision_config, theirs):
            raise ValueError(f"image processor {ours}={getattr(processor, ours)} differs from "
                             f"vision_config.{theirs}={getattr(vision_config, theirs)}")


def visual_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's vision weights under the vision module's names (prefix removed)."""
    index = weight_index(checkpoint)
    tensors = Tensors(index)
    weights: dict[str, torch.Tensor] = {}
    for key in index:
        prefix = next((p for p in VISUAL_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            continue
        name = key[len(prefix):]
        if name in weights:
            raise ValueError(f"{checkpoint}: vision weight {name!r} is there under both "
                             f"{VISUAL_PREFIXES}")
        weights[name] = tensors[key]
    return weights


def _identity(family: str, settings: dict, weights: dict[str, torch.Tensor]) -> str:
    """A name for these settings and weights: equal encoders share encoder-cache entries."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for name in sorted(weights):
        t = weights[name]
        digest.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return f"{family}-{digest.hexdigest()[:16]}"
