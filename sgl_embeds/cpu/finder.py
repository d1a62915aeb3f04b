"""Make ``sgl_embeds.cpu.kernels`` importable as ``sgl_kernel`` where no real one is installed.

Installed by a ``.pth`` file that ``scripts/setup.sh`` writes, so that every SGLang process
(server, scheduler, detokenizer) sees it. The finder sits *last* on ``sys.meta_path``: a real
``sgl_kernel`` found by the normal finders always wins. Kept import-light (no torch).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_ALIASES = {"sgl_kernel": "sgl_embeds.cpu.kernels", "sgl_kernel.mamba": "sgl_embeds.cpu.kernels"}


class _FallbackFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        real = _ALIASES.get(fullname)
        if real is None:
            return None
        spec = importlib.util.find_spec(real)
        if spec is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, submodule_search_locations=[] if fullname == "sgl_kernel" else None
        )


def install() -> None:
    if not any(isinstance(f, _FallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(_FallbackFinder())


install()
