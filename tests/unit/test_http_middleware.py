"""The HTTP middleware in-process (no server): pass-through, body limit, routing of span bodies
(JSON and binary), the upload route, and its installation at launch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from types import SimpleNamespace

import orjson
import pytest
import torch

from sgl_embeds_protocol import binary_body, wire
from sgl_embeds_srt import handles, http, parse
from sgl_embeds_srt.prompts import ModelSpec
from sgl_embeds_srt.http import asgi, middleware, own_routes
from sgl_embeds_protocol.info import ServerInfo

BINARY = [(b"content-type", binary_body.CONTENT_TYPE.encode())]


def _call(mw, body: bytes, path: str = "/generate", method: str = "POST", headers: list | None = None):
    sent, seen = [], {}
    chunks = [body[i : i + 7] for i in range(0, len(body), 7)] or [b""]

    async def receive():
        if chunks:
            c = chunks.pop(0)
            return {"type": "http.request", "body": c, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "path": path, "method": method, "headers": headers or [], "query_string": b""}
    asyncio.run(mw(scope, receive, send))
    return sent, seen


class _App:
    def __init__(self):
        self.bodies, self.scopes = [], []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"stock"})


def test_bodies_without_span_fields_reach_the_stock_route_intact():
    app = _App()
    payload = json.dumps({"text": "hello", "sampling_params": {}}).encode()
    sent, _ = _call(middleware.SpanMiddleware(app), payload)
    assert app.bodies == [payload] and sent[-1]["body"] == b"stock"
    _call(middleware.SpanMiddleware(app), b"{broken")
    assert app.bodies[-1] == b"{broken"
    _call(middleware.SpanMiddleware(app), b'{"input_segments": 1}', path="/health", method="GET")
    assert app.bodies[-1] == b'{"input_segments": 1}'


def test_a_body_over_the_limit_gets_413_without_reaching_the_app(monkeypatch):
    monkeypatch.setenv("SGLANG_EMBEDS_MAX_BODY_BYTES", "20")
    app = _App()
    sent, _ = _call(middleware.SpanMiddleware(app), b'{"input_embeds": [[1.0, 2.0, 3.0, 4.0]]}')
    assert not app.bodies
    assert sent[0]["status"] == 413 and b"exceeds the limit of 20 bytes" in sent[-1]["body"]


def test_span_bodies_go_to_the_registered_handler(monkeypatch):
    calls = []

    async def handler(body, request, ctx):
        calls.append(body)
        return asgi.error_response("handled", 400)

    monkeypatch.setattr(asgi, "server_spec", lambda: None)  # no server here: the handler ignores it
    monkeypatch.setitem(middleware.ROUTES, "/generate", (lambda body: "input_embeds" in body, handler))
    app = _App()
    sent, _ = _call(middleware.SpanMiddleware(app), b'{"input_embeds": [[1.0]]}')
    assert calls == [{"input_embeds": [[1.0]]}] and not app.bodies and sent[0]["status"] == 400


def test_a_stock_request_reaches_the_stock_route_whose_generate_request_call_gets_its_rows(monkeypatch):
    """The stock route's ``TokenizerManager.generate_request`` call, made while the route serves
    the request (here: inside the app, and inside a task the app starts, as a streamed answer's
    generator runs), gets the prompt's rows; a call outside the route's time gets none."""
    from starlette.requests import Request

    from sgl_embeds_srt import openai

    prompt_rows = object()

    async def handler(body, request, ctx):
        return middleware.StockRequest({"prompt": [1, 2, 3]}, prompt_rows)

    class Obj:
        positional_embed_overrides = None

    seen = []

    def generate_request(request):
        openai.generate_request(lambda self, o, r: seen.append(o.positional_embed_overrides), None, Obj(), request)

    class RouteApp(_App):
        async def __call__(self, scope, receive, send):
            generate_request(Request(scope))
            await asyncio.get_running_loop().create_task(asyncio.to_thread(lambda: None))
            await asyncio.create_task(self._in_a_task(scope))
            await super().__call__(scope, receive, send)

        async def _in_a_task(self, scope):
            generate_request(Request(scope))

    monkeypatch.setattr(asgi, "server_spec", lambda: None)
    monkeypatch.setitem(middleware.ROUTES, "/v1/completions", (lambda body: True, handler))
    app = RouteApp()
    _call(middleware.SpanMiddleware(app), b'{"input_embeds": [[1.0]]}', path="/v1/completions")
    assert app.bodies == [b'{"prompt":[1,2,3]}']
    headers = dict(app.scopes[0]["headers"])
    assert headers[b"content-length"] == str(len(app.bodies[0])).encode()
    generate_request(Request(app.scopes[0]))  # after the route returned
    openai.generate_request(lambda self, o, r: seen.append(o.positional_embed_overrides), None, Obj(), None)
    assert seen == [prompt_rows, prompt_rows, None, None]


def test_launch_installs_the_middleware_once_and_points_workers_at_the_worker_app(monkeypatch):
    from sglang.srt.entrypoints.http_server import app

    monkeypatch.setattr(app, "user_middleware", list(app.user_middleware))
    monkeypatch.setenv("SGLANG_HTTP_SERVER_APP_PATH", "sglang.srt.entrypoints.http_server:app")
    for _ in range(2):
        http.before_launch_server(SimpleNamespace(tokenizer_worker_num=2))
    assert [m.cls for m in app.user_middleware].count(middleware.SpanMiddleware) == 1
    module, _, name = os.environ["SGLANG_HTTP_SERVER_APP_PATH"].partition(":")
    assert (module, name) == ("sgl_embeds_srt.http.worker_app", "app")
    assert importlib.util.find_spec(module) is not None


def _recording_handler(monkeypatch, path: str = "/generate") -> list:
    """The bodies ``path``'s handler is called with (it answers 400 "handled")."""
    calls = []

    async def handler(body, request, ctx):
        calls.append(body)
        return asgi.error_response("handled", 400)

    monkeypatch.setattr(asgi, "server_spec", lambda: SimpleNamespace(vocab_size=100, hidden_size=8, max_span_bytes=wire.MAX_SPAN_BYTES))
    monkeypatch.setitem(middleware.ROUTES, path, (parse.has_span_fields, handler))
    return calls


