"""EmbedsEndpoint.run and the binary body, against a fake HTTP server (no SGLang): span rows go as
raw bytes, bit for bit, where the server advertises the binary body; a gateway that reads bodies
as JSON refuses it, and the endpoint sends that request once more as JSON and JSON from then on;
the server's own 400 for bad rows is not sent again."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sglang as sgl
import torch

from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_srt import binary_body, keys, wire
from sgl_embeds_srt.segments import Embeds, Text

HIDDEN = 8
JSON_TYPE = "application/json"
# axum's refusals of a body its Json extractor cannot take, as smg answers them
GATEWAY_REFUSALS = {
    415: "Expected request with `Content-Type: application/json`",
    400: "Failed to parse the request body as JSON: expected value at line 1 column 1",
    422: "Failed to deserialize the JSON body into the target type: missing field `text`",
}
BAD_ROWS = {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
            "message": "segment 1: embeddings contain NaN or Inf (first in row 0)"}


class FakeServer:
    """A plugin worker over HTTP: ``/get_model_info`` advertises the binary body; ``/generate``
    decodes either body (the binary one with the server's ``binary_body.decode_body``), answers a
    handle it does not hold with UnknownSpanHandle and keeps inline rows sent with keep_spans.
    With ``gateway_refusal`` a JSON-typed gateway stands in front and refuses any other body with
    that status (a plain-text body, as axum's); with ``bad_rows`` the worker refuses every span
    request as the plugin refuses NaN rows. Records (content type, request) of every post."""

    def __init__(self, gateway_refusal: int | None = None, bad_rows: bool = False) -> None:
        self.gateway_refusal, self.bad_rows = gateway_refusal, bad_rows
        self.held: set[str] = set()
        self.posts: list[tuple[str, dict | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                info = {"hidden_size": HIDDEN, "binary_body": binary_body.CONTENT_TYPE}
                self.answer(200, {"model_path": "fake", "sgl_embeds": info})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                self.answer(*fake.generate(self.headers.get("Content-Type", ""), raw))

            def answer(self, status: int, payload: dict | str) -> None:
                plain = isinstance(payload, str)
                data = (payload if plain else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if plain else JSON_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def generate(self, content_type: str, raw: bytes) -> tuple[int, dict | str]:
        content_type = content_type.split(";")[0]
        if self.gateway_refusal and content_type != JSON_TYPE:
            self.posts.append((content_type, None))
            return self.gateway_refusal, GATEWAY_REFUSALS[self.gateway_refusal]
        binary = binary_body.is_binary(content_type)
        request = binary_body.decode_body(raw) if binary else json.loads(raw)
        self.posts.append((content_type, request))
        spans = spans_of(request)
        if spans and self.bad_rows:
            return 400, BAD_ROWS
        for span in spans:
            if isinstance(span, dict) and "handle" in span:
                if span["handle"] not in self.held:
                    return 400, {"object": "error", "type": keys.UNKNOWN_HANDLE_TYPE,
                                 "param": span["handle"], "message": "unknown handle"}
            elif request.get("keep_spans"):
                self.held.add(keys.span_handle(wire.decode_tensor(span)))
        return 200, {"text": "ok", "output_ids": [1], "meta_info": {"prompt_tokens": 3}}

    def __enter__(self) -> "FakeServer":
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()


def spans_of(request: dict) -> list:
    """The spans of a /generate request: its input_embeds, or its segments' embeds."""
    if "input_embeds" in request:
        x = request["input_embeds"]
        return list(x) if isinstance(x, list) else [x]
    prompts = request.get("input_segments") or []
    prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
    return [s["embeds"] for p in prompts for s in p if s["type"] == "embeds"]


def kinds(posts: list) -> list[str]:
    """Each post as (body form, how its first span went)."""
    out = []
    for content_type, request in posts:
        form = "binary" if binary_body.is_binary(content_type) else "json"
        if request is None:
            out.append(f"{form}: refused")
            continue
        span = spans_of(request)[0]
        how = "handle" if isinstance(span, dict) and "handle" in span else "inline"
        out.append(f"{form}: {how}" + (" + keep" if request.get("keep_spans") else ""))
    return out


def same_bits(got: torch.Tensor, sent: torch.Tensor) -> bool:
    return (got.dtype == sent.dtype and got.shape == sent.shape
            and bytes(keys.raw_bytes(got)) == bytes(keys.raw_bytes(sent)))


def rows(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def worker():
    with FakeServer() as server:
        yield server


def test_span_rows_go_as_a_binary_body_bit_for_bit(worker):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml", span_handles=False)
    assert ep.sends_binary
    a, b = rows(1, 5, torch.bfloat16), rows(2, 3)
    prompt = [Text("look "), Embeds(a), Text(" and "), Embeds(b)]
    ep.run(input_segments=prompt, sampling_params={"max_new_tokens": 2})
    [(content_type, request)] = worker.posts
    assert content_type == binary_body.CONTENT_TYPE
    got = spans_of(request)
    assert same_bits(got[0], a) and same_bits(got[1], b)
    assert request["text"] == keys.routing_text(prompt)  # the routing hint rides in the head
    assert request["sampling_params"] == {"max_new_tokens": 2}

    batch = [rows(3, 2), rows(4, 6, torch.float16)]
    ep.run(input_embeds=batch)
    content_type, request = worker.posts[-1]
    assert content_type == binary_body.CONTENT_TYPE
    assert all(same_bits(g, s) for g, s in zip(spans_of(request), batch, strict=True))

    ep.run(text="no spans")
    assert worker.posts[-1] == (JSON_TYPE, {"sampling_params": {}, "text": "no spans"})


def test_handles_on_the_binary_path(worker):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml")
    prompt = [Text("look "), Embeds(rows(5, 4))]
    for _ in range(2):
        ep.run(input_segments=prompt)
    worker.held.clear()  # the server lost it: refused by handle, sent again inline
    ep.run(input_segments=prompt)
    assert kinds(worker.posts) == ["binary: inline + keep", "binary: handle",
                                   "binary: handle", "binary: inline + keep"]
    assert same_bits(spans_of(worker.posts[-1][1])[0], rows(5, 4))


@pytest.mark.parametrize("status", sorted(GATEWAY_REFUSALS))
def test_a_gateway_that_refuses_the_binary_body_gets_json_from_then_on(status):
    with FakeServer(gateway_refusal=status) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        assert ep.sends_binary  # the gateway forwards the workers' advertisement
        a = rows(6, 4)
        prompt = [Text("look "), Embeds(a)]
        assert ep.run(input_segments=prompt)["output_ids"] == [1]
        assert not ep.sends_binary
        # once more as JSON, the rows inline (the refused request was never kept), with the hint
        assert kinds(gateway.posts) == ["binary: refused", "json: inline + keep"]
        resent = gateway.posts[-1][1]
        assert same_bits(wire.decode_tensor(spans_of(resent)[0]), a)
        assert resent["text"] == keys.routing_text(prompt)
        ep.run(input_segments=prompt)
        ep.run(input_embeds=rows(7, 3))
        assert kinds(gateway.posts)[2:] == ["json: handle", "json: inline + keep"]


def test_the_servers_own_400_for_bad_rows_is_not_sent_again():
    with FakeServer(bad_rows=True) as server:
        ep = EmbedsEndpoint(server.url, chat_template_name="chatml")
        with pytest.raises(ValueError, match=r"\(400\): segment 1: embeddings contain NaN"):
            ep.run(input_segments=[Text("look "), Embeds(rows(8, 2))])
        assert kinds(server.posts) == ["binary: inline + keep"] and ep.sends_binary


@pytest.mark.parametrize("options", [{"send_binary": False}, {"wire_format": "json"}])
def test_json_when_asked(worker, options):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml", **options)
    assert not ep.sends_binary
    ep.run(input_segments=[Embeds(rows(9, 2))])
    assert kinds(worker.posts) == ["json: inline + keep"]


@sgl.function
def look(s, rows):
    s += "look " + sgl.embeds(rows) + " and say"
    s += sgl.gen("answer", max_tokens=2)


def test_programs_send_their_spans_as_a_binary_body(worker):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml")
    a = rows(9, 4, torch.bfloat16)
    for _ in range(2):
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
    assert kinds(worker.posts) == ["binary: inline + keep", "binary: handle"]
    assert same_bits(spans_of(worker.posts[0][1])[0], a)
    worker.held.clear()  # the server lost it: refused by handle, sent again inline, still binary
    assert look.run(rows=a, backend=ep)["answer"] == "ok"  # (reading it waits for the run)
    assert kinds(worker.posts)[2:] == ["binary: handle", "binary: inline + keep"]


def test_a_program_behind_a_gateway_that_refuses_binary_bodies_goes_as_json():
    with FakeServer(gateway_refusal=415) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        a = rows(10, 3)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts) == ["binary: refused", "json: inline + keep"] and not ep.sends_binary
        assert same_bits(wire.decode_tensor(spans_of(gateway.posts[-1][1])[0]), a)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts)[2:] == ["json: handle"]


def test_a_program_body_written_binary_goes_as_json_if_binary_was_refused_before_its_post(monkeypatch):
    """Calls of one endpoint run in parallel (run_batch, forks): another call's binary body may
    be refused between this body's writing (rows as tensors) and its post; it goes as JSON."""
    with FakeServer(gateway_refusal=415) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        write = EmbedsEndpoint._add_images

        def write_then_refused_elsewhere(self, s, data):
            write(self, s, data)
            self.sends_binary = False

        monkeypatch.setattr(EmbedsEndpoint, "_add_images", write_then_refused_elsewhere)
        a = rows(11, 3)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts) == ["json: inline + keep"]
        assert same_bits(wire.decode_tensor(spans_of(gateway.posts[0][1])[0]), a)


