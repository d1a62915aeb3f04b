"""Grounded multi-turn chat: an image in the history, the cache reused across turns."""

from __future__ import annotations

import sglang as sgl

from sgl_embeds import image_part


@sgl.function
def grounded_chat(s, image, turns: list, max_tokens: int = 48):
    """A conversation about ``image`` (an image or a span: ``sgl_embeds.image_part``, given in the
    first turn). ``turns`` are the user's messages; the replies are ``s["replies"]``, and
    ``s["cached"]`` the cached prompt positions of each turn (every turn after the first reuses
    the image and the earlier turns)."""
    replies, cached = [], []
    for i, turn in enumerate(turns):
        s += sgl.user((image_part(image) + turn) if i == 0 else turn)
        s += sgl.assistant(sgl.gen(f"reply_{i}", max_tokens=max_tokens, temperature=0))
        replies.append(s[f"reply_{i}"])
        cached.append(s.get_meta_info(f"reply_{i}").get("cached_tokens", 0))
    s["replies"], s["cached"] = replies, cached
