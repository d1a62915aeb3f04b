"""SGLang's scheduler and detokenizer started by fork on CPU, not spawn: a spawned child imports
SGLang again (~9.5 s of CPU each, two per server), a forked one inherits the parent's imports and
our applied hooks (SGLang's ``load_plugins`` then does nothing: it is done). Measured on a tiny
Llama: ready after 16-18 s instead of 27-31 s, 16-18 s of CPU for the server instead of 38-41.

Only where fork is safe: a CPU server (no CUDA context to inherit) whose process is still single-
threaded at its first launch (a server's main process; a notebook or test process keeps spawn)."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Callable


# An Engine launched before in this process leaves zmq I/O threads that ``threading`` does not
# count: a scheduler forked beside them hung (a second Engine in one process, seen)
_launched_before = False


def set_envs_and_config(original: Callable, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``_set_envs_and_config`` (which sets spawn), then fork where it is safe."""
    global _launched_before
    result = original(server_args, *args, **kwargs)
    if server_args.device == "cpu" and not _launched_before and threading.active_count() == 1:
        multiprocessing.set_start_method("fork", force=True)
    _launched_before = True
    return result
