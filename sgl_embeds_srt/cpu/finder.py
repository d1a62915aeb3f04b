"""Make ``sgl_embeds_srt/cpu/kernels.py`` importable as ``sgl_kernel`` where no real one is installed.

Run at interpreter start-up by a ``.pth`` file that ``scripts/setup.sh`` writes (by path, so it
imports nothing of ``sgl_embeds`` itself), so every SGLang process sees it (processor pools
included). The finder sits *last* on ``sys.meta_path``: a real ``sgl_kernel`` found by the
normal finders always wins. A second one, first on the path, only imports ``sgl_kernel`` (real or
fallback) before SGLang's model and multimodal modules, some of which look up its torch ops at
import time (``kernels.TORCH_OPS``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys


def _kernels_path() -> str:
    """The ``kernels.py`` of the ``sgl_embeds_srt`` this process imports: a checkout on
    ``PYTHONPATH`` (a worktree sharing another checkout's venv, whose ``.pth`` runs that
    checkout's finder by path) brings its own ops; otherwise the one beside this file."""
    spec = importlib.util.find_spec("sgl_embeds_srt")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "cpu", "kernels.py")
        if os.path.exists(path):
            return path
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py")


_KERNELS = _kernels_path()
_NAMES = ("sgl_kernel", "sgl_kernel.mamba")
_NEED_KERNELS_FIRST = ("sglang.srt.models.", "sglang.srt.multimodal.")


class FallbackKernelFinder(importlib.abc.MetaPathFinder):
    sgl_embeds_fallback = True

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        if fullname not in _NAMES:
            return None
        package = [] if fullname == "sgl_kernel" else None
        return importlib.util.spec_from_file_location(fullname, _KERNELS, submodule_search_locations=package)


class KernelsFirstFinder(importlib.abc.MetaPathFinder):
    """Finds nothing; imports ``sgl_kernel`` before the first module that needs its torch ops."""

    sgl_embeds_fallback = True

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        if fullname.startswith(_NEED_KERNELS_FIRST) and "sgl_kernel" not in sys.modules:
            importlib.import_module("sgl_kernel")
        return None


def install() -> None:
    if not any(getattr(f, "sgl_embeds_fallback", False) for f in sys.meta_path):
        sys.meta_path.insert(0, KernelsFirstFinder())
        sys.meta_path.append(FallbackKernelFinder())


install()
