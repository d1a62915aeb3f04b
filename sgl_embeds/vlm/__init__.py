"""Serve a VLM's language model with SGLang and run its vision half here, on the client.

A LLaVA-style VLM (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision) is split: ``python -m sgl_embeds.vlm
split SRC DST`` writes ``DST/llm`` (serve it with SGLang and the plugin) and ``DST/vision``. A
Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: M-RoPE) is served whole, natively, and its
checkpoint directory is the vision half's too. ``load_encoder`` takes either (``DST/vision``, or
the Qwen-VL directory) and gives the
``VisionEncoder`` to hand to ``EmbedsEndpoint(vision_encoder=...)``, so ``sgl.image(img)`` and
``sgl.region(box)`` put exactly the rows the VLM would feed its LLM (on Qwen-VL with the
image's grid). ``image_prompt`` places images where the checkpoint's prompt format puts its image
token. See docs/vision-encoders.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sgl_embeds.vlm import anyres, qwen_vl
from sgl_embeds.vlm.anyres import AnyresEncoder
from sgl_embeds.vlm.checkpoint import split
from sgl_embeds.vlm.pixels import ImageProcessing
from sgl_embeds.vlm.prompt import image_prompt, render_chat
from sgl_embeds.vlm.qwen_vl import QwenVLEncoder
from sgl_embeds.vlm.tower import CONFIG_NAME, LlavaEncoder, VisionConfig, load_llava_encoder
from sgl_embeds_srt.family import family_of

# The encoder of each natively served family (a checkpoint folder is its vision half)
NATIVE_ENCODERS = {name: QwenVLEncoder for name in qwen_vl.TOWERS}


def load_encoder(path: str | Path, device: str | torch.device | None = None
                 ) -> LlavaEncoder | AnyresEncoder | QwenVLEncoder:
    """The ``VisionEncoder`` of ``path``: a Qwen-VL checkpoint directory (``QwenVLEncoder``
    with its defaults), or the ``DST/vision`` folder ``split`` writes from a LLaVA one
    (``LlavaEncoder`` for LLaVA-1.5, ``AnyresEncoder`` for LLaVA-NeXT and LLaVA-OneVision)."""
    path = Path(path)
    found = qwen_vl.model_type(path)
    if found in NATIVE_ENCODERS:
        return NATIVE_ENCODERS[found](path, device=device)
    if found is not None:
        family = family_of(found)
        why = f" ({family.refused})" if family and family.refused else ""
        raise ValueError(f"{path} is a {found!r} checkpoint{why}: load_encoder takes the checkpoint "
                         f"of a natively served family {tuple(NATIVE_ENCODERS)} or the vision/ "
                         "folder that `python -m sgl_embeds.vlm split` writes from a split one")
    config = path / CONFIG_NAME
    if config.exists() and json.loads(config.read_text()).get("format") == anyres.FORMAT:
        return AnyresEncoder(path, device=device)
    return load_llava_encoder(path, device)


__all__ = ["split", "load_encoder", "LlavaEncoder", "AnyresEncoder", "QwenVLEncoder",
           "VisionConfig", "ImageProcessing", "image_prompt", "render_chat"]
