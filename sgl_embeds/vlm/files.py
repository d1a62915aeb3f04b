"""The files ``load_encoder`` picks an encoder by, named once for the encoders that read them:
a checkpoint's ``config.json`` (``model_type``) and what ``split`` writes in ``DST/vision``."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "sgl_embeds_vision.json"  # the vision half's settings
WEIGHTS_NAME = "model.safetensors"  # tower, projector (and image_newline)
LLAVA_FORMAT = "sgl_embeds.llava_vision/1"  # LLaVA-1.5: tower.VisionConfig
ANYRES_FORMAT = "sgl_embeds.llava_anyres_vision/1"  # LLaVA-NeXT / OneVision: anyres.AnyresConfig
PALIGEMMA_FORMAT = "sgl_embeds.paligemma_vision/1"  # PaliGemma 1 and 2: paligemma.PaliGemmaVision
GEMMA3_FORMAT = "sgl_embeds.gemma3_vision/1"  # Gemma 3: gemma3.Gemma3Vision
GEMMA4_FORMAT = "sgl_embeds.gemma4_vision/1"  # Gemma 4 (vision half only): gemma4.Gemma4Vision


def model_type(path: str | Path) -> str | None:
    """The ``model_type`` of the HF checkpoint at ``path``; None where there is no config.json."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.exists() else None