def test_a_binary_body_reaches_the_handler_as_its_json_form_with_tensors(monkeypatch):
    calls, app = _recording_handler(monkeypatch), _App()
    rows = torch.randn(3, 8).bfloat16()
    request = {"input_segments": [{"type": "text", "text": "a"}, {"type": "embeds", "embeds": rows}]}
    body, _ = binary_body.encode_body(request)
    sent, _ = _call(middleware.SpanMiddleware(app), body, headers=BINARY)
    assert not app.bodies and sent[0]["status"] == 400 and b"handled" in sent[-1]["body"]
    [got] = calls
    assert got["input_segments"][0] == {"type": "text", "text": "a"}
    assert torch.equal(got["input_segments"][1]["embeds"], rows)


def test_a_malformed_binary_body_is_a_400_naming_the_fault(monkeypatch):
    calls, app = _recording_handler(monkeypatch), _App()
    body, _ = binary_body.encode_body({"input_embeds": torch.zeros(2, 8)})
    sent, _ = _call(middleware.SpanMiddleware(app), body[:-8], headers=BINARY)  # truncated
    assert sent[0]["status"] == 400 and not calls and not app.bodies
    assert b"input_embeds: data_offsets [0, 64] end past the 56 bytes after the head" in sent[-1]["body"]
    json_body = orjson.dumps({"input_embeds": [[0.0] * 8]})  # JSON sent as binary
    sent, _ = _call(middleware.SpanMiddleware(app), json_body, headers=BINARY)
    assert sent[0]["status"] == 400 and b"the JSON head is declared" in sent[-1]["body"]


