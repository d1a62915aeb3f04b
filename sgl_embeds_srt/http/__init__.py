"""The HTTP side of the plugin, and its launch wiring: ``before_launch_server`` and ``install``.

``install`` puts the span middleware (``middleware.py``) innermost on SGLang's app at launch; with
``--tokenizer-worker-num > 1`` ``before_launch_server`` also points
``SGLANG_HTTP_SERVER_APP_PATH`` at ``worker_app.py``, so each HTTP worker process loads the plugin
on its own copy of the app. The routes: ``middleware.py``, ``own_routes.py``, ``asgi.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from starlette.middleware import Middleware

from sgl_embeds_srt import tenants
from sgl_embeds_srt.http.middleware import ROUTES, SpanMiddleware

logger = logging.getLogger(__name__)

WORKER_APP_PATH = "sgl_embeds_srt.http.worker_app:app"
_STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"


def install(app: Any) -> None:
    """Add the middleware innermost, once (later ``add_middleware`` calls insert outside it)."""
    if any(m.cls is SpanMiddleware for m in app.user_middleware):
        return
    app.user_middleware.append(Middleware(SpanMiddleware))
    logger.info("sgl_embeds: span prompts enabled on %s", ", ".join(sorted(ROUTES)))


def check_tenants(server_args: Any) -> None:
    """With ``tenants.TENANTS_ENV``: its table readable and well-formed, no ``--api-key`` beside
    it (SGLang's check, outside ours, would refuse every tenant's key but that one), and SGLang's
    warm-up skipped (its requests carry no key); a ``SystemExit`` that stops the launch otherwise."""
    try:
        table = tenants.key_table()
    except ValueError as e:
        raise SystemExit(f"sgl_embeds refuses to start: {e}") from None
    if table is not None and getattr(server_args, "api_key", None):
        raise SystemExit(f"sgl_embeds refuses to start: --api-key and {tenants.TENANTS_ENV} both set; "
                         "with tenants every tenant's key is an API key: drop --api-key")
    if table is not None and not getattr(server_args, "skip_server_warmup", False):
        raise SystemExit(f"sgl_embeds refuses to start: with {tenants.TENANTS_ENV}, add "
                         "--skip-server-warmup (SGLang's warm-up requests carry no tenant's key and "
                         "would be refused; `sgl_embeds serve --tenants` adds it)")
    if table is not None:
        logger.info("sgl_embeds: %d tenants, each with its own cache entries, handles and held rows",
                    tenants.count())


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``http_server.launch_server``: install the middleware on SGLang's app, and
    in multi-tokenizer mode on the app of every HTTP worker process."""
    from sglang.srt.entrypoints.http_server import app  # SGLang not ready at plugin load

    check_tenants(server_args)
    install(app)
    if server_args.tokenizer_worker_num > 1:
        current = os.environ.get("SGLANG_HTTP_SERVER_APP_PATH", _STOCK_APP_PATH)
        if current != _STOCK_APP_PATH:
            logger.warning("sgl_embeds: SGLANG_HTTP_SERVER_APP_PATH=%s is not SGLang's app: span "
                           "prompts are not enabled in its tokenizer workers", current)
        else:
            os.environ["SGLANG_HTTP_SERVER_APP_PATH"] = WORKER_APP_PATH
