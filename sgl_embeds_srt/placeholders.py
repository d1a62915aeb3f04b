"""Placeholder ids: how a span row stands in the engine's token-id sequence.

Every span row gets a 62-bit content hash of its bytes as the model sees them (after conversion
to the model's dtype), offset to lie in ``[2**62, 2**63)``. Real token ids are far below that, so
the radix cache tells rows apart, matches identical rows, and never confuses a row with a token.
The ids of a span the server keeps by handle are computed once and remembered.
"""

from __future__ import annotations

import hashlib

import torch

from sgl_embeds_srt.lru import LRU, nbytes

PLACEHOLDER_BASE = 1 << 62


def is_placeholder(token_id: int) -> bool:
    return token_id >= PLACEHOLDER_BASE


def row_hash(row_bytes: bytes) -> int:
    """A 62-bit content hash of one row, as a placeholder id in [2**62, 2**63)."""
    digest = hashlib.blake2b(row_bytes, digest_size=8, person=b"sgl_embeds").digest()
    return PLACEHOLDER_BASE | (int.from_bytes(digest, "little") & (PLACEHOLDER_BASE - 1))


def placeholder_ids(rows: torch.Tensor, handle: str | None = None) -> list[int]:
    """Placeholder ids of a span's rows; ``rows`` must already be in the model's dtype.
    ``handle``: the span's handle when the server keeps it (the ids are then remembered)."""
    if handle is not None:
        kept = _KEPT.get(handle)
        if kept is not None and kept.shape[0] == rows.shape[0]:
            return kept.tolist()
    flat = rows.detach().to("cpu").contiguous()
    raw = flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    ids = [row_hash(r.tobytes()) for r in raw]
    if handle is not None:
        _KEPT.put(handle, torch.tensor(ids, dtype=torch.int64))
    return ids


# A server has one model dtype, so a handle's rows always become the same ids.
_KEPT: LRU[torch.Tensor] = LRU(64 << 20, nbytes)  # int64 ids: 8M rows
