"""HTTP side: span prompts on ``/generate`` and the OpenAI routes, and ``GET /sgl_embeds/info``.

An innermost ASGI middleware (so SGLang's API-key middleware still runs first) looks at the
bodies of the routes in ``ROUTES``. A body without span fields goes on to the stock route
untouched once its token ids, if any, are checked (``token_ids.py``: an id outside the
vocabulary would kill stock SGLang's scheduler). A body with spans is decoded and validated here (HTTP 400 with the reason on any
problem): ``/generate`` becomes ``input_ids`` + ``positional_embed_overrides`` served by SGLang's
own ``serve_generate_request``; the OpenAI routes are rewritten to token ids and handed on to
SGLang's own route with the span rows on the request's state (see ``openai.py``). Decoding and
hashing run in a worker thread so a large payload does not stall the event loop for other clients.
Route handlers get what they need (the served model, the span-handle lookup) in a
``RouteContext``; nothing imports this module back.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Awaitable, Callable

import orjson

from sgl_embeds_srt import wire
from sgl_embeds_srt.keys import UNKNOWN_HANDLE_TYPE
from sgl_embeds_srt import handles, openai, parse, prompts, token_ids, transport

logger = logging.getLogger(__name__)


# A route: (does this body carry spans?, handler). A handler gets the body, the request and the
# context, and returns a response to send, or an ``openai.StockRequest`` to hand on to SGLang's
# own route.
Detector = Callable[[dict], bool]
Handler = Callable[[dict, Any, prompts.RouteContext], Awaitable[Any]]


def max_body_bytes() -> int:
    """Largest request body read for span detection (``SGL_EMBEDS_MAX_BODY_BYTES``)."""
    return int(os.environ.get("SGL_EMBEDS_MAX_BODY_BYTES", 1 << 30))


def error_response(message: str, status: int = 400, kind: str = "BadRequestError", param: Any = None) -> Any:
    """SGLang's error body. A 4xx is the client's fault to a gateway: never retried, and never
    counted against the worker by its circuit breaker (docs/scaling.md)."""
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse(
        status_code=status,
        content={"object": "error", "message": message, "type": kind, "param": param, "code": status},
    )


def server_spec() -> prompts.ModelSpec:
    """The served model, as seen by this process's tokenizer manager."""
    from sglang.srt.entrypoints.http_server import _global_state

    return prompts.ModelSpec.from_tokenizer_manager(_global_state.tokenizer_manager)


async def generate_route(body: dict, request: Any, ctx: prompts.RouteContext) -> Any:
    from sglang.srt.entrypoints.http_server import serve_generate_request

    obj = await asyncio.to_thread(prompts.make_generate_req, body, ctx.spec, ctx.store, True)  # ValueError -> 400
    return await serve_generate_request(obj, request)


ROUTES: dict[str, tuple[Detector, Handler]] = {
    "/generate": (parse.has_span_fields, generate_route),
    "/v1/completions": (parse.has_span_fields, openai.completions_route),
    "/v1/chat/completions": (openai.chat_has_spans, openai.chat_route),
}
INFO_PATH = "/sgl_embeds/info"
# SGLang's model-info route, which a gateway forwards: its answer also carries ours, so a client
# finds the plugin (and the hidden size) through a gateway, in the call RuntimeEndpoint makes anyway.
MODEL_INFO_PATH, MODEL_INFO_KEY = "/get_model_info", "sgl_embeds"


def info(store: handles.SpanStore) -> dict:
    """What a client needs to check spans before sending them."""
    from importlib.metadata import version

    spec = server_spec()
    return {
        "hidden_size": spec.hidden_size, "dtype": str(spec.dtype).removeprefix("torch."),
        "vocab_size": spec.vocab_size, "context_len": spec.context_len,
        "max_span_bytes": parse.max_span_bytes(), "wire_dtypes": sorted(wire.DTYPES),
        "sglang_version": version("sglang"), "sgl_embeds_version": version("sgl_embeds"),
        "span_store": store.stats(),  # of this HTTP process (one per tokenizer worker)
        "rows_to_scheduler": transport.stats(),  # kept spans' rows go to the scheduler once
        "http_worker_pid": os.getpid(),
    }


