"""Classification with ``select``: the label the model finds most likely for a span."""

from __future__ import annotations

import sglang as sgl

import sgl_embeds  # noqa: F401


@sgl.function
def classify(s, image, labels: list, question: str = "Which category fits the image best?"):
    """Pick one of ``labels`` for ``image`` (a span) by the model's normalized label likelihood;
    the label is ``s["label"]``."""
    s += sgl.user(sgl.embeds(image) + "\n" + question)
    label = sgl.select("label", choices=list(labels), temperature=0)
    s += sgl.assistant("The category is " + label)
