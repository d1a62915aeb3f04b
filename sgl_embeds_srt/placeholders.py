"""Placeholder ids: how a span row stands in the engine's token-id sequence.

``placeholder_ids`` gives each row ``PLACEHOLDER_BASE`` (``2**62``) plus 62 bits of its row digest
(``keys.row_digests``), of the row as sent where its cast to the model's dtype is exact, else as
cast: equal ids mean the model sees equal rows, and none is a real token id (``is_placeholder``).
A span's ids are held under its content key (``held_ids``). docs/concepts.md, "Placeholder ids".
"""

from __future__ import annotations

import numpy as np
import torch
from blake3 import blake3

from sgl_embeds_protocol.keys import ROW_DIGEST_BYTES, row_digests
from sgl_embeds_protocol.lru import LRU, nbytes

PLACEHOLDER_BASE = 1 << 62


def is_placeholder(token_id: int) -> bool:
    return token_id >= PLACEHOLDER_BASE


def held_ids(content_key: str, n_rows: int) -> list[int] | None:
    """The placeholder ids held for the span of content key ``content_key`` (None if none are)."""
    held = _HELD_IDS.get(content_key)
    return held.tolist() if held is not None and held.shape[0] == n_rows else None


def placeholder_ids(rows: torch.Tensor, content_key: str | None = None,
                    digests: bytes | None = None) -> list[int]:
    """Placeholder ids of a span's rows: in the model's dtype, or in a dtype whose cast to it is
    exact (``prompts.EXACT_CASTS``).
    ``content_key``: the span's (``keys.content_key`` of its rows as sent): the ids are then held
    under it.
    ``digests``: ``keys.row_digests(rows)`` when the caller has them."""
    if content_key is not None:
        held = held_ids(content_key, rows.shape[0])
        if held is not None:
            return held
    first_words = np.frombuffer(row_digests(rows) if digests is None else digests, dtype="<u8")
    ids = first_words[:: ROW_DIGEST_BYTES // 8] & np.uint64(PLACEHOLDER_BASE - 1)
    ids |= np.uint64(PLACEHOLDER_BASE)
    if content_key is not None:
        _HELD_IDS.put(content_key, torch.from_numpy(ids.astype(np.int64)))
    return ids.tolist()


def bidirectional_ids(ids: list[int], content_key: str) -> list[int]:
    """The placeholder ids of a bidirectional span (one block): its first row's id names the whole
    span (its content key), so a prefix cache hit that reaches into the block comes from the same
    block, whose cached rows saw the same rows after them (docs/engine.md, "Bidirectional
    blocks"); the others are its rows' ids."""
    word = int.from_bytes(blake3(f"{content_key} bidirectional".encode()).digest(8), "little")
    return [PLACEHOLDER_BASE | (word & (PLACEHOLDER_BASE - 1))] + ids[1:]


# A server has one model dtype, so a content key's rows always become the same ids.
_HELD_IDS: LRU[torch.Tensor] = LRU(64 << 20, nbytes)  # int64 ids: 8M rows