class SpanMiddleware:
    """Routes requests that carry span fields to our handlers; everything else passes through."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store = handles.SpanStore(handles.budget_bytes())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path, method = scope.get("path", ""), scope.get("method")
        if scope["type"] == "http" and path.startswith(("/sgl_embeds/", handles.PATH)):
            return await self._own_route(path, method, scope, receive, send)
        if scope["type"] == "http" and path == MODEL_INFO_PATH and method == "GET":
            return await self._model_info_with_ours(scope, receive, send)
        route = ROUTES.get(path) if scope["type"] == "http" else None
        if route is None or method not in ("POST", "PUT"):
            return await self.app(scope, receive, send)
        body, too_big = await _read_body(receive, max_body_bytes())
        if too_big:
            response = error_response(f"request body exceeds the limit of {max_body_bytes()} bytes", 413)
            return await response(scope, receive, send)
        replay = _replay(body, receive)
        payload = _parse_json(body)
        detect, handler = route
        if not isinstance(payload, dict):
            return await self.app(scope, replay, send)
        if not detect(payload):  # a stock body: only its token ids are checked here
            ids = token_ids.stock_ids(path, payload)
            if ids is not None:
                field, value = ids
                try:
                    token_ids.check_id_lists(value, server_spec().vocab_size, field)
                except ValueError as e:
                    return await error_response(str(e))(scope, replay, send)
            return await self.app(scope, replay, send)
        from starlette.requests import Request

        try:
            response = await handler(payload, Request(scope, replay), prompts.RouteContext(server_spec(), self.store))
        except handles.UnknownSpanHandle as e:  # machine-readable: the client resends the rows
            response = error_response(str(e), kind=UNKNOWN_HANDLE_TYPE, param=e.handle)
        except ValueError as e:
            response = error_response(str(e))
        if isinstance(response, openai.StockRequest):
            return await self._forward_to_stock_route(scope, response, receive, send)
        await response(scope, replay, send)

    async def _forward_to_stock_route(self, scope: dict, stock: "openai.StockRequest", receive: Callable, send: Callable) -> None:
        """SGLang's own route serves the rewritten body; the span rows wait on the request's state
        until its ``generate_request`` call, where ``openai.generate_request`` attaches them."""
        raw = orjson.dumps(stock.body)
        scope = _with_length(scope, len(raw))
        scope.setdefault("state", {})[openai.ROWS_STATE_KEY] = stock.rows
        await self.app(scope, _replay(raw, receive), send)

    async def _model_info_with_ours(self, scope: dict, receive: Callable, send: Callable) -> None:
        start: dict = {}
        chunks: list[bytes] = []

        async def keep(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, keep)
        body = b"".join(chunks)
        payload = _parse_json(body) if start.get("status") == 200 else None
        if isinstance(payload, dict):
            payload[MODEL_INFO_KEY] = info(self.store)
            body = orjson.dumps(payload)
        await send(_with_length(start, len(body)))
        await send({"type": "http.response.body", "body": body})

    async def _own_route(self, path: str, method: str, scope: dict, receive: Callable, send: Callable) -> None:
        """``GET /sgl_embeds/info``, ``POST /sgl_embeds/spans``, ``DELETE /sgl_embeds/spans/<handle>``."""
        from fastapi.responses import ORJSONResponse

        if path == INFO_PATH and method == "GET":
            response = ORJSONResponse(info(self.store))
        elif path == handles.PATH and method == "POST":
            body, too_big = await _read_body(receive, max_body_bytes())
            payload = None if too_big else _parse_json(body)
            try:
                if not isinstance(payload, dict):
                    raise ValueError("the body must be a JSON object within the size limit")
                result = await asyncio.to_thread(handles.upload, payload, self.store, server_spec().hidden_size)
                response = ORJSONResponse(result)
            except ValueError as e:
                response = error_response(str(e))
        elif path.startswith(handles.PATH + "/") and method == "DELETE":
            handle = path[len(handles.PATH) + 1 :]
            found = self.store.delete(handle)
            transport.release(handle)  # the scheduler's copy too
            response = ORJSONResponse({"deleted": found}, status_code=200 if found else 404)
        else:
            response = error_response(f"no route {method} {path}", 404)
        await response(scope, receive, send)


def _parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the stock route reports malformed JSON its own way


async def _read_body(receive: Callable, limit: int) -> tuple[bytes, bool]:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks), False


def _with_length(message: dict, n: int) -> dict:
    """A request scope or response start with its content-length set to ``n``."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
    return {**message, "headers": headers + [(b"content-length", str(n).encode())]}


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands the already-read body over once, then defers to the real one
    (so disconnects are still seen by streaming responses)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(app: Any) -> None:
    """Add the middleware innermost, once (later ``add_middleware`` calls insert outside it)."""
    from starlette.middleware import Middleware

    if any(m.cls is SpanMiddleware for m in app.user_middleware):
        return
    app.user_middleware.append(Middleware(SpanMiddleware))
    logger.info("sgl_embeds: span prompts enabled on %s", ", ".join(sorted(ROUTES)))


# Multi-tokenizer mode (``--tokenizer-worker-num N > 1``): SGLang serves HTTP from N worker
# processes that import the app by its path (``SGLANG_HTTP_SERVER_APP_PATH``), not the object the
# main process holds. Pointing that path here makes each worker load the plugin and install the
# middleware on its own copy of the app.
WORKER_APP_PATH = f"{__name__}:worker_app"
_STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"


def before_launch_server(server_args: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``http_server.launch_server``: install the middleware on SGLang's app, and
    in multi-tokenizer mode on the app of every HTTP worker process."""
    from sglang.srt.entrypoints.http_server import app

    install(app)
    if getattr(server_args, "tokenizer_worker_num", 1) > 1:
        current = os.environ.get("SGLANG_HTTP_SERVER_APP_PATH", _STOCK_APP_PATH)
        if current != _STOCK_APP_PATH:
            logger.warning("sgl_embeds: SGLANG_HTTP_SERVER_APP_PATH=%s is not SGLang's app: span prompts "
                           "are not enabled in its tokenizer workers", current)
        else:
            os.environ["SGLANG_HTTP_SERVER_APP_PATH"] = WORKER_APP_PATH


def __getattr__(name: str) -> Any:
    if name == "worker_app":  # imported by each multi-tokenizer HTTP worker
        from sglang.srt.entrypoints.http_server import app
        from sglang.srt.plugins import load_plugins

        load_plugins()  # our hooks in this process too (the OpenAI routes' generate_request)
        install(app)
        return app
    raise AttributeError(name)
