"""Tokenizer-manager side: input logprob entries at span rows come back as ``null``.

The "token" at a span row is a placeholder id, not a vocabulary entry: it has no logprob and no
text (the scheduler clamps it to a valid id only so the logprob gather cannot go out of range).
Entry ``j`` of ``input_token_logprobs`` belongs to prompt position ``logprob_start_len + j``; an
entry whose position holds a placeholder id becomes ``[None, None, None]``.
"""

from __future__ import annotations

from typing import Any, Callable

from sgl_embeds_srt.placeholders import is_placeholder


def add_logprob_to_meta_info(original: Callable, self: Any, meta_info: dict, state: Any,
                             *args: Any, **kwargs: Any) -> Any:
    result = original(self, meta_info, state, *args, **kwargs)
    ids = state.obj.input_ids  # state.obj: the request's GenerateReqInput
    entries = meta_info.get("input_token_logprobs")
    if not entries or not ids or state.obj.positional_embed_overrides is None:
        return result
    start = state.obj.logprob_start_len if (state.obj.logprob_start_len or 0) > 0 else 0
    for j in range(len(entries)):
        pos = start + j
        if pos < len(ids) and is_placeholder(ids[pos]):
            entries[j] = (None, None, None)
    return result