def test_a_binary_body_without_spans_reaches_the_stock_route_as_json(monkeypatch):
    calls, app = _recording_handler(monkeypatch), _App()
    request = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    body, _ = binary_body.encode_body(request)
    _call(middleware.SpanMiddleware(app), body, headers=BINARY + [(b"content-length", b"1")])
    assert not calls and orjson.loads(app.bodies[0]) == request
    headers = dict(app.scopes[0]["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"content-length"] == str(len(app.bodies[0])).encode()
    chat = {"messages": [{"role": "user", "content": [{"type": "input_embeds", "input_embeds": torch.zeros(1, 8)}]}]}
    sent, _ = _call(middleware.SpanMiddleware(app), binary_body.encode_body(chat)[0], headers=BINARY)
    assert sent[0]["status"] == 400 and b"/generate reads no span where this binary body puts one" in sent[-1]["body"]
    assert len(app.bodies) == 1


def test_the_upload_route_takes_a_binary_body(monkeypatch):
    monkeypatch.setattr(asgi, "server_spec", lambda: ModelSpec(8, torch.float32, 100, 64, None))
    mw, rows = middleware.SpanMiddleware(_App()), torch.randn(4, 8).half()
    sent, _ = _call(mw, binary_body.encode_body({"embeds": rows})[0], path="/sgl_embeds/spans", headers=BINARY)
    uploaded = orjson.loads(sent[-1]["body"])
    assert sent[0]["status"] == 200 and uploaded["shape"] == [4, 8] and uploaded["dtype"] == "float16"
    assert torch.equal(mw.store.get(uploaded["handle"]).rows, rows)
    bad = binary_body.encode_body({"embeds": torch.full((1, 8), float("inf"))})[0]
    sent, _ = _call(mw, bad, path="/sgl_embeds/spans", headers=BINARY)
    assert sent[0]["status"] == 400 and b"NaN or Inf" in sent[-1]["body"]
    sent, _ = _call(mw, b"\x01", path="/sgl_embeds/spans", headers=BINARY)
    assert sent[0]["status"] == 400 and b"8-byte length" in sent[-1]["body"]


def test_info_advertises_the_binary_body_and_the_key_scheme(monkeypatch):
    spec = ModelSpec(8, torch.float32, 100, 64, None)
    monkeypatch.setattr(asgi, "server_spec", lambda: spec)
    monkeypatch.setattr(own_routes.transport, "stats", lambda: {})
    info = own_routes.info(handles.SpanStore(1 << 20))
    assert info["binary_body"] == "application/x-sgl-embeds" and info["key_scheme"] == "blake3-rows/v3"
    assert info["span_width"] == 8 and info["vision"] is None  # a text model: a span is [n, hidden]


def test_the_info_message_reads_back_as_written_and_names_what_is_missing(monkeypatch):
    spec = ModelSpec(8, torch.float32, 100, 64, None)
    monkeypatch.setattr(asgi, "server_spec", lambda: spec)
    monkeypatch.setattr(own_routes.transport, "stats", lambda: None)
    message = orjson.loads(orjson.dumps(own_routes.info(handles.SpanStore(1 << 20))))  # as it travels
    read = ServerInfo.from_json({**message, "added_later": 1})  # a newer server's field is ignored
    assert read.to_json() == message and read.model.served_as == "text" and read.span_width == 8
    with pytest.raises(ValueError, match=r"lacks key_scheme, span_width: the server runs another version"):
        ServerInfo.from_json({k: v for k, v in message.items() if k not in ("key_scheme", "span_width")})
    with pytest.raises(ValueError, match="its model lacks grid"):
        ServerInfo.from_json({**message, "model": {k: v for k, v in message["model"].items() if k != "grid"}})


def _read(chunks: list[bytes], headers: list, limit: int = 1 << 20, disconnect: bool = False):
    """``asgi.read_body`` over ``chunks`` (then a disconnect, if asked); also how many were read."""
    left = list(chunks)

    async def receive():
        if left:
            c = left.pop(0)
            return {"type": "http.request", "body": c, "more_body": bool(left) or disconnect}
        return {"type": "http.disconnect"}

    scope = {"type": "http", "headers": headers}
    return asyncio.run(asgi.read_body(scope, receive, limit)), len(chunks) - len(left)


def test_a_binary_body_of_a_declared_length_is_read_into_one_buffer():
    body = binary_body.encode_body({"input_embeds": torch.randn(5, 8)})[0]
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)]
    declared = [*BINARY, (b"content-length", str(len(body)).encode())]
    (got, too_big), _ = _read(chunks, declared)
    assert not too_big and isinstance(got, memoryview) and bytes(got) == body
    assert torch.equal(binary_body.decode_body(got)["input_embeds"], binary_body.decode_body(body)["input_embeds"])
    # a client gone before the end: the bytes that came, which the decoder calls truncated
    (got, too_big), _ = _read(chunks[:5], declared, disconnect=True)
    assert not too_big and bytes(got) == body[:35]
    with pytest.raises(wire.WireError, match="truncated"):
        binary_body.decode_body(got)
    # declared over the limit: refused before a byte is read or a buffer allocated
    assert _read(chunks, declared, limit=len(body) - 1) == ((b"", True), 0)
    # no declared length, or a JSON body: the chunks joined, as bytes
    for headers in (BINARY, [(b"content-length", str(len(body)).encode())]):
        (got, too_big), _ = _read(chunks, headers)
        assert not too_big and type(got) is bytes and got == body
    assert _read(chunks, BINARY, limit=20) == ((b"", True), 3)
    # more than declared (no HTTP server passes that on): still the whole body, joined
    (got, too_big), _ = _read(chunks, [*BINARY, (b"content-length", b"10")])
    assert not too_big and got == body
