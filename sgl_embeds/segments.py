"""The prompt model: interleaved text / token-id / embedding segments, and placeholder ids.

A prompt is a list of segments. On the wire each segment is a JSON object:

* ``{"type": "text", "text": "..."}``: tokenized by the server like a plain prompt;
* ``{"type": "input_ids", "input_ids": [1, 2, ...]}``: token ids, used as they are;
* ``{"type": "embeds", "embeds": <tensor>}``: an ``[n, hidden]`` span (see ``wire.py``).

Inside the engine every span row stands in the token-id sequence as a *placeholder id*: a
62-bit content hash of the row's bytes as the model sees them (after conversion to the model's
dtype), offset to lie in ``[2**62, 2**63)``. Real token ids are far below that, so the radix cache
tells rows apart, matches identical rows, and never confuses a row with a token.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from sgl_embeds import wire

PLACEHOLDER_BASE = 1 << 62
PLACEHOLDER_LIMIT = 1 << 63
# Where a span stands inside text (programs, rendered chats): Unicode private-use characters
# around a key into a table of tensors.
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")


@dataclass
class Text:
    text: str


@dataclass
class Ids:
    ids: list[int]


@dataclass
class Embeds:
    tensor: torch.Tensor  # [n, hidden]

    def __len__(self) -> int:
        return self.tensor.shape[0]


Segment = Union[Text, Ids, Embeds]


@dataclass
class Prompt:
    """An ordered list of segments; adjacent text is merged as it is appended."""

    segments: list[Segment] = field(default_factory=list)

    def append(self, seg: Segment) -> None:
        if isinstance(seg, Text):
            if not seg.text:
                return
            if self.segments and isinstance(self.segments[-1], Text):
                self.segments[-1] = Text(self.segments[-1].text + seg.text)
                return
        self.segments.append(seg)

    @property
    def has_embeds(self) -> bool:
        return any(isinstance(s, Embeds) for s in self.segments)

    def to_wire(self, fmt: str = "base64", dtype: str | None = None) -> list[dict]:
        return [segment_to_wire(s, fmt, dtype) for s in self.segments]


def marker(key: int) -> str:
    return f"{MARK_OPEN}{key}{MARK_CLOSE}"


def split_at_markers(text: str, table: dict[int, torch.Tensor]) -> Prompt:
    """Text with span markers -> a prompt of text and span segments (empty text dropped)."""
    prompt = Prompt()
    pos = 0
    for m in _MARKER.finditer(text):
        prompt.append(Text(text[pos : m.start()]))
        key = int(m.group(1))
        if key not in table:
            raise ValueError(f"span marker {key} has no tensor")
        prompt.append(Embeds(table[key]))
        pos = m.end()
    prompt.append(Text(text[pos:]))
    return prompt


def strip_markers(text: str) -> str:
    return _MARKER.sub("", text)


def segment_to_wire(seg: Segment, fmt: str = "base64", dtype: str | None = None) -> dict:
    if isinstance(seg, Text):
        return {"type": "text", "text": seg.text}
    if isinstance(seg, Ids):
        return {"type": "input_ids", "input_ids": list(seg.ids)}
    return {"type": "embeds", "embeds": wire.encode_tensor(seg.tensor, fmt, dtype)}


Resolver = Callable[[Any], torch.Tensor]


def decode_span(obj: Any, max_bytes: int, resolve: Resolver | None = None) -> torch.Tensor:
    """A wire tensor, or ``{"handle": ...}`` looked up with ``resolve`` (HTTP only)."""
    if isinstance(obj, dict) and "handle" in obj:
        if resolve is None:
            raise wire.WireError("span handles are accepted only by the HTTP server")
        if len(obj) != 1:
            raise wire.WireError('a span handle is {"handle": "span-..."} with no other keys')
        return resolve(obj["handle"])
    return wire.decode_tensor(obj, max_bytes)


def segments_from_wire(items: Any, max_bytes: int = wire.DEFAULT_MAX_BYTES, resolve: Resolver | None = None) -> list[Segment]:
    """Parse and validate a wire segment list (tensors decoded, shapes not yet model-checked)."""
    if not isinstance(items, list) or not items:
        raise wire.WireError("input_segments must be a non-empty list of segment objects")
    out: list[Segment] = []
    budget = max_bytes
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise wire.WireError(f"segment {i} must be an object, got {type(item).__name__}")
        kind = item.get("type")
        if kind == "text":
            if not isinstance(item.get("text"), str):
                raise wire.WireError(f"segment {i}: 'text' must be a string")
            out.append(Text(item["text"]))
        elif kind == "input_ids":
            ids = item.get("input_ids")
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise wire.WireError(f"segment {i}: 'input_ids' must be a list of non-negative ints")
            out.append(Ids(ids))
        elif kind == "embeds":
            if "embeds" not in item:
                raise wire.WireError(f"segment {i}: an embeds segment needs an 'embeds' field")
            try:
                t = decode_span(item["embeds"], budget, resolve)
            except wire.WireError as e:
                raise wire.WireError(f"segment {i}: {e}") from None
            budget -= t.numel() * 4
            out.append(Embeds(t))
        else:
            raise wire.WireError(f"segment {i}: unknown type {kind!r} (use text, input_ids or embeds)")
    return out


def row_hash(row_bytes: bytes) -> int:
    """A 62-bit content hash of one row, as a placeholder id in [2**62, 2**63)."""
    digest = hashlib.blake2b(row_bytes, digest_size=8, person=b"sgl_embeds").digest()
    return PLACEHOLDER_BASE | (int.from_bytes(digest, "little") & (PLACEHOLDER_BASE - 1))


def placeholder_ids(rows: torch.Tensor) -> list[int]:
    """Placeholder ids of a span's rows; ``rows`` must already be in the model's dtype."""
    flat = rows.detach().to("cpu").contiguous()
    raw = flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    return [row_hash(r.tobytes()) for r in raw]


def is_placeholder(token_id: int) -> bool:
    return token_id >= PLACEHOLDER_BASE
