"""Model-runner hooks: grid spans' image items are embedded as they are, item by item, so the
vision tower never runs on them (a batch that mixes them with raw images is served correctly); a
config shim that SGLang's Qwen2-VL tower needs; and span rows reach a Gemma's first layer as sent.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sgl_embeds_srt.image_spans import is_span_item


def get_embedding_and_mask(original: Callable, data_embedding_func: Callable, embedding_items: list,
                           *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``mm_schedule.get_embedding_and_mask``: when our items are among those to
    embed, embed item by item (ours: their rows as they are; the others through the model's own
    function, in one call), so the tower never sees our rows."""
    if any(map(is_span_item, embedding_items)):
        data_embedding_func = _per_item(data_embedding_func)
    return original(data_embedding_func, embedding_items, *args, **kwargs)


def _per_item(embed: Callable) -> Callable:
    def embed_items(items: list) -> list[torch.Tensor]:
        raw = [item for item in items if not is_span_item(item)]
        raw_rows = iter(_split_per_item(embed(raw), raw) if raw else [])
        return [item.feature if is_span_item(item) else next(raw_rows) for item in items]

    return embed_items  # a plain function: SGLang then moves every item's feature to the device


def _split_per_item(embedding: Any, items: list) -> list[torch.Tensor]:
    """The model's embedding of ``items``: one tensor per item (it may return them joined)."""
    if isinstance(embedding, list):
        return embedding
    sizes = [sum(end - start + 1 for start, end in item.offsets) for item in items]
    return list(torch.split(embedding.reshape(-1, embedding.shape[-1]), sizes))


def qwen2_vision_init(original: Callable, self: Any, vision_config: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of SGLang's ``Qwen2VisionTransformer.__init__``: a Qwen2-VL config written by
    transformers 5 names the patch embedding's channels ``in_channels``, where SGLang 0.5.23
    reads ``in_chans`` (earlier configs have both names' value under ``in_chans``)."""
    if not hasattr(vision_config, "in_chans"):
        vision_config.in_chans = vision_config.in_channels
    return original(self, vision_config, *args, **kwargs)


# SGLang's models that multiply every input embedding by sqrt(hidden), span rows included, where
# HF scales the looked-up text embeddings only (a span's rows are the layers' input, as HF's
# ``inputs_embeds``): their first layer gets the span rows back as sent
SCALED_INPUT_MODELS = ("GemmaForCausalLM", "Gemma2ForCausalLM")


def load_model(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.load_model``: on a ``SCALED_INPUT_MODELS`` model, span rows
    go to the first decoder layer unscaled (``_rows_as_sent``)."""
    result = original(self, *args, **kwargs)
    if type(self.model).__name__ in SCALED_INPUT_MODELS:
        self.model.model.layers[0].register_forward_pre_hook(_rows_as_sent)
    return result


def _rows_as_sent(layer: Any, args: tuple) -> None:
    """Forward pre-hook of a first decoder layer ``(positions, hidden_states, forward_batch,
    residual)``: the override rows written over their scaled copies, in place."""
    hidden_states, forward_batch = args[1], args[2]
    if forward_batch.replace_positions is not None and forward_batch.replace_embeds is not None:
        hidden_states[forward_batch.replace_positions] = forward_batch.replace_embeds.to(hidden_states.dtype)
