"""Tokenizer-manager side: input logprob entries at span rows come back as ``null``.

The "token" at a span row is a placeholder id (or, on an M-RoPE VLM, the image token), not the
row's content: it has no logprob and no text (the scheduler clamps ids only so the logprob gather
cannot go out of range). Entry ``j`` of ``input_token_logprobs`` belongs to prompt position
``logprob_start_len + j``; an entry at a span row's position becomes ``[None, None, None]``.
"""

from __future__ import annotations

from typing import Any, Callable

from sgl_embeds_srt.prompt_rows import PromptRows


def add_logprob_to_meta_info(original: Callable, self: Any, meta_info: dict, state: Any,
                             *args: Any, **kwargs: Any) -> Any:
    result = original(self, meta_info, state, *args, **kwargs)
    prompt_rows = state.obj.positional_embed_overrides  # state.obj: the request's GenerateReqInput
    entries = meta_info.get("input_token_logprobs")
    if not entries or not isinstance(prompt_rows, PromptRows):
        return result
    start = state.obj.logprob_start_len if (state.obj.logprob_start_len or 0) > 0 else 0
    for pos in prompt_rows.positions:
        if 0 <= pos - start < len(entries):
            entries[pos - start] = (None, None, None)
    return result
