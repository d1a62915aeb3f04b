"""Visual question answering about one image."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def visual_qa(s, image, question: str, max_tokens: int = 64):
    """Answer ``question`` about ``image`` (an image, with a backend that has a vision encoder, or
    an ``[n, hidden]`` span; see ``sgl_embeds.image_part``). The answer is ``s["answer"]``.

    Asking several questions about the same image costs one prefill of its rows: the later
    questions hit the prefix cache.
    """
    s += sgl.user(image_part(image) + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))
