"""The opt-in switch of the CPU kernels, loaded by SGLang through two entry points.

With ``SGLANG_EMBEDS_CPU_KERNELS=1``: ``activate`` (group ``sglang.srt.platforms``, called as each
SGLang process resolves its platform, before anything imports ``sgl_kernel``) installs the
finders that make ``kernels.py`` importable as ``sgl_kernel`` and claims no platform; ``register``
(group ``sglang.srt.plugins``) registers the CPU-only hooks (``hook_table``). ``turn_on`` opts a
process in itself. Without the opt-in this module is all a process loads of the package
(docs/engine.md, "The CPU kernels: an opt-in plugin").
"""

from __future__ import annotations

import os
from typing import Any, Callable

OPT_IN = "SGLANG_EMBEDS_CPU_KERNELS"
# its spelling before SGLang's prefix, still honoured (as sgl_embeds_protocol.environment does:
# read here, so that a process without the opt-in loads nothing else of ours)
OLD_OPT_IN = OPT_IN.replace("SGLANG_", "SGL_", 1)


def opted_in(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    return environ.get(OPT_IN, environ.get(OLD_OPT_IN)) == "1"


def turn_on() -> None:
    """Opt this process and the processes it starts in, and install the finders now (for a
    process that imports SGLang's CPU path itself: a test run, an in-process ``sglang.Engine``)."""
    from sgl_embeds_cpu import finder

    os.environ[OPT_IN] = "1"
    finder.install()


def activate() -> None:
    """The ``sglang.srt.platforms`` entry point: the finders, if opted in; no platform."""
    if opted_in():
        turn_on()
    return None


def hook_table() -> dict[str, tuple[Any, Callable]]:
    """The CPU-only hooks of SGLang's engine (targets in ``sgl_embeds_protocol.targets.PATCHED``)."""
    from sglang.srt.plugins.hook_registry import HookType

    from sgl_embeds_cpu import attention, children, fused
    from sgl_embeds_protocol import targets
    from sgl_embeds_protocol.environment import setting

    table = {
        targets.GATED_RMSNORM_FORWARD: (HookType.AROUND, fused.rms_norm_gated),
        targets.GATE_SIGMOID_MUL: (HookType.AROUND, fused.gate_sigmoid_mul),
        targets.SET_ENVS_AND_CONFIG: (HookType.AROUND, children.set_envs_and_config),
    }
    if setting("SGLANG_EMBEDS_CPU_ATTENTION", "1") != "0":  # 0: SGLang's own (benchmarks compare)
        table[targets.SDPA_FORWARD_EXTEND] = (HookType.AROUND, attention.sdpa_forward_extend)
    return table


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: the CPU hooks, if opted in."""
    from sgl_embeds_protocol import targets

    if not opted_in() or targets.in_detokenizer():  # it runs none of these hooks
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    turn_on()  # already on where SGLang resolved its platform after the opt-in; idempotent
    for target, (kind, hook) in hook_table().items():
        HookRegistry.register(target, hook, kind)
