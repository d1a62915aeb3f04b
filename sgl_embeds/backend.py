"""The runtime backend: ``EmbedsEndpoint``, a ``RuntimeEndpoint`` that sends span prompts.

SGLang's ``RuntimeEndpoint`` funnels every ``/generate`` body (gen, streaming, select, fork's
prefix commit) through ``_add_images(s, data)``; that one method is where program text with span
markers becomes ``input_segments``, written by the endpoint's ``writer.SpanWriter``. ``run(...)``
sends a prompt without a program.

A server that does not hold a handle a body names answers ``UnknownSpanHandle``; the request is
then sent once more with the rows inline (``_resent_inline``, the one place this happens). The
stock calls post their bodies with their module's function ``http_request`` and read the response
in their own frame, so that function is where their posts are seen: ``post_stock_body`` is its
AROUND hook, and a body ``_add_images`` wrote (``WRITTEN``) goes through ``_resent_inline`` there.

``run`` and the stock calls (streaming excepted) send a request with spans as a binary body
(``binary_body.py``: inline rows as raw bytes after a JSON head) where the server advertises one
(``/get_model_info``'s ``binary_body``). A gateway forwards that advertisement but may read
``/generate`` bodies as JSON itself (smg does): its refusal of a binary body
(``_refuses_binary``) sends the request once more as JSON, and the endpoint sends JSON from then
on (``sends_binary``).
"""

from __future__ import annotations

import http.client
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import HttpResponse, http_request

from sgl_embeds import lang
from sgl_embeds.vision import EncoderCache
from sgl_embeds.writer import KeptSpans, SpanWriter
from sgl_embeds_srt import binary_body, keys
from sgl_embeds_srt import segments as seg
from sgl_embeds_srt import wire

# The server sends a null input-logprob entry for a span row (a row has no token, so no logprob
# and no text). Stock select() reads every entry of the last prompt positions: it averages their
# logprobs and compares the first entry's text with each choice (token healing). A span row
# enters as logprob 0 with a text no choice starts with: the same for every choice, so it cannot
# change which choice wins.
SPAN_ROW_LOGPROB_ENTRY = (0.0, -1, "\x00")
# What a gateway that reads /generate bodies as JSON answers a binary body: smg's axum Json
# extractor gives 415 for another content type, 400 or 422 for bytes it cannot parse as the request
BINARY_REFUSALS = (400, 415, 422)


@dataclass
class WrittenBody:
    """A stock call's body as ``_add_images`` wrote it, until the call posts it: how to write
    its span fields again (``prompts`` of ``batch``), by the endpoint that wrote them."""

    body: dict
    endpoint: "EmbedsEndpoint"
    prompts: list
    batch: bool
    binary: bool  # its spans are tensors: it goes as a binary body

    def spans(self) -> list:
        return [s.tensor for p in self.prompts for s in p.segments if isinstance(s, seg.Embeds)]

    def rewritten(self, raw_rows: bool) -> dict:
        """The body with its span fields written again (after the writer forgot the spans:
        inline), the rows tensors with ``raw_rows`` (a binary body)."""
        return {**self.body, **self.endpoint.writer.fields("input_segments", self.prompts, self.batch,
                                                           check_values=False, raw_rows=raw_rows)}


# id(body) -> its WrittenBody; the record holds the body, so an id is not reused while it is here
WRITTEN: dict[int, WrittenBody] = {}


def post_stock_body(original: Callable, url: str, json: Any = None, **kwargs: Any) -> Any:
    """AROUND hook of ``runtime_endpoint.http_request``, which every stock ``RuntimeEndpoint``
    call posts with: a body an ``EmbedsEndpoint`` wrote goes through its ``_resent_inline``, as
    a binary body where ``_add_images`` left its rows tensors."""
    written = WRITTEN.pop(id(json), None) if json is not None else None
    if written is None or written.body is not json:
        return original(url, json=json, **kwargs)
    attempts = []

    def post() -> tuple[Any, bool]:  # the body as written, then (a second attempt) written again
        binary = written.binary and written.endpoint.sends_binary  # False once one was refused
        if attempts:
            body = written.rewritten(binary)
        elif written.binary and not binary:  # another call's binary body was refused meanwhile
            body = binary_body.json_form(json)
        else:
            body = json
        attempts.append(body)
        if binary:
            return written.endpoint._post(body, True), True
        return original(url, json=body, **kwargs), False

    return written.endpoint._resent_inline(written.spans(), post)


