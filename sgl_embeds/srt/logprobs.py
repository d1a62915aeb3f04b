"""Tokenizer-manager side: logprob entries of span rows come back as ``null``.

The "token" at a span row is a placeholder id, not a vocabulary entry: it has no logprob and no
text. Any (logprob, id, text) entry whose id is a placeholder becomes (None, None, None) before
SGLang would try to detokenize it.
"""

from __future__ import annotations

from typing import Any, Callable

from sgl_embeds.segments import PLACEHOLDER_BASE


def detokenize_logprob_tokens(original: Callable, self: Any, vals: list, idxs: list, decode_to_text: bool) -> list:
    if not any(i is not None and i >= PLACEHOLDER_BASE for i in idxs):
        return original(self, vals, idxs, decode_to_text)
    keep = [k for k, i in enumerate(idxs) if i is None or i < PLACEHOLDER_BASE]
    decoded = iter(original(self, [vals[k] for k in keep], [idxs[k] for k in keep], decode_to_text))
    kept = set(keep)
    return [next(decoded) if k in kept else (None, None, None) for k in range(len(idxs))]
