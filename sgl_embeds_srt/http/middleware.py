"""The ASGI middleware and its route table: span prompts on ``/generate`` and the OpenAI routes.

``SpanMiddleware`` (innermost: SGLang's API-key check runs first) reads the bodies of the routes
in ``ROUTES``, JSON or binary. One without span fields goes on to the stock route once its ids
pass ``token_ids``; one with spans goes to its handler (``generate_route``, ``completions_route``,
``chat_route``), which decodes it in a worker thread, off the event loop. ``/sgl_embeds/*`` and
``/get_model_info`` go to ``own_routes.py``. docs/architecture.md, step 5.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request

from sgl_embeds_srt import handles, openai, parse, prompts, tenants, token_ids
from sgl_embeds_srt.http import asgi, own_routes
from sgl_embeds_protocol.keys import UNKNOWN_HANDLE_TYPE
from sgl_embeds_srt.stock_request import StockRequest, serving


@dataclass(frozen=True)
class RouteContext:
    """What a route handler needs from the server (given to it by the middleware)."""

    spec: prompts.ModelSpec  # the served model
    store: handles.SpanStore  # spans held by handle


# A route: (does this body carry spans?, handler). A handler gets the body, the request and the
# context, and returns a response to send, or a ``StockRequest``.
Detector = Callable[[dict], bool]
Handler = Callable[[dict, Request, RouteContext], Awaitable[Any]]


async def generate_route(body: dict, request: Request, ctx: RouteContext) -> Any:
    from sglang.srt.entrypoints import http_server  # SGLang not ready at plugin load

    # a ValueError is the client's 400 (SpanMiddleware)
    obj = await asyncio.to_thread(prompts.make_generate_req, body, ctx.spec, ctx.store, True)
    return await http_server.serve_generate_request(obj, request)


async def completions_route(body: dict, request: Request, ctx: RouteContext) -> StockRequest:
    return StockRequest(*await asyncio.to_thread(openai.completions_body, body, ctx.spec,
                                                 ctx.store))


async def chat_route(body: dict, request: Request, ctx: RouteContext) -> StockRequest:
    return StockRequest(*await asyncio.to_thread(openai.chat_body, body, ctx.spec, ctx.store))


ROUTES: dict[str, tuple[Detector, Handler]] = {
    "/generate": (parse.has_span_fields, generate_route),
    "/v1/completions": (parse.has_span_fields, completions_route),
    "/v1/chat/completions": (openai.chat_has_spans, chat_route),
}


class SpanMiddleware:
    """Routes requests that carry span fields to our handlers; everything else passes through.
    With tenants (``tenants.py``), each request runs as its API key's tenant, or is refused."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store = handles.SpanStore(handles.budget_bytes(), tenants.count())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        table = tenants.key_table()
        if table is None or scope["type"] != "http" or tenants.is_open(scope.get("path", "")):
            return await self._serve(scope, receive, send)
        tenant = tenants.tenant_of(asgi.header(scope, b"authorization"), table)
        if tenant is None:  # as SGLang's --api-key check answers
            response = asgi.error_response("a tenant's API key is required (Authorization: Bearer <key>)",
                                           401, kind="Unauthorized")
            return await response(scope, receive, send)
        with tenants.acting_for(tenant):
            await self._serve(scope, receive, send)

    async def _serve(self, scope: dict, receive: Callable, send: Callable) -> None:
        path, method = scope.get("path", ""), scope.get("method")
        if scope["type"] == "http" and path.startswith(own_routes.PREFIX):
            return await own_routes.serve(path, method, self.store, scope, receive, send)
        if scope["type"] == "http" and path == own_routes.MODEL_INFO_PATH and method == "GET":
            return await own_routes.model_info_with_ours(self.app, self.store, scope, receive, send)
        route = ROUTES.get(path) if scope["type"] == "http" else None
        if route is None or method not in ("POST", "PUT"):
            return await self.app(scope, receive, send)
        body, too_big = await asgi.read_body(scope, receive, asgi.max_body_bytes())
        if too_big:
            limit = asgi.max_body_bytes()
            response = asgi.error_response(f"request body exceeds the limit of {limit} bytes", 413)
            return await response(scope, receive, send)
        replay = asgi.replay(body, receive)
        # a binary body's spans are decoded here, within the served model's budget (a JSON
        # body's by the route)
        spec = asgi.server_spec() if asgi.is_binary(scope) else None
        try:
            payload = asgi.parse_body(scope, body, spec.max_span_bytes if spec else None)
        except ValueError as e:  # a malformed binary body
            return await asgi.error_response(str(e))(scope, replay, send)
        detect, handler = route
        if not isinstance(payload, dict):
            return await self.app(scope, replay, send)
        if not detect(payload):  # a stock body: only its token ids are checked here
            ids = token_ids.stock_ids(path, payload)
            if ids is not None:
                field, value = ids
                try:
                    token_ids.check_id_lists(value, asgi.server_spec().vocab_size, field)
                except ValueError as e:
                    return await asgi.error_response(str(e))(scope, replay, send)
            if asgi.is_binary(scope):  # the stock route reads JSON
                return await self._forward_to_stock_route(scope, StockRequest(payload, None),
                                                          receive, send)
            return await self.app(scope, replay, send)
        try:
            ctx = RouteContext(spec or asgi.server_spec(), self.store)
            response = await handler(payload, Request(scope, replay), ctx)
        except handles.UnknownSpanHandle as e:  # machine-readable: the client resends the rows
            response = asgi.error_response(str(e), kind=UNKNOWN_HANDLE_TYPE, param=e.handle)
        except ValueError as e:
            response = asgi.error_response(str(e))
        if isinstance(response, StockRequest):
            return await self._forward_to_stock_route(scope, response, receive, send)
        await response(scope, replay, send)

    async def _forward_to_stock_route(self, scope: dict, stock: StockRequest, receive: Callable,
                                      send: Callable) -> None:
        """SGLang's own route serves the rewritten body, as JSON, while ``stock`` is the request
        being served (``stock_request.serving``): its ``generate_request`` call attaches the
        prompt's rows (``openai.generate_request``)."""
        try:
            raw = orjson.dumps(stock.body)
        except orjson.JSONEncodeError:  # a binary body's span where this route reads none
            response = asgi.error_response(f"{scope['path']} reads no span where this binary body "
                                           "puts one: send the spans in its span fields")
            return await response(scope, receive, send)
        scope = asgi.with_length(scope, len(raw), b"application/json")
        with serving(stock):
            await self.app(scope, asgi.replay(raw, receive), send)
