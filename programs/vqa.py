"""Visual question answering over one image span."""

from __future__ import annotations

import sglang as sgl

import sgl_embeds  # noqa: F401  (installs sgl.embeds)


@sgl.function
def visual_qa(s, image, question: str, max_tokens: int = 64):
    """Answer ``question`` about ``image`` (an ``[n, hidden]`` span). The answer is ``s["answer"]``.

    Asking several questions about the same span costs one prefill of the span: the later
    questions hit the prefix cache.
    """
    s += sgl.user(sgl.embeds(image) + "\n" + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))
