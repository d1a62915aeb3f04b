"""The tutorials' kernels, forked from a zygote of the ``client`` kind (``zygote.py``): a process that
has imported what a notebook imports first (``import sgl_embeds``: SGLang's frontend, torch,
transformers; 13 s of a kernel's start on this project's CPU machines) and nothing else. Each kernel
is then ``python -m ipykernel_launcher -f CONNECTION_FILE`` run in a fresh child of it, with the
environment and folder jupyter_client gives the kernel, so the notebook runs as it runs for a user
whose kernel has already imported the client. A kernel jupyter_client would start another way, or
one whose environment differs from the zygote's in more than ``FREE_KEYS``, starts as usual.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager

from sgl_embeds_testing import zygote

# A notebook reads the URL of a running server from one of these (and starts its own without):
# the test pool's server each stands for (tests/conftest.py)
SERVER_URLS = {"SGLANG_EMBEDS_URL": "llama",  # mechanics: the tiny Llama
               "SGLANG_EMBEDS_VLM_URL": "llava_llama",  # the tiny LLaVA's split LLM
               "SGLANG_EMBEDS_DEMO_URL": "demo",  # meaning: SmolLM2-135M-Instruct
               "SGLANG_EMBEDS_QWEN_VL_URL": "qwen_vl_spans",  # the tiny Qwen2.5-VL, NaN tower
               "SGLANG_EMBEDS_QWEN3_VL_URL": "qwen3_vl_spans",  # the tiny Qwen3-VL, NaN tower
               "SGLANG_EMBEDS_LLAVA_NEXT_URL": "llava_next",  # the tiny LLaVA-NeXT's split LLM
               "SGLANG_EMBEDS_PALIGEMMA2_URL": "paligemma2",  # the tiny PaliGemma 2, served split
               "SGLANG_EMBEDS_GEMMA3_URL": "gemma3_vlm",  # the tiny Gemma 3, served split
               "SGLANG_EMBEDS_GEMMA4_URL": "gemma4_vlm",  # the tiny Gemma 4 (E2B layout), served split
               "SGLANG_EMBEDS_FLORENCE2_URL": "florence2"}  # the tiny Florence-2, served whole
# what may differ between the kernels forked from one zygote: read by the notebooks' cells (a
# server's URL) or by jupyter_client's kernel after its start, never by an import
FREE_KEYS = zygote.LAUNCH_TIME_KEYS | set(SERVER_URLS) | {"JPY_PARENT_PID", "JPY_SESSION_NAME"}

_kernels = zygote.Shared("client", FREE_KEYS)


def start(env: dict[str, str]) -> None:
    """The zygote, started now (it imports the client while earlier tests run) with the
    environment jupyter_client will give the kernels (``os.environ``, then ``FREE_KEYS``)."""
    _kernels.get(env)


def stop() -> None:
    _kernels.stop()


class ForkedKernelManager(AsyncKernelManager):
    """nbclient's kernel manager (``kernel_manager_class``), its kernels forked where it can."""

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        env = {**(kw.get("env") or {}), "JPY_PARENT_PID": str(os.getpid())}  # as jupyter_client's launcher sets it
        forker = _kernels.get(env) if kernel_cmd[:3] == [sys.executable, "-m", "ipykernel_launcher"] else None
        child = None if forker is None else zygote.spawn_or_none(
            forker, kernel_cmd[1:], env, forker.folder / f"kernel-{self.kernel_id}.log", cwd=str(kw.get("cwd") or Path.cwd()))
        if child is None:
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        provisioner = self.provisioner
        provisioner.process, provisioner.pid, provisioner.pgid = child, child.pid, child.pid  # its own session
        provisioner.cwd = kw.get("cwd")
        self._reconcile_connection_info(provisioner.connection_info)
