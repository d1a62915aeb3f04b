"""Parallel attribute extraction: one span, many questions forked from it."""

from __future__ import annotations

import sglang as sgl

import sgl_embeds  # noqa: F401


@sgl.function
def extract_attributes(s, image, attributes: list, max_tokens: int = 12):
    """Ask for each of ``attributes`` (e.g. ["color", "material"]) of the object in ``image`` (a
    span) in parallel branches that share the span's prefill. ``s["attributes"]`` maps each
    attribute to its answer."""
    s += sgl.user("Look at the object: " + sgl.embeds(image))
    forks = s.fork(len(attributes))
    for f, name in zip(forks, attributes):
        f += sgl.user(f"What is its {name}? Answer in a few words.")
        f += sgl.assistant(sgl.gen("value", max_tokens=max_tokens, temperature=0))
    s["attributes"] = {name: f["value"] for f, name in zip(forks, attributes)}
