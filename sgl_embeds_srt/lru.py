"""A least-recently-used map of tensors bounded in bytes, shared by both sides of the wire.

The server keeps uploaded spans by handle in one (``srt/handles.SpanStore``), the client keeps
vision-encoder outputs in another (``vision.EncoderCache``). Thread-safe; a tensor larger than
the whole budget is not kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable

import torch


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TensorLRU:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor under ``key`` (now the most recently used), or None."""
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
            return t

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        """Keep ``t`` under ``key`` (a key already present is only refreshed), evicting the least
        recently used entries beyond the budget."""
        size = nbytes(t)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            if size > self.budget:
                return
            self._items[key] = t
            self._bytes += size
            while self._bytes > self.budget:
                _, old = self._items.popitem(last=False)
                self._bytes -= nbytes(old)

    def pop(self, key: Hashable) -> torch.Tensor | None:
        with self._lock:
            t = self._items.pop(key, None)
            if t is not None:
                self._bytes -= nbytes(t)
            return t

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def sizes(self) -> tuple[int, int]:
        """(entries, bytes)."""
        with self._lock:
            return len(self._items), self._bytes
