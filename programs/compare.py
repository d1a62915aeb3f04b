"""Comparing several images: one span per image in one prompt."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def compare_images(s, images: list, question: str = "What differs between the images?",
                   max_tokens: int = 64):
    """``images`` (images or spans: ``sgl_embeds.image_part``) are shown as "Image 1: <image>",
    ...; the comparison is ``s["comparison"]``."""
    content = ""
    for i, image in enumerate(images, 1):
        content += f"Image {i}: " + image_part(image)
    s += sgl.user(content + question)
    s += sgl.assistant(sgl.gen("comparison", max_tokens=max_tokens, temperature=0))
