"""Serve a VLM's language model with SGLang and run its vision half here, on the client.

A split family's checkpoint (LLaVA, PaliGemma, Gemma) is split: ``python -m sgl_embeds.vlm split
SRC DST`` writes ``DST/llm`` (served by SGLang with the plugin) and ``DST/vision``. A checkpoint
served whole (Qwen-VL, Florence-2) is its own vision half.
``load_encoder`` takes either and gives the ``VisionEncoder`` for ``EmbedsEndpoint(
vision_encoder=...)``. A family's code (its transformers classes among it) is imported when that
family is first used, not by ``import sgl_embeds``. See docs/vision-encoders.md.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from sgl_embeds.vlm.files import (
    ANYRES_FORMAT, CONFIG_NAME, GEMMA3_FORMAT, GEMMA4_FORMAT, LLAVA_FORMAT, PALIGEMMA_FORMAT, model_type,
)
from sgl_embeds.vlm.prompt import image_prompt, render_chat
from sgl_embeds_protocol.family import ENCODER_DECODER, FAMILIES, NATIVE, family_of


def _qwen_vl(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.qwen_vl import QwenVLEncoder  # lazy: the module docstring

    return QwenVLEncoder(path, device=device, dtype=dtype)


def _anyres(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.anyres import AnyresEncoder  # lazy: the module docstring

    return AnyresEncoder(path, device=device, dtype=dtype)


def _llava(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.tower import load_llava_encoder  # lazy: the module docstring

    return load_llava_encoder(path, device, dtype)


def _paligemma(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.paligemma import PaliGemmaEncoder  # lazy: the module docstring

    return PaliGemmaEncoder(path, device=device, dtype=dtype)


def _gemma3(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.gemma3 import Gemma3Encoder  # lazy: the module docstring

    return Gemma3Encoder(path, device=device, dtype=dtype)


def _gemma4(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.gemma4 import Gemma4Encoder  # lazy: the module docstring

    return Gemma4Encoder(path, device=device, dtype=dtype)


def _florence2(path: Path, device: str | torch.device | None, dtype: str | torch.dtype | None) -> Any:
    from sgl_embeds.vlm.florence2 import Florence2Encoder  # lazy: the module docstring

    return Florence2Encoder(path, device=device, dtype=dtype)


# The encoder of each family served whole (a checkpoint folder is its vision half): the natively
# served M-RoPE families, and the encoder-decoders
NATIVE_ENCODERS: dict[str, Callable[[Path, Any, Any], Any]] = {
    **{family.name: _qwen_vl for family in FAMILIES if family.served_as == NATIVE and family.mrope},
    **{family.name: _florence2 for family in FAMILIES if family.served_as == ENCODER_DECODER}}
# The encoder of a split family's vision/ folder, by the format its settings name
SPLIT_ENCODERS: dict[str, Callable[[Path, Any, Any], Any]] = {
    LLAVA_FORMAT: _llava, ANYRES_FORMAT: _anyres, PALIGEMMA_FORMAT: _paligemma,
    GEMMA3_FORMAT: _gemma3, GEMMA4_FORMAT: _gemma4}


def load_encoder(path: str | Path, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None) -> Any:
    """The ``VisionEncoder`` of ``path``: a native family's checkpoint directory
    (``QwenVLEncoder`` with its defaults; ``Florence2Encoder`` for Florence-2's), or the ``DST/vision`` folder ``split`` writes from a
    split one (``LlavaEncoder`` for LLaVA-1.5, ``AnyresEncoder`` for LLaVA-NeXT and
    LLaVA-OneVision, ``PaliGemmaEncoder`` for PaliGemma, ``Gemma3Encoder`` for Gemma 3), or the
    folder ``gemma4.write_vision_half`` writes (``Gemma4Encoder``). ``dtype``: what the vision half
    computes in (``"float32"``, the default, ``"bfloat16"`` or ``"float16"``); rows come back float32."""
    path = Path(path)
    found = model_type(path)
    if found in NATIVE_ENCODERS:
        return NATIVE_ENCODERS[found](path, device, dtype)
    if found is not None:
        family = family_of(found)
        why = f" ({family.refused})" if family and family.refused else ""
        raise ValueError(f"{path} is a {found!r} checkpoint{why}: load_encoder takes the checkpoint "
                         f"of a natively served family {tuple(NATIVE_ENCODERS)} or the vision/ "
                         "folder that `python -m sgl_embeds.vlm split` writes from a split one")
    settings = path / CONFIG_NAME
    found = json.loads(settings.read_text()).get("format") if settings.exists() else None
    # a folder without settings, or of another format: LlavaEncoder names what is missing
    return SPLIT_ENCODERS.get(found, _llava)(path, device, dtype)


# The rest of the package's names, from their modules, imported when first asked for
_EXPORTS = {"split": "checkpoint", "load_split_llm": "checkpoint", "LlavaEncoder": "tower", "VisionConfig": "tower",
            "AnyresEncoder": "anyres", "QwenVLEncoder": "qwen_vl", "ImageProcessing": "pixels"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["split", "load_split_llm", "load_encoder", "LlavaEncoder", "AnyresEncoder", "QwenVLEncoder",
           "VisionConfig", "ImageProcessing", "image_prompt", "render_chat"]
