"""The client's send path: a request with spans, written, posted, and written again once.

``SpanSender.send`` is the one place a request is resent: inline when the server does not hold a
handle it names (``UnknownSpanHandle``), as JSON when something in between refuses a binary body
(``sends_binary`` turns False). ``SpanRequest`` is such a request: ``EmbedsEndpoint.run`` sends
one, and a stock call's body carries its own in a ``SpanSegments`` to ``post_stock_body``, the
hook of its ``http_request`` (docs/architecture.md, step 3).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

from sglang.utils import HttpResponse, http_request

from sgl_embeds.writer import SpanWriter
from sgl_embeds_protocol import binary_body, keys
from sgl_embeds_protocol import segments as seg

# What a gateway that reads /generate bodies as JSON answers a binary body: smg's axum Json
# extractor gives 415 for another content type, 400 or 422 for bytes it cannot parse as the request
BINARY_REFUSALS = (400, 415, 422)


@dataclass(frozen=True)
class SpanRequest:
    """One ``/generate`` request with spans, enough to write its span fields again: ``fields``
    (the rest of the body), ``field`` (``input_segments`` or ``input_embeds``), ``prompts`` (each
    a ``Prompt`` or a list of segments) of a ``batch``; ``binary``: it may go as a binary body;
    ``check_values``: the writer checks the spans' values (False where they were checked when
    they entered the program)."""

    sender: SpanSender
    fields: dict
    field: str
    prompts: list
    batch: bool
    binary: bool
    check_values: bool = True

    def spans(self) -> list:
        return [s.rows for p in self.prompts for s in (p.segments if isinstance(p, seg.Prompt) else p)
                if isinstance(s, seg.Span)]

    def span_fields(self, raw_rows: bool) -> dict:
        """The body's span fields written now (rows tensors with ``raw_rows``: a binary body)."""
        return self.sender.writer.fields(self.field, self.prompts, self.batch, self.check_values, raw_rows)

    def written(self, raw_rows: bool) -> dict:
        """The whole body, its span fields written now."""
        return {**self.fields, **self.span_fields(raw_rows)}


class SpanSegments(list):
    """The ``input_segments`` of a body written for a stock call: a list (JSON writes it as one)
    that carries the request it belongs to, until the call posts the body."""

    def __init__(self, segments: list, request: SpanRequest) -> None:
        super().__init__(segments)
        self.request = request


class SpanSender:
    """Sends one endpoint's span requests to its server: ``base_url()`` gives the endpoint's
    address as it is now (a caller may point an endpoint at another worker)."""

    def __init__(self, base_url: Callable[[], str], writer: SpanWriter, sends_binary: bool,
                 api_key: str | None = None, verify: Any = None) -> None:
        self.base_url = base_url
        self.writer = writer
        self.sends_binary = sends_binary  # False once something in between refused a binary body
        self.api_key, self.verify = api_key, verify

    def send(self, request: SpanRequest, first_body: dict | None = None,
             post_json: Callable[[dict], Any] | None = None) -> Any:
        """``request``'s response. ``first_body``: the body as a stock call wrote it (its rows
        tensors if it was written binary), posted first; ``post_json``: how a JSON body is posted
        (a stock call's own ``http_request``; default ``post``). Resent once, rows inline, on an
        unknown handle or a binary body refused in between."""
        res, binary = self._attempt(request, first_body, post_json)
        if res.status_code == 200:
            return res
        error = error_body(res)  # both response kinds keep their body for the caller's own read
        if binary and _refuses_binary(res.status_code, error):
            self.sends_binary = False
        elif not is_unknown_handle(error):
            return res
        self.writer.forget(request.spans())
        return self._attempt(request, None, post_json)[0]

    def _attempt(self, request: SpanRequest, body: dict | None,
                 post_json: Callable[[dict], Any] | None) -> tuple[Any, bool]:
        """One post of ``request`` (``body`` as written, else written now): its response and
        whether it went binary."""
        binary = request.binary and self.sends_binary  # read per attempt: a refusal turns it off
        if body is None:
            body = request.written(raw_rows=binary)
        elif request.binary and not binary:  # its binary form was refused meanwhile
            body = binary_body.json_form(body)
        if self.api_key is not None and keys.is_routing_text(body.get("text")):
            # a gateway's cache-aware routing learns each key's prompts apart (tenants: the
            # server keeps their cache entries apart too, docs/reliability.md)
            body["text"] = keys.keyed_routing_text(body["text"], self.api_key)
        if binary or post_json is None:
            return self.post(body, binary), binary
        return post_json(body), False

    def post(self, body: dict, binary: bool) -> Any:
        """``body`` posted to ``/generate``, as JSON as the stock calls post theirs or as a binary
        body (its rows tensors): the response."""
        url = self.base_url() + "/generate"
        if not binary:
            return http_request(url, json=body, api_key=self.api_key, verify=self.verify)
        headers = {"Content-Type": binary_body.CONTENT_TYPE}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return _post_bytes(url, binary_body.encode_parts(body), headers, self.verify)


