"""sgl_embeds: precomputed embeddings as a first-class, cache-aware input of SGLang (the client).

Importing the package installs ``sgl.embeds``, ``sgl.region`` and ``sgl.video`` into SGLang's
frontend; ``connect(url)`` gives the backend for a server, with the vision half of the model it
serves. The server side is the SGLang plugin in the package ``sgl_embeds_srt``, which never
imports this one.
``wire`` (the tensor wire format, ``sgl_embeds_protocol.wire``) is re-exported for clients that build
request bodies themselves (the OpenAI client, curl scripts).
"""

from __future__ import annotations

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.segments import Span, Ids, Prompt, Text

from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.connect import connect
from sgl_embeds.hooks import install
from sgl_embeds.lang import compile_program, embeds, image_part, program_segments, region, video

install()

__all__ = ["connect", "embeds", "image_part", "region", "video", "program_segments", "compile_program", "EmbedsEndpoint",
           "Prompt", "Text", "Ids", "Span", "wire"]
