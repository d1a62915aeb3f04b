"""The SGLang plugin entry point (group ``sglang.srt.plugins``): registers every hook.

SGLang calls ``register()`` in each of its processes (server, scheduler, detokenizer); the HTTP
hook is registered only in the main process, where the HTTP app lives.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing

from sgl_embeds.srt import targets

logger = logging.getLogger(__name__)


def _resolve(ref: str):
    module, name = ref.split(":")
    full = module if module.startswith("sgl_embeds.") else f"sgl_embeds.srt.{module}"
    return getattr(importlib.import_module(full), name)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    version = targets.installed_version()
    if version != targets.SGLANG_VERSION:
        logger.warning(
            "sgl_embeds targets SGLang %s but %s is installed: run "
            "`python -m sgl_embeds.cpu.check` to verify the patch targets",
            targets.SGLANG_VERSION, version,
        )
    hooks = dict(targets.HOOKS)
    if multiprocessing.parent_process() is None:
        hooks.update(targets.HTTP_HOOKS)
    for target, (kind, ref, _) in hooks.items():
        HookRegistry.register(target, _resolve(ref), HookType[kind])
