"""Comparing several images: one span per image in one prompt."""

from __future__ import annotations

import sglang as sgl

import sgl_embeds  # noqa: F401


@sgl.function
def compare_images(s, images: list, question: str = "What differs between the images?",
                   max_tokens: int = 64):
    """``images`` is a list of ``[n, hidden]`` spans, shown as "Image 1: <span>", ...; the
    comparison is ``s["comparison"]``."""
    content = ""
    for i, image in enumerate(images, 1):
        content += f"Image {i}: " + sgl.embeds(image) + "\n"
    s += sgl.user(content + question)
    s += sgl.assistant(sgl.gen("comparison", max_tokens=max_tokens, temperature=0))
