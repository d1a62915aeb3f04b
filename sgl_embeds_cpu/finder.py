"""Make ``kernels.py`` importable as ``sgl_kernel`` (and ``sgl_kernel.mamba``) where no real one is.

``install()`` is run by ``plugin.turn_on`` in a process that runs SGLang on CPU, never at import.
``FallbackKernelFinder`` sits *last* on ``sys.meta_path``: a real ``sgl_kernel`` found by the
normal finders always wins. ``KernelsFirstFinder``, first on the path, only imports ``sgl_kernel``
(real or fallback) before SGLang's model and multimodal modules, some of which look up its torch
ops at import time (``kernels.TORCH_OPS``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys


# beside this file: the finder is installed by the sgl_embeds_cpu this process imported
_KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.py")
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
    """Put both finders on ``sys.meta_path`` (once)."""
    if not any(getattr(f, "sgl_embeds_fallback", False) for f in sys.meta_path):
        sys.meta_path.insert(0, KernelsFirstFinder())
        sys.meta_path.append(FallbackKernelFinder())
