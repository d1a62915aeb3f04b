"""The client's hooks of SGLang's frontend, installed by ``import sgl_embeds``.

``hook_table``: target (see ``sgl_embeds_protocol/targets.py`` for the guard of each) -> (hook type,
our function): the interpreter's (``lang``: every executor's span table, our IR nodes, ``fork``)
and the post of every stock ``RuntimeEndpoint`` call (``sender``: a body with spans goes through
its request's sender, which resends it inline on a refused handle). ``install`` checks the
client's guards first and refuses a changed SGLang.
"""

from __future__ import annotations

from typing import Any, Callable

import sglang as sgl
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sgl_embeds import lang, sender
from sgl_embeds_protocol import targets


def hook_table() -> dict[str, tuple[Any, Callable]]:
    return {
        targets.EXECUTOR_INIT: (HookType.AROUND, lang.executor_init),
        targets.EXECUTE: (HookType.AROUND, lang.execute),
        targets.FORK: (HookType.AROUND, lang.fork),
        targets.STOCK_POST: (HookType.AROUND, sender.post_stock_body),
    }


def install() -> None:
    """Expose the primitives as ``sgl.embeds`` / ``sgl.region`` / ``sgl.video`` (which keeps
    stock's for a path) and hook the frontend (once);
    ``targets.ChangedSGLang`` if the installed SGLang differs where the hooks rely on it."""
    targets.check("client")
    if getattr(sgl, "embeds", None) is lang.embeds:
        return
    sgl.embeds, sgl.region, sgl.video = lang.embeds, lang.region, lang.video
    for target, (kind, hook) in hook_table().items():
        HookRegistry.register(target, hook, kind)
    HookRegistry.apply_hooks()
