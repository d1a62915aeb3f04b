"""Region captioning: each box of an image captioned from its own region embeddings."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def caption_regions(s, image, boxes: list, max_tokens: int = 24):
    """Caption each of ``boxes`` (see ``sgl_embeds.vision`` for the box forms) of ``image`` (a PIL
    image, path or base64). Needs a backend with a ``vision_encoder``. The whole image is shown
    first as context; the captions are ``s["captions"]`` in box order."""
    s += sgl.user(image_part(sgl.image(image)) + "The image.")
    forks = s.fork(len(boxes))
    for f, box in zip(forks, boxes):
        f += sgl.user(image_part(sgl.region(box)) + "Describe this region.")
        f += sgl.assistant(sgl.gen("caption", max_tokens=max_tokens, temperature=0))
    s["captions"] = [f["caption"] for f in forks]