def test_a_refusal_sent_before_the_body_is_read_is_the_answer():
    """Something in between may answer a binary body from its headers and close without reading
    the rest (smg does, for a content type it does not take). The parts left then meet a closed
    socket: the post returns the answer, so the endpoint falls back to JSON, instead of raising."""
    import socket
    import threading

    from sgl_embeds.backend import _post_bytes

    listener = socket.create_server(("127.0.0.1", 0))
    answer = b'{"error": "Expected request with `Content-Type: application/json`"}'

    def refuse_from_the_headers():
        conn, _ = listener.accept()
        seen = b""
        while b"\r\n\r\n" not in seen:
            seen += conn.recv(4096)
        conn.sendall(b"HTTP/1.1 415 Unsupported Media Type\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer))
        conn.close()  # the body unread
        listener.close()

    threading.Thread(target=refuse_from_the_headers, daemon=True).start()
    big = torch.zeros(4096, 1024)  # 16 MB: far more than the socket buffers hold
    parts = binary_body.encode_parts({"input_embeds": big})
    res = _post_bytes(f"http://127.0.0.1:{listener.getsockname()[1]}/generate", parts,
                      {"Content-Type": binary_body.CONTENT_TYPE}, None)
    assert res.status_code == 415 and "Content-Type" in res.json()["error"]
