"""Ready ``@sgl.function`` programs for VLM developers, built on ``sgl.embeds`` / ``sgl.region``.

Each takes precomputed embeddings (``[n, hidden]`` tensors from your vision tower + projector) or
an image and boxes (with a backend that has a ``vision_encoder``). Run them with
``program.run(..., backend=EmbedsEndpoint(url))``.
"""

from programs.attributes import extract_attributes
from programs.classify import classify
from programs.compare import compare_images
from programs.grounded_chat import grounded_chat
from programs.region_caption import caption_regions
from programs.vqa import visual_qa

__all__ = ["visual_qa", "compare_images", "caption_regions", "grounded_chat", "extract_attributes",
           "classify"]