def post_stock_body(original: Callable, url: str, json: Any = None, **kwargs: Any) -> Any:
    """AROUND hook of ``runtime_endpoint.http_request``, which every stock ``RuntimeEndpoint``
    call posts with: a body whose spans an ``EmbedsEndpoint`` wrote goes through its request's
    sender (as a binary body where ``_add_images`` left its rows tensors)."""
    segments = json.get("input_segments") if isinstance(json, dict) else None
    if not isinstance(segments, SpanSegments):
        return original(url, json=json, **kwargs)
    request = segments.request
    # taken, once: a post of the same body from inside this one (a hook of http_request around
    # another) goes as it is
    json["input_segments"] = list(segments)
    return request.sender.send(request, first_body=json,
                               post_json=lambda body: original(url, json=body, **kwargs))


def _post_bytes(url: str, parts: list, headers: dict, verify: str | None) -> HttpResponse:
    """A body in ``parts`` (buffers, sent one after another: never joined) posted over
    ``http.client``, answered as ``sglang.utils.http_request`` answers JSON (its response type;
    an HTTP error is a response, as there). Something in between that refuses the body may
    answer before reading it all and close (smg does, for a content type it does not take): the
    rest of the body then meets a closed socket, and the answer already sent is read."""
    split = urllib.parse.urlsplit(url)
    if split.scheme == "https":
        context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else None
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(split.hostname, split.port,
                                                                       context=context)
    else:
        conn = http.client.HTTPConnection(split.hostname, split.port)
    conn.putrequest("POST", split.path + (f"?{split.query}" if split.query else ""))
    for name, value in {**headers, "Content-Length": str(sum(memoryview(p).nbytes for p in parts))}.items():
        conn.putheader(name, value)
    conn.endheaders()
    try:
        for part in parts:
            conn.send(part)
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered before the whole body was read: the answer follows
    return HttpResponse(conn.getresponse())


def is_unknown_handle(error: Any) -> bool:
    return isinstance(error, dict) and error.get("type") == keys.UNKNOWN_HANDLE_TYPE


def _refuses_binary(status: int, error: dict) -> bool:
    """Whether the refusal of a binary body came from something in between, not from a server:
    a 415 (the content type refused), or a ``BINARY_REFUSALS`` status without a server's error
    body (``{"object": "error", ...}``: SGLang's, and the plugin's for bad rows or a malformed
    frame, which JSON would not mend)."""
    return status == 415 or (status in BINARY_REFUSALS and error.get("object") != "error")


def error_body(res: Any) -> dict:
    """The server's error body (``{"message": ..., "type": ...}``)."""
    try:
        body = res.json()
    except ValueError:
        return {"message": res.text}
    return body if isinstance(body, dict) else {"message": str(body)}
