"""The app of a multi-tokenizer HTTP worker: SGLang's app, the plugin checked, loaded, installed.

Only such a worker imports this module, by the path ``before_launch_server`` gives it
(``SGLANG_HTTP_SERVER_APP_PATH`` = ``WORKER_APP_PATH``); importing it is what sets the worker up.
A worker is not the main process, so ``plugin.register`` neither checks SGLang's internals nor
adds the launch hook here: the guards are checked here first, then the plugin's hooks load (the
OpenAI routes need ``openai.generate_request`` in this process) and the middleware goes on this
process's copy of the app.
"""

from __future__ import annotations

from sglang.srt.entrypoints.http_server import app
from sglang.srt.plugins import load_plugins

from sgl_embeds_srt.http import install
from sgl_embeds_srt.plugin import check_guards

check_guards()
load_plugins()
install(app)

__all__ = ["app"]
