"""The runtime backend: ``EmbedsEndpoint``, a ``RuntimeEndpoint`` that sends span prompts.

SGLang's ``RuntimeEndpoint`` funnels every ``/generate`` body (gen, streaming, select, fork's
prefix commit) through ``_add_images(s, data)``; that one method is where program text with span
markers becomes ``input_segments``. ``run(...)`` sends a prompt without a program.

A span goes inline the first time (with ``keep_spans``: the server keeps it by handle) and by
handle after that (``SentSpans``); a server that does not hold the handle (evicted, or another
worker behind a gateway) answers ``UnknownSpanHandle`` and the request is sent again once with
the rows inline. Every span request also carries a routing hint (``keys.routing_text``) as its
``text``, so a gateway's cache-aware policy sends a repeated span to the worker that holds it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch
import xxhash
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import http_request

from sgl_embeds import lang
from sgl_embeds_srt import keys
from sgl_embeds_srt import segments as seg
from sgl_embeds_srt import wire
from sgl_embeds.vision import EncoderCache

# The server sends a null input-logprob entry for a span row (a row has no token, so no logprob
# and no text). Stock select() reads every entry of the last prompt positions: it averages their
# logprobs and compares the first entry's text with each choice (token healing). A span row
# enters as logprob 0 with a text no choice starts with: the same for every choice, so it cannot
# change which choice wins.
SPAN_ROW_LOGPROB_ENTRY = (0.0, -1, "\x00")


class SentSpans:
    """Spans this client has sent to one server (or gateway) with ``keep_spans``, by content:
    each one's handle and routing characters. A lookup hashes the rows with xxh3 (about 0.5 ms
    for 4096 rows of 576 floats); the handle (SHA-256) is computed once, on the first send."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(sent: torch.Tensor) -> tuple:
        return str(sent.dtype), tuple(sent.shape), xxhash.xxh3_128_hexdigest(keys.raw_bytes(sent))

    def get(self, key: tuple) -> tuple[str, str] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: tuple, handle: str, route: str) -> None:
        with self._lock:
            self._entries[key] = (handle, route)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


