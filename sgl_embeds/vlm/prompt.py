"""Put images where the checkpoint's prompt format puts its image token.

``render_chat`` renders messages with the checkpoint's own chat template (``split`` saves it);
``image_prompt`` puts ``sgl.image`` (or a given expression) at each image token, so the ids sent
are HF's processor's; ``model_chat_template`` reads the template as SGLang's ``ChatTemplate`` for
``sgl.user`` / ``sgl.assistant`` and ``image_part`` (docs/vision-encoders.md, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import sglang as sgl
from sglang.lang.chat_template import ChatTemplate
from sglang.lang.ir import SglExpr
from transformers.utils.chat_template_utils import render_jinja_template

from sgl_embeds.vlm.files import TEMPLATE_FILES, chat_template_of
from sgl_embeds_protocol.family import ImageText


def render_chat(vision_dir: str | Path, messages: list[dict], add_generation_prompt: bool = True,
                **template_vars: Any) -> str:
    """The prompt text the checkpoint's processor would build for ``messages`` (image parts are
    ``{"type": "image"}``), rendered by transformers' own chat-template renderer from the
    template ``chat_template_of`` finds."""
    template = chat_template_of(vision_dir)
    if template is None:
        raise FileNotFoundError(f"{vision_dir} has no chat template (none of {', '.join(TEMPLATE_FILES)} "
                                "holds one): the checkpoint had none; write the prompt text yourself")
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template,
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


@dataclass
class ModelChatTemplate(ChatTemplate):
    """SGLang's ``ChatTemplate`` read from a checkpoint's own (``model_chat_template``), with what
    an image part writes before and after the image's rows (``image_part``). ``system_in_user``:
    the template writes a system turn's text at the start of the first user turn (Gemma's), so a
    system turn opens that user turn (its prefix: the user's and the system's) and the user turn
    right after it adds no prefix of its own."""

    image_part: tuple[str, str] = ("", "")
    system_in_user: bool = False

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        prefix, suffix = super().get_prefix_and_suffix(role, hist_messages)
        if not self.system_in_user:
            return prefix, suffix
        if role == "system" and hist_messages:
            raise ValueError(f"{self.name}: a system turn comes first (the template writes its text "
                             "into the first user turn)")
        if role == "user" and [m["role"] for m in hist_messages] == ["system"]:
            return "", suffix
        return prefix, suffix


# What the roles' contents are rendered with to find where the template puts them (no whitespace,
# no markup: a template that trims or escapes contents leaves them as they are)
_USER, _OTHER_USER, _ASSISTANT, _SYSTEM = "SGLEMBEDSUSERA", "SGLEMBEDSUSERB", "SGLEMBEDSREPLY", "SGLEMBEDSSYSTEM"


def model_chat_template(vision_dir: str | Path, image_token: str, image_text: ImageText | None = None,
                        bos_token: str | None = None) -> ModelChatTemplate:
    """The chat template of ``vision_dir`` (``render_chat``'s) as SGLang's: each role's prefix and
    suffix, the default system prompt, the assistant's prefix being the generation prompt (so a
    program's ``sgl.assistant(sgl.gen(...))`` asks exactly what HF's processor asks), and the text
    an image part writes on each side of ``image_token``. ``image_text``: how the processor
    expands what the template writes for an image part (Gemma 3's); ``bos_token``: a bos the
    template writes first, left out (the server writes it: the first text is tokenized with the
    tokenizer's special tokens). ``ValueError`` for a template whose roles are not a fixed prefix
    and suffix each (write the prompt with ``render_chat`` then)."""

    def render(messages: list[dict], generation_prompt: bool = False) -> str:
        rendered = render_chat(vision_dir, messages, generation_prompt)
        return rendered.removeprefix(bos_token) if bos_token else rendered

    def turn(role: str, text: str, image: bool = False) -> dict:  # contents as parts: HF's form
        return {"role": role, "content": [{"type": "image"}] * image + [{"type": "text", "text": text}]}

    def user(text: str) -> dict:
        return turn("user", text)

    def between(text: str, before: str, after: str | None = None) -> str:
        start = text.index(before) + len(before) if before else 0
        return text[start:text.index(after, start)] if after else text[start:]

    def fail(what: str) -> ValueError:
        return ValueError(f"the chat template of {vision_dir} is not a fixed prefix and suffix per "
                          f"role ({what}): write the prompt with render_chat and image_prompt")

    try:
        one = render([user(_USER)])
        two = render([user(_USER), user(_OTHER_USER)])
        user_suffix = between(two, _OTHER_USER)
        user_prefix = between(two, _USER, _OTHER_USER).removeprefix(user_suffix)
        opening = between(two, "", _USER).removesuffix(user_prefix)  # the default system turn
        if one != opening + user_prefix + _USER + user_suffix:
            raise fail("a user turn")
        generation_prompt = render([user(_USER)], True).removeprefix(one)
        assistant_suffix = between(render([user(_USER), turn("assistant", _ASSISTANT)]),
                                   _ASSISTANT)
        with_system = render([turn("system", _SYSTEM), user(_USER)])
        system_prefix = between(with_system, "", _SYSTEM)
        system_suffix = between(with_system, _SYSTEM, _USER)
        # the system text inside the first user turn (Gemma's), or a turn of its own before it
        system_in_user = system_prefix.startswith(opening + user_prefix) and not system_suffix.endswith(user_prefix)
        if system_in_user:
            system_prefix = system_prefix.removeprefix(opening)
            composed = system_prefix + _SYSTEM + system_suffix + _USER + user_suffix
        else:
            system_suffix = system_suffix.removesuffix(user_prefix)
            composed = system_prefix + _SYSTEM + system_suffix + user_prefix + _USER + user_suffix
        if with_system != composed:
            raise fail("a system turn")
        default_system = None
        if opening:
            if system_in_user or not (opening.startswith(system_prefix) and opening.endswith(system_suffix)):
                raise fail("the default system turn")
            default_system = opening[len(system_prefix):len(opening) - len(system_suffix)]
        image = between(render([turn("user", _USER, image=True)]), user_prefix, _USER)
        if image_text is not None:
            image = image_text.expand(image, image_token)
    except ValueError as e:
        if "not a fixed prefix" in str(e):
            raise
        raise fail(f"a content not found where it must be: {e}") from None
    except Exception as e:  # the template's own error on one of these conversations
        raise fail(f"{type(e).__name__}: {e}") from None
    if image.count(image_token) != 1:
        raise fail(f"an image part renders {image!r}, not one {image_token!r}")
    before, after = image.split(image_token)
    return ModelChatTemplate(
        name=f"sgl_embeds:{vision_dir}", default_system_prompt=default_system,
        role_prefix_and_suffix={"system": (system_prefix, system_suffix), "user": (user_prefix, user_suffix),
                                "assistant": (generation_prompt, assistant_suffix)},
        stop_str=(), image_token=image, image_part=(before, after), system_in_user=system_in_user)
