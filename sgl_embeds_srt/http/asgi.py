"""What the middleware and the plugin's own routes share: request bodies over ASGI (JSON, or
the binary body of ``binary_body.py``), SGLang's error body, and the model this HTTP process
serves (``server_spec``)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import orjson
from starlette.responses import Response

from sgl_embeds_protocol import binary_body
from sgl_embeds_protocol.environment import setting
from sgl_embeds_srt.prompts import ModelSpec


def max_body_bytes() -> int:
    """Largest request body read for span detection or upload (``SGLANG_EMBEDS_MAX_BODY_BYTES``)."""
    return int(setting("SGLANG_EMBEDS_MAX_BODY_BYTES", 1 << 30))


def json_response(content: Any, status: int = 200) -> Response:
    """``content`` as JSON, by orjson as SGLang's routes do (FastAPI's orjson response class is
    deprecated and warned on every call)."""
    body = orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400, kind: str = "BadRequestError",
                   param: Any = None) -> Response:
    """SGLang's error body. A 4xx is the client's fault to a gateway: never retried, and never
    counted against the worker by its circuit breaker (docs/scaling.md)."""
    return json_response({"object": "error", "message": message, "type": kind, "param": param,
                          "code": status}, status)


def server_spec() -> ModelSpec:
    """The served model, as seen by this process's tokenizer manager."""
    from sglang.srt.entrypoints.http_server import _global_state  # SGLang not ready at plugin load

    return ModelSpec.from_tokenizer_manager(_global_state.tokenizer_manager)


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the stock route reports malformed JSON its own way


def is_binary(scope: dict) -> bool:
    """Whether the request's body is a binary body (``binary_body.CONTENT_TYPE``)."""
    return binary_body.is_binary(header(scope, b"content-type"))


def header(scope: dict, name: bytes) -> bytes | None:
    """A request header's value (``name`` lower-case), or None."""
    return next((v for k, v in scope.get("headers", []) if k.lower() == name), None)


def parse_body(scope: dict, body: bytes, max_span_bytes: int | None) -> Any:
    """The request a body holds: JSON as parsed (None if malformed), or a binary body's request
    with its spans as tensors (``wire.WireError`` if malformed: no stock route reads one, so its
    400 is ours). ``max_span_bytes``: a binary body's spans' limit, as float32."""
    if is_binary(scope):
        return binary_body.decode_body(body, max_span_bytes)
    return parse_json(body)


async def read_body(scope: dict, receive: Callable, limit: int) -> tuple[bytes | memoryview, bool]:
    """The request body and whether it exceeds ``limit`` bytes (then it is not read further).

    A binary body of a declared length is read into one buffer allocated for it, each chunk
    copied in as it arrives: the copy (and the buffer's new pages) overlaps the transfer,
    instead of a join of every chunk once the last has come (a body of a short transfer, a
    client gone, is the bytes that came). Any other body, or one longer than declared, is
    joined (``bytes``, as SGLang's own routes read it)."""
    declared = _content_length(scope) if is_binary(scope) else None
    if declared is not None and declared > limit:
        return b"", True
    buffer = None if declared is None else np.empty(declared, np.uint8)  # pages untouched yet
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        if size + len(chunk) > limit:
            return b"", True
        if buffer is not None and size + len(chunk) > declared:  # never from an HTTP server
            chunks, buffer = [buffer[:size].tobytes()], None
        if buffer is not None:
            buffer[size:size + len(chunk)] = np.frombuffer(chunk, np.uint8)
        else:
            chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            break
    return (b"".join(chunks) if buffer is None else memoryview(buffer[:size])), False


def _content_length(scope: dict) -> int | None:
    value = header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def with_length(message: dict, n: int, content_type: bytes | None = None) -> dict:
    """A request scope or response start with its content-length set to ``n`` (and its
    content-type to ``content_type``, if given)."""
    replaced = {b"content-length"} | ({b"content-type"} if content_type else set())
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in replaced]
    headers.append((b"content-length", str(n).encode()))
    if content_type:
        headers.append((b"content-type", content_type))
    return {**message, "headers": headers}


def replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands the already-read body over once, then defers to the real one
    (so disconnects are still seen by streaming responses)."""
    handed_over = False

    async def receive_again() -> dict:
        nonlocal handed_over
        if not handed_over:
            handed_over = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again
