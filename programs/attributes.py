"""Parallel attribute extraction: one image, many questions forked from it."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def extract_attributes(s, image, attributes: list, max_tokens: int = 12):
    """Ask for each of ``attributes`` (e.g. ["color", "material"]) of the object in ``image`` (an
    image or a span: ``sgl_embeds.image_part``) in parallel branches that share the image's
    prefill. ``s["attributes"]`` maps each attribute to its answer."""
    s += sgl.user(image_part(image) + "Look at the object.")
    forks = s.fork(len(attributes))
    for f, name in zip(forks, attributes):
        f += sgl.user(f"What is its {name}? Answer in a few words.")
        f += sgl.assistant(sgl.gen("value", max_tokens=max_tokens, temperature=0))
    s["attributes"] = {name: f["value"] for f, name in zip(forks, attributes)}
