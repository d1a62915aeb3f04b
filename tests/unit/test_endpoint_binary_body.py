"""EmbedsEndpoint.run and the binary body, against a fake HTTP server (no SGLang, its own reader of
the documented formats: ``tests/fake_server.py``): span rows go as raw bytes, bit for bit, where the server advertises the binary body; a gateway that reads bodies
as JSON refuses it, and the endpoint sends that request once more as JSON and JSON from then on;
the server's own 400 for bad rows is not sent again."""

from __future__ import annotations

import pytest
import sglang as sgl
import torch

from fake_server import BAD_ROWS, GATEWAY_REFUSALS, JSON_TYPE, FakePluginServer, kinds, read_tensor, spans_of
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_protocol import binary_body, keys
from sgl_embeds_protocol.segments import Span, Text

HIDDEN = 8


def same_bits(got: torch.Tensor, sent: torch.Tensor) -> bool:
    return (got.dtype == sent.dtype and got.shape == sent.shape
            and bytes(keys.raw_bytes(got)) == bytes(keys.raw_bytes(sent)))


def rows(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def worker():
    with FakePluginServer(HIDDEN) as server:
        yield server


def test_span_rows_go_as_a_binary_body_bit_for_bit(worker):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml", span_handles=False)
    assert ep.sends_binary
    a, b = rows(1, 5, torch.bfloat16), rows(2, 3)
    prompt = [Text("look "), Span(a), Text(" and "), Span(b)]
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
    prompt = [Text("look "), Span(rows(5, 4))]
    for _ in range(2):
        ep.run(input_segments=prompt)
    worker.held.clear()  # the server lost it: refused by handle, sent again inline
    ep.run(input_segments=prompt)
    assert kinds(worker.posts) == ["binary: inline + keep", "binary: handle",
                                   "binary: handle", "binary: inline + keep"]
    assert same_bits(spans_of(worker.posts[-1][1])[0], rows(5, 4))


@pytest.mark.parametrize("status", sorted(GATEWAY_REFUSALS))
def test_a_gateway_that_refuses_the_binary_body_gets_json_from_then_on(status):
    with FakePluginServer(HIDDEN, gateway_refusal=status) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        assert ep.sends_binary  # the gateway forwards the workers' advertisement
        a = rows(6, 4)
        prompt = [Text("look "), Span(a)]
        assert ep.run(input_segments=prompt)["output_ids"] == [1]
        assert not ep.sends_binary
        # once more as JSON, the rows inline (the refused request was never kept), with the hint
        assert kinds(gateway.posts) == ["binary: refused", "json: inline + keep"]
        resent = gateway.posts[-1][1]
        assert same_bits(read_tensor(spans_of(resent)[0]), a)
        assert resent["text"] == keys.routing_text(prompt)
        ep.run(input_segments=prompt)
        ep.run(input_embeds=rows(7, 3))
        assert kinds(gateway.posts)[2:] == ["json: handle", "json: inline + keep"]


def test_the_servers_own_400_for_bad_rows_is_not_sent_again():
    with FakePluginServer(HIDDEN, refusal=BAD_ROWS) as server:
        ep = EmbedsEndpoint(server.url, chat_template_name="chatml")
        with pytest.raises(ValueError, match=r"\(400\): segment 1: embeddings contain NaN"):
            ep.run(input_segments=[Text("look "), Span(rows(8, 2))])
        assert kinds(server.posts) == ["binary: inline + keep"] and ep.sends_binary


@pytest.mark.parametrize("options", [{"send_binary": False}, {"wire_format": "json"}])
def test_json_when_asked(worker, options):
    ep = EmbedsEndpoint(worker.url, chat_template_name="chatml", **options)
    assert not ep.sends_binary
    ep.run(input_segments=[Span(rows(9, 2))])
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
    with FakePluginServer(HIDDEN, gateway_refusal=415) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        a = rows(10, 3)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts) == ["binary: refused", "json: inline + keep"] and not ep.sends_binary
        assert same_bits(read_tensor(spans_of(gateway.posts[-1][1])[0]), a)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts)[2:] == ["json: handle"]


def test_a_program_body_written_binary_goes_as_json_if_binary_was_refused_before_its_post(monkeypatch):
    """Calls of one endpoint run in parallel (run_batch, forks): another call's binary body may
    be refused between this body's writing (rows as tensors) and its post; it goes as JSON."""
    with FakePluginServer(HIDDEN, gateway_refusal=415) as gateway:
        ep = EmbedsEndpoint(gateway.url, chat_template_name="chatml")
        write = EmbedsEndpoint._add_images

        def write_then_refused_elsewhere(self, s, data):
            write(self, s, data)
            self.sends_binary = False

        monkeypatch.setattr(EmbedsEndpoint, "_add_images", write_then_refused_elsewhere)
        a = rows(11, 3)
        assert look.run(rows=a, backend=ep)["answer"] == "ok"
        assert kinds(gateway.posts) == ["json: inline + keep"]
        assert same_bits(read_tensor(spans_of(gateway.posts[0][1])[0]), a)


def test_a_refusal_sent_before_the_body_is_read_is_the_answer():
    """Something in between may answer a binary body from its headers and close without reading
    the rest (smg does, for a content type it does not take). The parts left then meet a closed
    socket: the post returns the answer, so the endpoint falls back to JSON, instead of raising."""
    import socket
    import threading

    from sgl_embeds.sender import _post_bytes

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


def test_rows_wider_than_the_served_dtype_go_narrowed_to_it():
    """float32 rows to a bfloat16 server go in bfloat16 (the server casts them so anyway); rows
    no wider go as they are; a wire_dtype the user gives wins; a float32 server changes nothing."""
    from sgl_embeds.writer import SpanWriter

    f32, f16, bf16 = rows(1, 2), rows(2, 2, torch.float16), rows(3, 2, torch.bfloat16)
    to_bf16 = SpanWriter(HIDDEN, served_dtype="bfloat16")
    assert [to_bf16.dtype_for(x) for x in (f32, f16, bf16, f32.numpy())] == ["bfloat16", None, None, "bfloat16"]
    assert to_bf16._wire_tensor(f32).dtype == torch.bfloat16 and same_bits(to_bf16._wire_tensor(f16), f16)
    assert SpanWriter(HIDDEN, wire_dtype="float32", served_dtype="bfloat16").dtype_for(f32) == "float32"
    assert [SpanWriter(HIDDEN, served_dtype="float32").dtype_for(x) for x in (f32, bf16)] == [None, None]
