"""Serve a LLaVA-style VLM as its LLM (SGLang) plus its vision half (here, in open_clip).

``python -m sgl_embeds.vlm split SRC DST`` writes ``DST/llm`` (serve it with SGLang and the
plugin) and ``DST/vision``; ``load_encoder(DST/vision)`` gives the ``VisionEncoder`` to hand to
``EmbedsEndpoint(vision_encoder=...)``, so ``sgl.image(img)`` and ``sgl.region(box)`` put exactly
the rows the VLM would feed its LLM. ``image_prompt`` places images where the checkpoint's prompt
format puts its image token. See docs/vision-encoders.md.
"""

from __future__ import annotations

from sgl_embeds.vlm.checkpoint import split
from sgl_embeds.vlm.pixels import ImageProcessing
from sgl_embeds.vlm.prompt import image_prompt, render_chat
from sgl_embeds.vlm.tower import LlavaEncoder, VisionConfig, load_encoder

__all__ = ["split", "load_encoder", "LlavaEncoder", "VisionConfig", "ImageProcessing", "image_prompt",
           "render_chat"]
