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

# select() reads the text of each input-logprob entry; a span row's entry is null on the wire.
_NULL_ENTRY_STANDIN = [0.0, -1, "\x00"]


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
        if any(isinstance(t, str) and lang.has_markers(t) for t in batch):
            table = lang.span_table(s)
            wired = [self.encode_prompt(lang.compile_segments(t, table)) for t in batch]
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
                    entries[j] = list(_NULL_ENTRY_STANDIN)
        return out

    # -- encoding -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: seg.Prompt | list) -> list[dict]:
        """Wire segments of a prompt, with every span checked against the server's hidden size."""
        segments = prompt.segments if isinstance(prompt, seg.Prompt) else prompt
        out = []
        for i, s in enumerate(segments):
            if isinstance(s, dict):
                s = seg.segments_from_wire([s])[0]
            if isinstance(s, seg.Embeds):
                self.check_span(s.tensor, f"segment {i}: ")
            out.append(seg.segment_to_wire(s, self.wire_format, self.wire_dtype))
        return out

    def check_span(self, x: Any, where: str = "") -> Any:
        t = wire.as_2d_tensor(x)
        try:
            wire.check_tensor(t, self.hidden_size)
        except wire.WireError as e:
            raise ValueError(f"{where}{e}") from None
        return t

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
        if _is_tensor_batch(x):
            return [wire.encode_tensor(self.check_span(t, f"prompt {i}: "), self.wire_format, self.wire_dtype) for i, t in enumerate(x)]
        return wire.encode_tensor(self.check_span(x), self.wire_format, self.wire_dtype)

    def _encode_segment_lists(self, x: Any) -> Any:
        if isinstance(x, seg.Prompt):
            return self.encode_prompt(x)
        if isinstance(x, list) and x and isinstance(x[0], (list, seg.Prompt)):
            return [self.encode_prompt(p) for p in x]
        return self.encode_prompt(list(x))


def _is_tensor_batch(x: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim == 3
    return isinstance(x, list) and bool(x) and (
        isinstance(x[0], (torch.Tensor, np.ndarray)) or (isinstance(x[0], list) and bool(x[0]) and isinstance(x[0][0], list))
    )


def _message(res: Any) -> str:
    try:
        return res.json().get("message", res.text)
    except ValueError:
        return res.text
