"""A fake plugin worker over HTTP (no SGLang), shared by the client's unit tests.

It reads requests with its own few-line reader of the documented formats (docs/concepts.md: a
wire tensor, the binary body) and names spans with the documented content-key formula, written
here with the ``blake3`` package alone: a bug in the client's encoder, or in the shared
``binary_body`` / ``keys`` code, shows here instead of cancelling out.

``/get_model_info`` advertises the binary body; ``/generate`` answers a handle it does not hold
with ``UnknownSpanHandle`` and holds inline rows sent with ``keep_spans``, and answers a batch
with one item per prompt and a ``"stream": true`` request as server-sent events. With
``gateway_refusal`` a JSON-typed gateway stands in front and refuses any other body with that
status (a plain-text body, as axum's); with ``refusal`` every span request gets that error body
(400). Every post is recorded as (content type, request; None for one the gateway refused).
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from blake3 import blake3

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.info import TEXT, ServedModel, ServerInfo

BINARY_TYPE = "application/x-sgl-embeds"
JSON_TYPE = "application/json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KEY_CONTEXT = "sgl_embeds blake3-rows/v3"
# axum's refusals of a body its Json extractor cannot take, as smg answers them
GATEWAY_REFUSALS = {
    415: "Expected request with `Content-Type: application/json`",
    400: "Failed to parse the request body as JSON: expected value at line 1 column 1",
    422: "Failed to deserialize the JSON body into the target type: missing field `text`",
}
BAD_ROWS = {"object": "error", "type": "BadRequestError", "param": None, "code": 400,
            "message": "segment 1: embeddings contain NaN or Inf (first in row 0)"}


def read_tensor(obj) -> torch.Tensor:
    """A wire tensor as docs/concepts.md defines it: base64 of raw little-endian bytes with dtype
    and shape, or float lists."""
    if isinstance(obj, dict):
        raw = bytearray(base64.b64decode(obj["data"]))
        return torch.frombuffer(raw, dtype=DTYPES[obj["dtype"]]).reshape(obj["shape"])
    return torch.tensor(obj, dtype=torch.float32)


def read_binary_body(raw: bytes) -> dict:
    """The binary body: u64 little-endian head length, the JSON head, the buffer; each object with
    ``data_offsets`` is a range of the buffer."""
    n = int.from_bytes(raw[:8], "little")
    head, buffer = json.loads(raw[8:8 + n]), raw[8 + n:]

    def tensors(node):
        if isinstance(node, dict) and "data_offsets" in node:
            begin, end = node["data_offsets"]
            return torch.frombuffer(bytearray(buffer[begin:end]), dtype=DTYPES[node["dtype"]]).reshape(node["shape"])
        if isinstance(node, dict):
            return {k: tensors(v) for k, v in node.items()}
        return [tensors(v) for v in node] if isinstance(node, list) else node

    return tensors(head)


def content_key(rows: torch.Tensor) -> str:
    """docs/concepts.md's content key (the API's handle), from the ``blake3`` package alone."""
    row_key = blake3(f"row {rows.dtype}".encode(), derive_key_context=KEY_CONTEXT).digest()
    digests = b"".join(blake3(row.contiguous().view(torch.uint8).numpy().tobytes(), key=row_key).digest()
                       for row in rows)
    span_key = blake3(b"span", derive_key_context=KEY_CONTEXT).digest()
    return "span-" + blake3(f"{rows.dtype}{list(rows.shape)}".encode() + digests, key=span_key).hexdigest()


def is_batch(request: dict) -> bool:
    """A request of several prompts: ``input_segments`` a list of segment lists, or
    ``input_embeds`` a list of spans (wire objects, tensors, or float-list spans)."""
    if "input_embeds" in request:
        x = request["input_embeds"]
        return isinstance(x, list) and bool(x) and (isinstance(x[0], (dict, torch.Tensor))
                                                    or isinstance(x[0], list) and bool(x[0]) and isinstance(x[0][0], list))
    x = request.get("input_segments") or []
    return bool(x) and isinstance(x[0], list)


def prompts_of(request: dict) -> list[list]:
    """The prompts of a /generate request, each its list of segments (``input_embeds``: one span)."""
    if "input_embeds" in request:
        x = request["input_embeds"]
        return [[{"type": "embeds", "embeds": e}] for e in (x if is_batch(request) else [x])]
    x = request.get("input_segments") or []
    return x if is_batch(request) else [x]


def spans_of(request: dict) -> list:
    """The spans of a /generate request as sent: a tensor (binary body), a wire tensor, or a
    ``{"handle": ...}``."""
    return [s["embeds"] for p in prompts_of(request) for s in p if s.get("type") == "embeds"]


def kinds(posts: list) -> list[str]:
    """Each post as (body form, how its first span went)."""
    out = []
    for content_type, request in posts:
        form = "binary" if content_type == BINARY_TYPE else "json"
        if request is None:
            out.append(f"{form}: refused")
            continue
        span = spans_of(request)[0]
        how = "handle" if isinstance(span, dict) and "handle" in span else "inline"
        out.append(f"{form}: {how}" + (" + keep" if request.get("keep_spans") else ""))
    return out


def text_llm_info(hidden: int) -> dict:
    """What the plugin says of a float32 text LLM of this hidden size (``info.ServerInfo``)."""
    model = ServedModel(family=None, served_as=TEXT, vision_dir=None, grid=False, merge_size=None,
                        vision_tokens={})
    return ServerInfo(hidden_size=hidden, dtype="float32", vocab_size=1000, context_len=4096,
                      max_span_bytes=wire.MAX_SPAN_BYTES, wire_dtypes=sorted(wire.DTYPES),
                      binary_body=BINARY_TYPE, key_scheme="blake3-rows/v3", sglang_version="0.5.23",
                      sgl_embeds_version="0.1.0", span_store={}, rows_to_scheduler=None,
                      http_worker_pid=0, vision=None, span_width=hidden, model=model).to_json()


class FakePluginServer:
    def __init__(self, hidden: int, gateway_refusal: int | None = None, refusal: dict | None = None) -> None:
        self.hidden, self.gateway_refusal, self.refusal = hidden, gateway_refusal, refusal
        self.held: set[str] = set()
        self.posts: list[tuple[str, dict | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.answer(200, {"model_path": "fake", "sgl_embeds": text_llm_info(fake.hidden)})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                status, payload, stream = fake.generate(self.headers.get("Content-Type", ""), raw)
                self.answer(status, payload, stream)

            def answer(self, status: int, payload, stream: bool = False) -> None:
                plain = isinstance(payload, str)
                if stream:
                    data = f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()
                else:
                    data = (payload if plain else json.dumps(payload)).encode()
                self.send_response(status)
                kind = "text/event-stream" if stream else "text/plain" if plain else JSON_TYPE
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def generate(self, content_type: str, raw: bytes) -> tuple[int, dict | str, bool]:
        content_type = content_type.split(";")[0].strip().lower()
        if self.gateway_refusal and content_type != JSON_TYPE:
            self.posts.append((content_type, None))
            return self.gateway_refusal, GATEWAY_REFUSALS[self.gateway_refusal], False
        request = read_binary_body(raw) if content_type == BINARY_TYPE else json.loads(raw)
        self.posts.append((content_type, request))
        spans = spans_of(request)
        if spans and self.refusal is not None:
            return 400, self.refusal, False
        for span in spans:
            if isinstance(span, dict) and "handle" in span:
                if span["handle"] not in self.held:
                    return 400, {"object": "error", "type": "UnknownSpanHandle", "param": span["handle"],
                                 "message": "unknown handle"}, False
            elif request.get("keep_spans"):
                rows = span if isinstance(span, torch.Tensor) else read_tensor(span)
                self.held.add(content_key(rows))
        one = {"text": "ok", "output_ids": [1],
               "meta_info": {"prompt_tokens": 3, "input_token_logprobs": [[-1.0, 5, "a"]] * 3,
                             "output_token_logprobs": [], "cached_tokens": 0}}
        n = len(prompts_of(request))
        return 200, [one] * n if is_batch(request) else one, bool(request.get("stream"))

    def __enter__(self) -> "FakePluginServer":
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
