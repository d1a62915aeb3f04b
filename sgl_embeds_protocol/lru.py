"""``LRU``: a least-recently-used map bounded by a budget, the one cache type of both sides.

The budget is in the units of ``weigh(value)``: bytes for tensors (``nbytes``), 1 per entry by
default. Its users: the server's span store (``handles.SpanStore``) and the placeholder ids of
kept spans (``placeholders``), which spans the scheduler holds per HTTP process
(``transport.RowsTransport``), the client's vision-encoder outputs (``vision.EncoderCache``) and
the spans a client has sent a server (``sgl_embeds.writer.HeldSpans``). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

import torch

V = TypeVar("V")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rows_to_hold(t: torch.Tensor, slack: float = 0.0) -> torch.Tensor:
    """``t`` to keep in a cache: itself where it is contiguous and its buffer holds at most
    ``slack`` (a fraction of its bytes) more than it, else a copy of its own, so that a kept
    tensor never holds on to the rest of a larger buffer (other rows of one message or body)."""
    own = t.is_contiguous() and t.untyped_storage().nbytes() <= nbytes(t) * (1 + slack)
    return t if own else t.clone()


class LRU(Generic[V]):
    """Keys to values, least recently used evicted first once the values weigh more than ``budget``.

    ``keep_oversized``: a value heavier than the whole budget is still kept (alone) rather than
    refused; ``on_evict(key, value)`` is called for each entry the budget pushes out (under the
    lock: keep it short)."""

    def __init__(self, budget: int, weigh: Callable[[V], int] = lambda value: 1, *,
                 keep_oversized: bool = False, on_evict: Callable[[Hashable, V], None] | None = None) -> None:
        self.budget = budget
        self._weigh = weigh
        self._keep_oversized = keep_oversized
        self._on_evict = on_evict
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> bool:
        """Keep ``value`` under ``key`` (replacing any value there), as the most recently used;
        False when it is heavier than the whole budget and not ``keep_oversized``."""
        weight = self._weigh(value)
        with self._lock:
            if weight > self.budget and not self._keep_oversized:
                return False
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= self._weigh(old)
            self._items[key] = value
            self._weight += weight
            while self._weight > self.budget and len(self._items) > 1:
                old_key, old_value = self._items.popitem(last=False)
                self._weight -= self._weigh(old_value)
                if self._on_evict is not None:
                    self._on_evict(old_key, old_value)
            return True

    def pop(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._weight -= self._weigh(value)
            return value

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weight = 0

    def sizes(self) -> tuple[int, int]:
        """(entries, total weight)."""
        with self._lock:
            return len(self._items), self._weight
