"""Token ids from clients are checked before SGLang sees them, and once more in the scheduler.

An id outside the vocabulary kills stock SGLang's scheduler (docs/reliability.md, "Requests that
kill stock SGLang"). ``check_ids`` / ``check_id_lists`` (every route and the ``Engine``) refuse
one with a ``ValueError`` (HTTP 400) naming the field, the index and the value;
``first_bad_position`` is the scheduler's last guard (``scheduler.req_init`` aborts that request).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from sgl_embeds_srt.placeholders import is_placeholder


def check_ids(ids: Any, vocab_size: int, where: str) -> None:
    """``ValueError`` unless ``ids`` is a list of ints in ``[0, vocab_size)``."""
    if not isinstance(ids, list):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{where}[{j}] is {t!r}: token ids are integers")
        if not 0 <= t < vocab_size:
            hint = (" (a span placeholder id: send the span's rows instead, e.g. in input_segments)"
                    if is_placeholder(t) and t < 1 << 63 else "")
            raise ValueError(f"{where}[{j}] = {t} is outside the vocabulary [0, {vocab_size}){hint}")


def check_id_lists(value: Any, vocab_size: int, where: str) -> None:
    """One list of ids, or a batch (a list of lists)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        for i, ids in enumerate(value):
            check_ids(ids, vocab_size, f"{where}[{i}]")
    else:
        check_ids(value, vocab_size, where)


def stock_ids(path: str, body: dict) -> tuple[str, Any] | None:
    """(field, value) of the token ids in a body that SGLang's own route will serve, if any."""
    if path in ("/generate", "/v1/chat/completions") and body.get("input_ids") is not None:
        return "input_ids", body["input_ids"]
    prompt = body.get("prompt") if path == "/v1/completions" else None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        return "prompt", prompt
    return None


def first_bad_position(ids: Iterable[int], vocab_size: int,
                       span_positions: Iterable[int] = ()) -> int | None:
    """The first position whose id the embedding table cannot look up: negative, or at least
    ``vocab_size`` and not one of the span rows' positions. None when every id is fine."""
    try:
        values = np.asarray(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):  # not all int64: find the first culprit by hand
        ok = set(span_positions)
        for pos, t in enumerate(ids):
            if pos not in ok and not (isinstance(t, int) and 0 <= t < vocab_size):
                return pos
        return None
    bad = (values < 0) | (values >= vocab_size)
    positions = np.fromiter(span_positions, dtype=np.int64)
    if positions.size:
        bad[positions] = False
    found = np.flatnonzero(bad)
    return int(found[0]) if found.size else None
