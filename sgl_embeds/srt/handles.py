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
from typing import Any

import torch

from sgl_embeds import wire
from sgl_embeds.lru import TensorLRU, nbytes

PATH = "/sgl_embeds/spans"


def budget_bytes() -> int:
    return int(os.environ.get("SGL_EMBEDS_HANDLE_BYTES", 1 << 30))


class SpanStore:
    """Uploaded spans by handle, least recently used evicted first, at most ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._lru = TensorLRU(budget)

    def put(self, t: torch.Tensor) -> str:
        t = t.detach().contiguous()
        size = nbytes(t)
        if size > self.budget:
            raise ValueError(f"a span of {size} bytes exceeds the handle store's budget of {self.budget} bytes")
        digest = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if size else b"")
        handle = "span-" + digest.hexdigest()
        if self._lru.get(handle) is None:  # same rows, same handle: the stored copy is refreshed
            self._lru.put(handle, t.clone())
        return handle

    def get(self, handle: Any) -> torch.Tensor:
        t = self._lru.get(handle) if isinstance(handle, str) else None
        if t is None:
            raise wire.WireError(f"unknown span handle {str(handle)[:80]!r}: never uploaded, deleted, or evicted")
        return t

    def delete(self, handle: str) -> bool:
        return self._lru.pop(handle) is not None

    def stats(self) -> dict:
        count, size = self._lru.sizes()
        return {"count": count, "bytes": size, "budget": self.budget}


def upload(body: dict, store: SpanStore, hidden_size: int) -> dict:
    if set(body) != {"embeds"}:
        raise ValueError('upload a span as {"embeds": <tensor>}')
    t = wire.decode_tensor(body["embeds"], store.budget)  # checks shape and values
    wire.check_shape(t, hidden_size)
    handle = store.put(t)
    return {"handle": handle, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "bytes": t.numel() * t.element_size()}