class EmbedsEndpoint(RuntimeEndpoint):
    """Backend for programs with ``sgl.embeds`` / ``sgl.region`` against a server running the
    sgl_embeds plugin, or a gateway in front of several. ``wire_format`` is ``"base64"`` (raw
    bytes, default) or ``"json"``; ``wire_dtype`` picks float32/float16/bfloat16 for base64
    (default: the tensor's own); with base64, ``run`` sends span rows in a binary body where the
    server takes one, unless ``send_binary`` is False. ``span_handles``: name a span sent before
    by its handle (see ``writer.py``). ``vision_encoder`` encodes ``sgl.image`` / ``sgl.region``
    client-side; its outputs are kept in ``encoder_cache`` (an ``EncoderCache`` of
    ``encoder_cache_bytes``; 0 turns it off)."""

    def __init__(
        self,
        base_url: str,
        *,
        vision_encoder: Callable | None = None,
        wire_format: str = "base64",
        wire_dtype: str | None = None,
        api_key: str | None = None,
        verify: str | None = None,
        chat_template_name: str | None = None,
        encoder_cache_bytes: int = 256 << 20,
        span_handles: bool = True,
        send_binary: bool = True,
    ):
        if wire_format not in ("base64", "json"):
            raise ValueError(f"wire_format must be 'base64' or 'json', got {wire_format!r}")
        super().__init__(base_url, api_key=api_key, verify=verify,
                         chat_template_name=chat_template_name)
        self.vision_encoder = vision_encoder
        self.encoder_cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes > 0 else None
        # The plugin adds its info to /get_model_info, which a gateway forwards too.
        info = self.model_info.get("sgl_embeds")
        if info is None:
            raise RuntimeError(f"{base_url} does not run the sgl_embeds plugin "
                               "(no 'sgl_embeds' in /get_model_info)")
        self.server_info = info
        self.hidden_size: int = info["hidden_size"]
        kept = KeptSpans() if span_handles else None
        self.writer = SpanWriter(self.hidden_size, wire_format, wire_dtype, kept)
        # run()'s span requests go as binary bodies; False once something in between refused one
        self.sends_binary: bool = (send_binary and wire_format == "base64"
                                   and info.get("binary_body") == binary_body.CONTENT_TYPE)

    # -- the choke point --------------------------------------------------------------------
    def _add_images(self, s: Any, data: dict) -> None:
        texts = data.get("text")
        batch = isinstance(texts, list)
        items = texts if batch else [texts]
        if any(isinstance(t, str) and seg.has_markers(t) for t in items):
            prompts = [lang.program_prompt(s, t) for t in items]
            binary = self.sends_binary and not data.get("stream")  # a stream goes as JSON
            # sgl.embeds and the vision encoders checked these spans' values where they entered
            data.update(self.writer.fields("input_segments", prompts, batch, check_values=False,
                                           raw_rows=binary))
            WRITTEN[id(data)] = WrittenBody(data, self, prompts, batch, binary)  # post_stock_body posts it
        elif s.images_ and self.vision_encoder is None:
            super()._add_images(s, data)

    def _generate_http_request(self, s: Any, data: dict) -> Any:
        """Stock ``select``'s requests; their input logprobs at span rows made readable for it."""
        out = super()._generate_http_request(s, data)
        for item in out if isinstance(out, list) else [out]:
            entries = item.get("meta_info", {}).get("input_token_logprobs") or []
            for j, e in enumerate(entries):
                if e is not None and e[1] is None:
                    entries[j] = list(SPAN_ROW_LOGPROB_ENTRY)
        return out

    def _resent_inline(self, spans: Iterable[Any], post: Callable[[], tuple[Any, bool]]) -> Any:
        """``post()``'s response (``post`` returns it and whether its body was binary). If the
        server does not hold a handle the body names, or something in between refused its binary
        form (this endpoint sends JSON from then on), the writer forgets ``spans`` (the body's)
        and ``post()`` writes and sends the body once more, with their rows inline."""
        res, binary = post()
        if res.status_code == 200:
            return res
        error = _error(res)  # both response kinds keep their body for the caller's own read
        if binary and _refuses_binary(res.status_code, error):
            self.sends_binary = False
        elif not _is_unknown_handle(error):
            return res
        self.writer.forget(spans)
        return post()[0]

    # -- direct use ---------------------------------------------------------------------------
    def run(
        self,
        text: str | list[str] | None = None,
        input_embeds: Any = None,
        input_segments: Any = None,
        sampling_params: dict | list[dict] | None = None,
        **fields: Any,
    ) -> Any:
        """One ``/generate`` call without a program; returns the server's JSON (text + meta_info),
        a list for a batch. ``input_embeds``: one ``[n, hidden]`` tensor-like (the whole prompt) or
        a list of them (a batch). ``input_segments``: a list of segments (``Prompt``, segment
        objects or wire dicts), or a list of such lists (a batch)."""
        given = [k for k, v in (("text", text), ("input_embeds", input_embeds),
                                ("input_segments", input_segments)) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, input_embeds, input_segments "
                             f"(got {given or 'none'})")
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, **fields}
        field, prompts, batch = "text", [], False
        if input_embeds is not None:
            field, batch = "input_embeds", wire.is_tensor_batch(input_embeds)
            prompts = [[seg.Embeds(x)] for x in (input_embeds if batch else [input_embeds])]
        elif input_segments is not None:
            field, (prompts, batch) = "input_segments", _segment_lists(input_segments)
        spans = [s.tensor for p in prompts for s in (p.segments if isinstance(p, seg.Prompt) else p)
                 if isinstance(s, seg.Embeds)]

        def post() -> tuple[Any, bool]:  # the body is written again for a second attempt
            if field == "text":
                return self._post({**body, "text": text}, False), False
            binary = self.sends_binary  # read per attempt: a refused binary body goes again as JSON
            written = self.writer.fields(field, prompts, batch, raw_rows=binary)
            return self._post({**body, **written}, binary), binary

        res = self._resent_inline(spans, post)
        if res.status_code != 200:
            error = _error(res)
            if _is_unknown_handle(error):
                raise RuntimeError(error)  # as the stock calls raise a refusal
            raise ValueError(f"/generate refused the request ({res.status_code}): {error.get('message', error)}")
        return res.json()

    def _post(self, body: dict, binary: bool) -> Any:
        """``body`` posted to ``/generate``, as JSON as the stock calls post theirs or as a binary
        body (its rows tensors): the response."""
        url = self.base_url + "/generate"
        if not binary:
            return http_request(url, json=body, api_key=self.api_key, verify=self.verify)
        parts = binary_body.encode_parts(body)
        headers = {"Content-Type": binary_body.CONTENT_TYPE}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return _post_bytes(url, parts, headers, self.verify)


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


def _segment_lists(x: Any) -> tuple[list, bool]:
    """(prompts, is_batch) of ``run``'s ``input_segments``."""
    if isinstance(x, seg.Prompt):
        return [x], False
    if isinstance(x, list) and x and isinstance(x[0], (list, seg.Prompt)):
        return list(x), True
    return [list(x)], False


def _is_unknown_handle(error: Any) -> bool:
    return isinstance(error, dict) and error.get("type") == keys.UNKNOWN_HANDLE_TYPE


def _refuses_binary(status: int, error: dict) -> bool:
    """Whether the refusal of a binary body came from something in between, not from a server:
    a 415 (the content type refused), or a ``BINARY_REFUSALS`` status without a server's error
    body (``{"object": "error", ...}``: SGLang's, and the plugin's for bad rows or a malformed
    frame, which JSON would not mend)."""
    return status == 415 or (status in BINARY_REFUSALS and error.get("object") != "error")


def _error(res: Any) -> dict:
    """The server's error body (``{"message": ..., "type": ...}``)."""
    try:
        body = res.json()
    except ValueError:
        return {"message": res.text}
    return body if isinstance(body, dict) else {"message": str(body)}
