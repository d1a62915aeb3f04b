"""The environment variables sgl_embeds reads, on either side: each named ``SGLANG_EMBEDS_<NAME>``.

SGLang reads any ``SGL_<X>`` as ``SGLANG_<X>`` (it copies the value and warns that the first name
is deprecated), so ours take its prefix, and the spelling they had before, ``SGL_EMBEDS_<NAME>``,
still names the same setting: in SGLang's processes by that copy, in the client's here."""

from __future__ import annotations

import os
from typing import Any, Mapping

PREFIX = "SGLANG_EMBEDS_"
OLD_PREFIX = "SGL_EMBEDS_"


def setting(name: str, default: Any = None, environ: Mapping[str, str] = os.environ) -> Any:
    """The value of ``name`` (``SGLANG_EMBEDS_...``), else of its old spelling, else ``default``."""
    if not name.startswith(PREFIX):
        raise ValueError(f"{name} is not one of sgl_embeds' settings ({PREFIX}...)")
    if name in environ:
        return environ[name]
    return environ.get(OLD_PREFIX + name.removeprefix(PREFIX), default)
