"""Placeholder ids: how a span row stands in the engine's token-id sequence.

Every span row gets a 62-bit content hash of its bytes as the model sees them (after conversion
to the model's dtype), offset to lie in ``[2**62, 2**63)``. Real token ids are far below that, so
the radix cache tells rows apart, matches identical rows, and never confuses a row with a token.
"""

from __future__ import annotations

import hashlib

import torch

PLACEHOLDER_BASE = 1 << 62


def is_placeholder(token_id: int) -> bool:
    return token_id >= PLACEHOLDER_BASE


def row_hash(row_bytes: bytes) -> int:
    """A 62-bit content hash of one row, as a placeholder id in [2**62, 2**63)."""
    digest = hashlib.blake2b(row_bytes, digest_size=8, person=b"sgl_embeds").digest()
    return PLACEHOLDER_BASE | (int.from_bytes(digest, "little") & (PLACEHOLDER_BASE - 1))


def placeholder_ids(rows: torch.Tensor) -> list[int]:
    """Placeholder ids of a span's rows; ``rows`` must already be in the model's dtype."""
    flat = rows.detach().to("cpu").contiguous()
    raw = flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    return [row_hash(r.tobytes()) for r in raw]
