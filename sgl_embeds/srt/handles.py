"""Upload a span once, refer to it by handle: ``POST /sgl_embeds/spans``.

``{"embeds": <tensor>}`` is validated (as a span of the served model) and kept in a store bounded
in bytes (``SGL_EMBEDS_HANDLE_BYTES``, LRU eviction); the answer is ``{"handle": "span-<hash>",
...}``. Any place that takes a tensor then also takes ``{"handle": "span-..."}``. Handles are
content hashes (SHA-256 of dtype, shape and bytes): uploading the same rows twice gives the same
handle, and a handle cannot be guessed without the rows. ``DELETE /sgl_embeds/spans/<handle>``
drops one. The store lives in the HTTP process, shared by every client of the server (see
docs/reliability.md for the tenancy model); the ``Engine`` API takes tensors directly instead.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from sgl_embeds import wire

PATH = "/sgl_embeds/spans"


def budget_bytes() -> int:
    return int(os.environ.get("SGL_EMBEDS_HANDLE_BYTES", 1 << 30))


class SpanStore:
    """Uploaded spans by handle, least recently used evicted first, at most ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, t: torch.Tensor) -> str:
        t = t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > self.budget:
            raise ValueError(f"a span of {nbytes} bytes exceeds the handle store's budget of {self.budget} bytes")
        digest = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if nbytes else b"")
        handle = "span-" + digest.hexdigest()
        with self._lock:
            if handle in self._items:
                self._items.move_to_end(handle)
                return handle
            self._items[handle] = t.clone()
            self._bytes += nbytes
            while self._bytes > self.budget:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return handle

    def get(self, handle: Any) -> torch.Tensor:
        with self._lock:
            if not isinstance(handle, str) or handle not in self._items:
                raise wire.WireError(f"unknown span handle {str(handle)[:80]!r}: never uploaded, deleted, or evicted")
            self._items.move_to_end(handle)
            return self._items[handle]

    def delete(self, handle: str) -> bool:
        with self._lock:
            t = self._items.pop(handle, None)
            if t is not None:
                self._bytes -= t.numel() * t.element_size()
            return t is not None

    def stats(self) -> dict:
        with self._lock:
            return {"count": len(self._items), "bytes": self._bytes, "budget": self.budget}


def upload(body: dict, store: SpanStore, hidden_size: int) -> dict:
    if set(body) != {"embeds"}:
        raise ValueError('upload a span as {"embeds": <tensor>}')
    t = wire.decode_tensor(body["embeds"], store.budget)  # checks shape and values
    wire.check_shape(t, hidden_size)
    handle = store.put(t)
    return {"handle": handle, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "bytes": t.numel() * t.element_size()}
