"""Put images where the checkpoint's prompt format puts its image token.

HF's LLaVA processor expands each image token of the prompt text into ``rows_per_image`` copies
and tokenizes the whole text; the image token is a special token, so the text on each side of it
is tokenized on its own. sgl_embeds sends text / span / text segments and tokenizes the first
with the tokenizer's special tokens (BOS) and the rest without: the same ids, with each image's
rows where HF puts its expanded image tokens (``tests/vlm/test_llava15_parity.py`` checks the ids).

``render_chat`` renders messages with the checkpoint's own chat template (saved by ``split`` as
``DST/vision/chat_template.jinja``); ``image_prompt`` turns such a text into a program expression
with ``sgl.image`` (or any given expression, e.g. ``sgl.region(box)``) at each image token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import sglang as sgl
from sglang.lang.ir import SglExpr
from transformers.utils.chat_template_utils import render_jinja_template


def render_chat(vision_dir: str | Path, messages: list[dict], add_generation_prompt: bool = True,
                **template_vars: Any) -> str:
    """The prompt text the checkpoint's processor would build for ``messages`` (image parts are
    ``{"type": "image"}``), rendered by transformers' own chat-template renderer."""
    path = Path(vision_dir) / "chat_template.jinja"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkpoint had no chat template; "
                                "write the prompt text yourself")
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=path.read_text(),
        add_generation_prompt=add_generation_prompt, **template_vars,
    )
    return rendered[0]


def image_prompt(text: str, images: Sequence[Any], image_token: str = "<image>") -> SglExpr:
    """``text`` with its ``image_token``s replaced, in order, by ``sgl.image(image)`` (or by the
    given ``SglExpr``, e.g. ``sgl.region(box, image)``), as one program expression."""
    pieces = text.split(image_token)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} {image_token!r} tokens but "
                         f"{len(images)} images were given")
    expr: Any = pieces[0]
    for image, piece in zip(images, pieces[1:]):
        expr = expr + (image if isinstance(image, SglExpr) else sgl.image(image))
        if piece:
            expr = expr + piece
    if isinstance(expr, str):
        raise ValueError("image_prompt needs at least one image")
    return expr
