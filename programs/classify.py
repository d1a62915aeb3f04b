"""Classification with ``select``: the label the model finds most likely for an image."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def classify(s, image, labels: list, question: str = "Which category fits the image best?"):
    """Pick one of ``labels`` for ``image`` (an image or a span: ``sgl_embeds.image_part``) by the
    model's normalized label likelihood; the label is ``s["label"]``."""
    s += sgl.user(image_part(image) + question)
    label = sgl.select("label", choices=list(labels), temperature=0)
    s += sgl.assistant("The category is " + label)
