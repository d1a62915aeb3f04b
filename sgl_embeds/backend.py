"""The runtime backend: ``EmbedsEndpoint``, a ``RuntimeEndpoint`` that sends span prompts.

Every stock ``/generate`` body (gen, streaming, select, fork's prefix commit) passes through
``_add_images``, where program text with span markers becomes span fields written by the
endpoint's ``writer.SpanWriter``; ``run(...)`` sends a prompt without a program. Both leave
through the endpoint's ``sender.SpanSender`` (docs/architecture.md, steps 3-4).
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_embeds import lang
from sgl_embeds.sender import SpanRequest, SpanSegments, SpanSender, error_body, is_unknown_handle
from sgl_embeds.vision import EncoderCache
from sgl_embeds.writer import HeldSpans, SpanWriter
from sgl_embeds_protocol import binary_body
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol import wire
from sgl_embeds_protocol.info import ServerInfo

# The server sends a null input-logprob entry for a span row (a row has no token, so no logprob
# and no text). Stock select() reads every entry of the last prompt positions: it averages their
# logprobs and compares the first entry's text with each choice (token healing). A span row
# enters as logprob 0 with a text no choice starts with: the same for every choice, so it cannot
# change which choice wins.
SPAN_ROW_LOGPROB_ENTRY = (0.0, -1, "\x00")


class EmbedsEndpoint(RuntimeEndpoint):
    """Backend for programs with ``sgl.embeds`` / ``sgl.region`` against a server running the
    sgl_embeds plugin, or a gateway in front of several. ``wire_format`` is ``"base64"`` (raw
    bytes, default) or ``"json"``; ``wire_dtype`` picks float32/float16/bfloat16 for base64
    (default: the rows' own, or the served model's where it is narrower: the server casts them
    so anyway, so a bfloat16 server gets half float32's bytes and the same answer); with base64,
    ``run`` sends span rows in a binary body where the server takes one, unless ``send_binary``
    is False. ``span_handles``: name a span sent before
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
        self.server_info = ServerInfo.from_json(info)
        self.hidden_size: int = self.server_info.hidden_size
        # a span's row width: the hidden size, with a Qwen3-VL's deepstack rows after it
        self.span_width: int = self.server_info.span_width
        writer = SpanWriter(self.span_width, wire_format, wire_dtype, HeldSpans() if span_handles else None,
                            served_dtype=self.server_info.dtype)
        takes_binary = (send_binary and wire_format == "base64"
                        and self.server_info.binary_body == binary_body.CONTENT_TYPE)
        # the stock calls' address (RuntimeEndpoint.base_url) is the sender's too
        self.sender = SpanSender(lambda: self.base_url, writer, takes_binary, api_key=api_key, verify=verify)

    @property
    def writer(self) -> SpanWriter:
        return self.sender.writer

    @property
    def sends_binary(self) -> bool:
        """Span requests go as binary bodies: False once something in between refused one."""
        return self.sender.sends_binary

    @sends_binary.setter
    def sends_binary(self, value: bool) -> None:
        self.sender.sends_binary = value

    # -- the choke point --------------------------------------------------------------------
    def _add_images(self, s: Any, data: dict) -> None:
        texts = data.get("text")
        batch = isinstance(texts, list)
        items = texts if batch else [texts]
        if any(isinstance(t, str) and seg.has_markers(t) for t in items):
            prompts = [lang.program_prompt(s, t) for t in items]
            binary = self.sends_binary and not data.get("stream")  # a stream goes as JSON
            # sgl.embeds and the vision encoders checked these spans' values where they entered
            request = SpanRequest(self.sender, data, "input_segments", prompts, batch, binary,
                                  check_values=False)
            data.update(request.span_fields(raw_rows=binary))
            data["input_segments"] = SpanSegments(data["input_segments"], request)
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
            prompts = [[seg.Span(x)] for x in (input_embeds if batch else [input_embeds])]
        elif input_segments is not None:
            field, (prompts, batch) = "input_segments", _segment_lists(input_segments)
        if field == "text":
            res = self.sender.post({**body, "text": text}, binary=False)
        else:
            res = self.sender.send(SpanRequest(self.sender, body, field, prompts, batch, binary=True))
        if res.status_code != 200:
            error = error_body(res)
            if is_unknown_handle(error):
                raise RuntimeError(error)  # as the stock calls raise a refusal
            raise ValueError(f"/generate refused the request ({res.status_code}): {error.get('message', error)}")
        return res.json()


def _segment_lists(x: Any) -> tuple[list, bool]:
    """(prompts, is_batch) of ``run``'s ``input_segments``."""
    if isinstance(x, seg.Prompt):
        return [x], False
    if isinstance(x, list) and x and isinstance(x[0], (list, seg.Prompt)):
        return list(x), True
    return [list(x)], False
