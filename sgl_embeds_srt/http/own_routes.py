"""The plugin's own REST routes, served by the middleware before SGLang's app sees them.

``GET /sgl_embeds/info`` (``info``; also inside ``GET /get_model_info``, which a gateway
forwards), ``POST /sgl_embeds/spans`` (``handles.upload``) and ``DELETE
/sgl_embeds/spans/<handle>`` (here and in the scheduler: ``transport.release``).
docs/reference.md, "Span handles".
"""

from __future__ import annotations

import asyncio
import os
from importlib.metadata import version
from typing import Any, Callable

import orjson

from sgl_embeds_protocol import binary_body, family, keys, wire
from sgl_embeds_srt import handles, tenants, transport
from sgl_embeds_srt.http import asgi
from sgl_embeds_protocol.info import ServerInfo

PREFIX = "/sgl_embeds/"
INFO_PATH = "/sgl_embeds/info"
MODEL_INFO_PATH, MODEL_INFO_KEY = "/get_model_info", "sgl_embeds"


def info(store: handles.SpanStore) -> dict:
    """What a client needs to check spans before sending them (``info.ServerInfo``, as JSON)."""
    spec = asgi.server_spec()
    return ServerInfo(
        hidden_size=spec.hidden_size, dtype=str(spec.dtype).removeprefix("torch."),
        vocab_size=spec.vocab_size, context_len=spec.context_len,
        max_span_bytes=spec.max_span_bytes, wire_dtypes=sorted(wire.DTYPES),
        binary_body=binary_body.CONTENT_TYPE, key_scheme=keys.KEY_SCHEME,
        sglang_version=version("sglang"), sgl_embeds_version=version("sgl_embeds"),
        span_store=store.stats(), rows_to_scheduler=transport.stats(),
        http_worker_pid=os.getpid(),
        vision=spec.vision.info(spec.hidden_size, spec.largest_image_rows) if spec.vision is not None else None,
        span_width=spec.span_width,
        model=family.served_model(spec.model_path, spec.vision, spec.tokenizer, spec.model_type),
    ).to_json()


async def serve(path: str, method: str, store: handles.SpanStore, scope: dict, receive: Callable,
                send: Callable) -> None:
    """A request whose path starts with ``PREFIX``: one of the routes above, or a 404."""
    if path == INFO_PATH and method == "GET":
        response: Any = asgi.json_response(info(store))
    elif path == handles.PATH and method == "POST":
        body, too_big = await asgi.read_body(scope, receive, asgi.max_body_bytes())
        try:
            payload = None if too_big else asgi.parse_body(scope, body, store.budget)
            if not isinstance(payload, dict):
                raise ValueError("the body must be a JSON object (or a binary body, "
                                 f"{binary_body.CONTENT_TYPE}) within the size limit")
            uploaded = await asyncio.to_thread(handles.upload, payload, store, asgi.server_spec().check_width)
            response = asgi.json_response(uploaded)
        except ValueError as e:
            response = asgi.error_response(str(e))
    elif path.startswith(handles.PATH + "/") and method == "DELETE":
        handle = path[len(handles.PATH) + 1 :]
        found = store.delete(handle)
        transport.release(tenants.scoped(handle))  # the scheduler's copy too
        response = asgi.json_response({"deleted": found}, 200 if found else 404)
    else:
        response = asgi.error_response(f"no route {method} {path}", 404)
    await response(scope, receive, send)


async def model_info_with_ours(app: Any, store: handles.SpanStore, scope: dict, receive: Callable,
                               send: Callable) -> None:
    """SGLang's ``GET /get_model_info`` answer, with ``info`` added under ``MODEL_INFO_KEY``."""
    start: dict = {}
    chunks: list[bytes] = []

    async def keep(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, keep)
    body = b"".join(chunks)
    payload = asgi.parse_json(body) if start.get("status") == 200 else None
    if isinstance(payload, dict):
        payload[MODEL_INFO_KEY] = info(store)
        body = orjson.dumps(payload)
    await send(asgi.with_length(start, len(body)))
    await send({"type": "http.response.body", "body": body})
