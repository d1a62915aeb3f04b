"""sgl_embeds: precomputed embeddings as a first-class, cache-aware input of SGLang.

Importing the package installs ``sgl.embeds`` and ``sgl.region`` into SGLang's frontend.
The engine side is an SGLang plugin (``sgl_embeds.srt.plugin``), loaded by the server itself.
"""

from __future__ import annotations

from sgl_embeds.lang import compile_program, embeds, install, program_segments, region
from sgl_embeds.segments import Embeds, Ids, Prompt, Text

install()


def __getattr__(name: str):
    # The backend imports SGLang's HTTP client stack; load it only when asked for.
    if name == "EmbedsEndpoint":
        from sgl_embeds.backend import EmbedsEndpoint

        return EmbedsEndpoint
    raise AttributeError(name)


__all__ = ["embeds", "region", "program_segments", "compile_program", "EmbedsEndpoint", "Prompt", "Text", "Ids", "Embeds"]