class EmbedsEndpoint(RuntimeEndpoint):
    """Backend for programs with ``sgl.embeds`` / ``sgl.region`` against a server running the
    sgl_embeds plugin, or a gateway in front of several. ``wire_format`` is ``"base64"`` (raw
    bytes, default) or ``"json"``; ``wire_dtype`` picks float32/float16/bfloat16 for base64
    (default: the tensor's own). ``span_handles``: name a span sent before by its handle (see the
    module doc). ``vision_encoder`` encodes ``sgl.image`` / ``sgl.region`` client-side; its
    outputs are kept in ``encoder_cache`` (an ``EncoderCache`` of ``encoder_cache_bytes``; 0
    turns it off)."""

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
    ):
        if wire_format not in ("base64", "json"):
            raise ValueError(f"wire_format must be 'base64' or 'json', got {wire_format!r}")
        super().__init__(base_url, api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        self.vision_encoder = vision_encoder
        self.encoder_cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes > 0 else None
        self.wire_format, self.wire_dtype = wire_format, wire_dtype
        self.sent = SentSpans() if span_handles else None
        self._inline_only = threading.local()  # set while a request is resent with its rows inline
        # The plugin adds its info to /get_model_info, which a gateway forwards too.
        info = self.model_info.get("sgl_embeds")
        if info is None:
            raise RuntimeError(f"{base_url} does not run the sgl_embeds plugin (no 'sgl_embeds' in /get_model_info)")
        self.server_info = info
        self.hidden_size: int = info["hidden_size"]

    # -- the choke point --------------------------------------------------------------------
    def _add_images(self, s: Any, data: dict) -> None:
        texts = data.get("text")
        batch = texts if isinstance(texts, list) else [texts]
        if any(isinstance(t, str) and seg.has_markers(t) for t in batch):
            table = lang.span_table(s)
            prompts = [seg.split_at_markers(t, table).segments for t in batch]
            data.update(self.span_fields("input_segments", prompts, isinstance(texts, list), checked=True))
        elif s.images_ and self.vision_encoder is None:
            super()._add_images(s, data)

    def _generate_http_request(self, s: Any, data: dict) -> Any:
        # a fresh copy per attempt: _add_images rewrites the body it is given
        out = self._resending_inline(lambda: super(EmbedsEndpoint, self)._generate_http_request(s, dict(data)))
        for item in out if isinstance(out, list) else [out]:
            entries = item.get("meta_info", {}).get("input_token_logprobs") or []
            for j, e in enumerate(entries):
                if e is not None and e[1] is None:
                    entries[j] = list(SPAN_ROW_LOGPROB_ENTRY)
        return out

    # Every stock call that posts to /generate: resent inline once if a handle is unknown.
    def generate(self, s: Any, sampling_params: Any) -> Any:
        return self._resending_inline(super().generate, s, sampling_params)

    def commit_lazy_operations(self, s: Any) -> None:
        self._resending_inline(super().commit_lazy_operations, s)

    def fill_image(self, s: Any) -> None:
        self._resending_inline(super().fill_image, s)

    def generate_stream(self, s: Any, sampling_params: Any) -> Iterator:
        stream = self._resending_inline(lambda: _started(super(EmbedsEndpoint, self).generate_stream(s, sampling_params)))
        yield from stream

    def _resending_inline(self, call: Callable, *args: Any) -> Any:
        """``call(*args)``; if the server does not hold a handle it names, again with rows inline."""
        try:
            return call(*args)
        except RuntimeError as e:
            if not _is_unknown_handle(e.args[0] if e.args else None):
                raise
        self._inline_only.on = True
        try:
            return call(*args)
        finally:
            self._inline_only.on = False

    # -- encoding -----------------------------------------------------------------------------
    def span_fields(self, field: str, prompts: list, batch: bool, checked: bool = False) -> dict:
        """The body fields of span prompts: ``field`` (``input_segments``, or ``input_embeds`` for
        prompts that are one span each), the routing hint ``text``, and ``keep_spans`` when a
        span goes inline. Spans are checked as the module function ``encode_prompt`` says."""
        wired, routes, inline = [], [], False
        for i, prompt in enumerate(prompts):
            segments = prompt.segments if isinstance(prompt, seg.Prompt) else prompt
            out, route = [], []
            for j, s in enumerate(segments):
                if isinstance(s, seg.Embeds):
                    where = f"prompt {i}: " if field == "input_embeds" else f"segment {j}: "
                    obj, rows_route, sent_inline = self._encode_span(s.tensor, checked, where)
                    inline |= sent_inline
                    out.append({"type": "embeds", "embeds": obj})
                    route.append(rows_route)
                else:
                    out.extend(encode_prompt([s], self.hidden_size))
                    route.append(s)
            wired.append(out if field == "input_segments" else out[0]["embeds"])
            routes.append(keys.routing_text(route))
        body: dict[str, Any] = {field: wired if batch else wired[0], "text": routes[0]}
        if inline and self.sent is not None:
            body["keep_spans"] = True
        return body

    def _encode_span(self, x: Any, checked: bool, where: str) -> tuple[Any, str, bool]:
        """(wire object, routing characters, sent inline?) of one span."""
        t = _checked(x, self.hidden_size, checked, where)
        sent = wire.as_wire_tensor(t, self.wire_format, self.wire_dtype)
        if self.sent is None:
            return wire.encode_tensor(sent, self.wire_format, self.wire_dtype), keys.route_rows(sent), True
        key = SentSpans.key(sent)
        known = self.sent.get(key)
        if known is not None and not getattr(self._inline_only, "on", False):
            return {"handle": known[0]}, known[1], False
        route = known[1] if known is not None else keys.route_rows(sent)
        self.sent.put(key, keys.span_handle(sent), route)
        return wire.encode_tensor(sent, self.wire_format, self.wire_dtype), route, True

    def encode_prompt(self, prompt: seg.Prompt | list, checked: bool = False) -> list[dict]:
        """Wire segments of a prompt for this server, every span inline (see the module function)."""
        return encode_prompt(prompt, self.hidden_size, self.wire_format, self.wire_dtype, checked)

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
        given = [k for k, v in (("text", text), ("input_embeds", input_embeds), ("input_segments", input_segments)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, input_embeds, input_segments (got {given or 'none'})")

        def post() -> Any:
            body: dict[str, Any] = {"sampling_params": sampling_params or {}, **fields}
            if text is not None:
                body["text"] = text
            elif input_embeds is not None:
                batch = wire.is_tensor_batch(input_embeds)
                prompts = [[seg.Embeds(x)] for x in (input_embeds if batch else [input_embeds])]
                body.update(self.span_fields("input_embeds", prompts, batch))
            else:
                prompts, batch = _segment_lists(input_segments)
                body.update(self.span_fields("input_segments", prompts, batch))
            res = http_request(self.base_url + "/generate", json=body, api_key=self.api_key, verify=self.verify)
            if res.status_code != 200:
                error = _error(res)
                if _is_unknown_handle(error):
                    raise RuntimeError(error)
                raise ValueError(f"/generate refused the request ({res.status_code}): {error.get('message', error)}")
            return res.json()

        return self._resending_inline(post)


def _segment_lists(x: Any) -> tuple[list, bool]:
    """(prompts, is_batch) of ``run``'s ``input_segments``."""
    if isinstance(x, seg.Prompt):
        return [x], False
    if isinstance(x, list) and x and isinstance(x[0], (list, seg.Prompt)):
        return list(x), True
    return [list(x)], False


def _started(stream: Iterator) -> Iterator:
    """A generator run to its first item, so an error of its request is raised here."""
    first = next(stream, _END)
    if first is _END:
        return iter(())

    def rest() -> Iterator:
        yield first
        yield from stream

    return rest()


_END = object()


def _is_unknown_handle(error: Any) -> bool:
    return isinstance(error, dict) and error.get("type") == keys.UNKNOWN_HANDLE_TYPE


def _checked(x: Any, hidden_size: int, checked: bool, where: str) -> torch.Tensor:
    """A span as a tensor, checked fully, or only its width when ``checked`` (see ``encode_prompt``)."""
    t = x if checked else wire.as_2d_tensor(x)
    try:
        if checked:
            wire.check_shape(t, hidden_size)
        else:
            wire.check_tensor(t, hidden_size)
    except wire.WireError as e:
        raise ValueError(f"{where}{e}") from None
    return t


def encode_prompt(prompt: seg.Prompt | list, hidden_size: int, wire_format: str = "base64",
                  wire_dtype: str | None = None, checked: bool = False) -> list[dict]:
    """Wire segments of a prompt, every span inline. Each span is checked here, once: fully
    (shape, values, the server's ``hidden_size``), or only its width when a program already
    checked it (``checked``: ``sgl.embeds`` and the vision encoders validate what they make).
    Wire dicts pass as they are; the server checks them."""
    segments = prompt.segments if isinstance(prompt, seg.Prompt) else prompt
    out = []
    for i, s in enumerate(segments):
        if isinstance(s, dict):
            out.append(s)
        elif isinstance(s, seg.Text):
            out.append({"type": "text", "text": s.text})
        elif isinstance(s, seg.Ids):
            out.append({"type": "input_ids", "input_ids": list(s.ids)})
        elif isinstance(s, seg.Embeds):
            embeds = encode_span(s.tensor, hidden_size, wire_format, wire_dtype, checked, f"segment {i}: ")
            out.append({"type": "embeds", "embeds": embeds})
        else:
            raise ValueError(f"segment {i}: expected Text, Ids, Embeds or a wire dict, got {type(s).__name__}")
    return out


def encode_span(x: Any, hidden_size: int, wire_format: str = "base64", wire_dtype: str | None = None,
                checked: bool = False, where: str = "") -> Any:
    """One span on the wire, checked as ``encode_prompt`` says."""
    return wire.encode_tensor(_checked(x, hidden_size, checked, where), wire_format, wire_dtype)


def _error(res: Any) -> dict:
    """The server's error body (``{"message": ..., "type": ...}``)."""
    try:
        body = res.json()
    except ValueError:
        return {"message": res.text}
    return body if isinstance(body, dict) else {"message": str(body)}
