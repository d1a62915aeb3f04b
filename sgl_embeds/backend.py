"""The runtime backend: ``EmbedsEndpoint``, a ``RuntimeEndpoint`` that sends span prompts.

SGLang's ``RuntimeEndpoint`` funnels every ``/generate`` body (gen, streaming, select, fork's
prefix commit) through ``_add_images(s, data)``; that one method is where program text with span
markers becomes ``input_segments``. ``run(...)`` sends a prompt without a program.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import http_request

from sgl_embeds import lang
from sgl_embeds import segments as seg
from sgl_embeds import wire
from sgl_embeds.vision import EncoderCache

# The server sends a null input-logprob entry for a span row (a row has no token, so no logprob
# and no text). Stock select() reads every entry of the last prompt positions: it averages their
# logprobs and compares the first entry's text with each choice (token healing). A span row
# enters as logprob 0 with a text no choice starts with: the same for every choice, so it cannot
# change which choice wins.
SPAN_ROW_LOGPROB_ENTRY = (0.0, -1, "\x00")


class EmbedsEndpoint(RuntimeEndpoint):
    """Backend for programs with ``sgl.embeds`` / ``sgl.region`` against a server running the
    sgl_embeds plugin. ``wire_format`` is ``"base64"`` (raw bytes, default) or ``"json"``;
    ``wire_dtype`` picks float32/float16/bfloat16 for base64 (default: the tensor's own).
    ``vision_encoder`` encodes ``sgl.image`` / ``sgl.region`` client-side; its outputs are kept in
    ``encoder_cache`` (an ``EncoderCache`` of ``encoder_cache_bytes``; 0 turns it off)."""

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
    ):
        if wire_format not in ("base64", "json"):
            raise ValueError(f"wire_format must be 'base64' or 'json', got {wire_format!r}")
        super().__init__(base_url, api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        self.vision_encoder = vision_encoder
        self.encoder_cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes > 0 else None
        self.wire_format, self.wire_dtype = wire_format, wire_dtype
        res = http_request(self.base_url + "/sgl_embeds/info", api_key=self.api_key, verify=self.verify)
        if res.status_code != 200:
            raise RuntimeError(f"{base_url} does not run the sgl_embeds plugin (GET /sgl_embeds/info: {res.status_code})")
        self.server_info = res.json()
        self.hidden_size: int = self.server_info["hidden_size"]

    # -- the choke point --------------------------------------------------------------------
    def _add_images(self, s: Any, data: dict) -> None:
        texts = data.get("text")
        batch = texts if isinstance(texts, list) else [texts]
        if any(isinstance(t, str) and seg.has_markers(t) for t in batch):
            table = lang.span_table(s)
            wired = [self.encode_prompt(seg.split_at_markers(t, table), checked=True) for t in batch]
            data.pop("text")
            data["input_segments"] = wired if isinstance(texts, list) else wired[0]
        elif s.images_ and self.vision_encoder is None:
            super()._add_images(s, data)

    def _generate_http_request(self, s: Any, data: dict) -> Any:
        out = super()._generate_http_request(s, data)
        for item in out if isinstance(out, list) else [out]:
            entries = item.get("meta_info", {}).get("input_token_logprobs") or []
            for j, e in enumerate(entries):
                if e is not None and e[1] is None:
                    entries[j] = list(SPAN_ROW_LOGPROB_ENTRY)
        return out

    # -- encoding -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: seg.Prompt | list, checked: bool = False) -> list[dict]:
        """Wire segments of a prompt for this server (see the module function ``encode_prompt``)."""
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
        body: dict[str, Any] = {"sampling_params": sampling_params or {}, **fields}
        if text is not None:
            body["text"] = text
        elif input_embeds is not None:
            body["input_embeds"] = self._encode_embeds(input_embeds)
        else:
            body["input_segments"] = self._encode_segment_lists(input_segments)
        res = http_request(self.base_url + "/generate", json=body, api_key=self.api_key, verify=self.verify)
        if res.status_code != 200:
            raise ValueError(f"/generate refused the request ({res.status_code}): {_message(res)}")
        return res.json()

    def _encode_embeds(self, x: Any) -> Any:
        if wire.is_tensor_batch(x):
            return [encode_span(t, self.hidden_size, self.wire_format, self.wire_dtype, where=f"prompt {i}: ")
                    for i, t in enumerate(x)]
        return encode_span(x, self.hidden_size, self.wire_format, self.wire_dtype)

    def _encode_segment_lists(self, x: Any) -> Any:
        if isinstance(x, seg.Prompt):
            return self.encode_prompt(x)
        if isinstance(x, list) and x and isinstance(x[0], (list, seg.Prompt)):
            return [self.encode_prompt(p) for p in x]
        return self.encode_prompt(list(x))


def encode_prompt(prompt: seg.Prompt | list, hidden_size: int, wire_format: str = "base64",
                  wire_dtype: str | None = None, checked: bool = False) -> list[dict]:
    """Wire segments of a prompt. Each span is checked here, once: fully (shape, values, the
    server's ``hidden_size``), or only its width when a program already checked it (``checked``:
    ``sgl.embeds`` and the vision encoders validate what they make). Wire dicts pass as they are;
    the server checks them."""
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
    t = x if checked else wire.as_2d_tensor(x)
    try:
        if checked:
            wire.check_shape(t, hidden_size)
        else:
            wire.check_tensor(t, hidden_size)
    except wire.WireError as e:
        raise ValueError(f"{where}{e}") from None
    return wire.encode_tensor(t, wire_format, wire_dtype)


def _message(res: Any) -> str:
    try:
        return res.json().get("message", res.text)
    except ValueError:
        return res.text
