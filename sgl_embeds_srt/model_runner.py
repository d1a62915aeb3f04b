"""Model-runner hooks: grid spans' image items are embedded as they are, item by item, so the
vision tower never runs on them (a batch that mixes them with raw images is served correctly); a
config shim that SGLang's Qwen2-VL tower needs; what SGLang's Gemmas get wrong against HF
(``MODEL_FIXES``: span rows scaled, Gemma's activation); and a split Gemma 4's LLM half
(``Gemma4ForCausalLM``, E2B / E4B): its config loaded (``gemma4_text_config``), served on
``torch_native`` (``gemma4_backend_check``), its per-layer inputs at span rows looked up by the
pad id as HF's VLM does at image positions (``gemma4_per_layer_inputs``); our encoder-decoders
(Florence-2, ``florence2.py``) registered and declared to SGLang.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from sgl_embeds_srt.encoder_prompts import served_encoder_decoder
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


def get_model_architecture(original: Callable, model_config: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of SGLang's ``get_model_architecture`` (the loader's, and the tokenizer's
    question of which implementation runs): our encoder-decoder classes join SGLang's registry
    first (SGLang has no Florence-2)."""
    if served_encoder_decoder(model_config.hf_config.architectures):
        from sglang.srt.models.registry import ModelRegistry

        from sgl_embeds_srt.florence2 import EntryClass

        for model_class in EntryClass:
            ModelRegistry.models.setdefault(model_class.__name__, model_class)
    return original(model_config, *args, **kwargs)


def get_mm_processor_cls(original: Callable, hf_config: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of SGLang's ``get_mm_processor_cls``: our encoder-decoders' processor refuses
    raw images (``florence2.RawImagesRefused``); their encoder input comes as spans."""
    if served_encoder_decoder(hf_config.architectures):
        from sgl_embeds_srt.florence2 import RawImagesRefused

        return RawImagesRefused
    return original(hf_config, *args, **kwargs)


def is_encoder_decoder_model(original: Callable, architectures: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND hook of SGLang's ``is_encoder_decoder_model`` (a list inside the function): ours
    are encoder-decoders too, so SGLang lays out their encoder slots."""
    return original(architectures, *args, **kwargs) or served_encoder_decoder(architectures)


def load_model(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.load_model``: a model without ``get_input_embeddings``, which
    SGLang's scatter of override rows calls (Gemma, Gemma 2: their first span request crashed the
    scheduler), gets its ``model.embed_tokens``; then the model's ``MODEL_FIXES``."""
    result = original(self, *args, **kwargs)
    model = self.model
    embed_tokens = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not hasattr(model, "get_input_embeddings") and embed_tokens is not None:
        model.get_input_embeddings = lambda: embed_tokens
    for fix in MODEL_FIXES.get(type(model).__name__, ()):
        fix(model)
    return result


def rows_as_sent(model: Any) -> None:
    """SGLang's Gemma and Gemma 2 multiply every input row by sqrt(hidden), span rows included,
    where HF scales the looked-up text rows only (a span's rows are the layers' input, as HF's
    ``inputs_embeds``): the first layer gets the span rows back as sent."""
    model.model.layers[0].register_forward_pre_hook(_rows_as_sent)


def _rows_as_sent(layer: Any, args: tuple) -> None:
    """Forward pre-hook of a first decoder layer ``(positions, hidden_states, forward_batch,
    residual)``: the override rows written over their scaled copies, in place."""
    hidden_states, forward_batch = args[1], args[2]
    if forward_batch.replace_positions is not None and forward_batch.replace_embeds is not None:
        hidden_states[forward_batch.replace_positions] = forward_batch.replace_embeds.to(hidden_states.dtype)


# HF's Gemma MLP activation by the config's hidden_act, as SGLang's GeluAndMul names it
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


def gelu_as_configured(model: Any) -> None:
    """SGLang's Gemma runs exact GeLU whatever the config says; HF runs ``config.hidden_act``
    (PaliGemma's Gemma: ``gelu_pytorch_tanh``)."""
    approximate = GELU_APPROXIMATIONS.get(getattr(model.config, "hidden_act", None))
    if approximate is not None:
        for layer in model.model.layers:
            layer.mlp.act_fn.approximate = approximate


def router_scaled(model: Any) -> None:
    """SGLang's Gemma 4 router folds its learned scale and hidden**-0.5 into its norm's weight
    (``Gemma4Router.fuse_scale``) and runs a norm built ``with_scale=False``, which applies that
    weight on CUDA (``forward_cuda``'s rmsnorm) but not on a CPU without AMX
    (``Gemma4RMSNorm.forward_native``): the experts were routed on unscaled logits (the tiny
    26B-layout model's text answers equalled HF's only with that factor taken out of HF's router,
    measured). Each router's norm applies its weight."""
    for layer in model.model.layers:
        if getattr(layer, "router", None) is not None:
            layer.router.norm.with_scale = True


# What SGLang's model classes get wrong against HF, by class name
MODEL_FIXES: dict[str, tuple[Callable[[Any], None], ...]] = {
    "GemmaForCausalLM": (rows_as_sent, gelu_as_configured),
    "Gemma2ForCausalLM": (rows_as_sent,),
    "Gemma4ForCausalLM": (router_scaled,),
}


# -- a split Gemma 4's LLM half (``Gemma4ForCausalLM`` of a ``gemma4_text`` config) ------------
GEMMA4_TEXT = "gemma4_text"  # the model_type of a Gemma4ForCausalLM config (transformers')
GEMMA4_CAUSAL_LM = "Gemma4ForCausalLM"


def gemma4_text_config(original: Callable, config: Any) -> Any:
    """AROUND hook of ``get_hf_text_config`` in SGLang's config loader: a ``gemma4_text`` config
    whose sliding and full layers have different head widths (transformers 5 holds that as a
    per-layer config, whose global ``head_dim`` raises when read) is flattened as SGLang flattens
    a Gemma 4 VLM's text config (its ``_apply_gemma4_attention_overrides``: ``head_dim`` the full
    layers', ``swa_head_dim`` the sliding ones'), before the loader reads its attributes. SGLang
    0.5.23 does so only for ``gemma4`` (VLM) configs, so a ``gemma4_text`` one failed to load
    (``AmbiguousGlobalPerLayerAttributeError`` on ``head_dim``, measured)."""
    if getattr(config, "model_type", None) == GEMMA4_TEXT and not hasattr(config, "swa_head_dim"):
        from sglang.srt.utils.hf_transformers.config import _apply_gemma4_attention_overrides  # SGLang's: the plugin loads before it

        _apply_gemma4_attention_overrides(SimpleNamespace(text_config=config))
    return original(config)


def gemma4_backend_check(original: Callable, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``handle_model_specific_adjustments``: SGLang 0.5.23 asserts that a Gemma 4
    runs on trtllm_mha, triton, fa4, ascend, intel_xpu, intel_amx or aiter; on a CPU without AMX
    only ``torch_native`` runs, which attends Gemma 4's layers as any other's (sliding window,
    scaling 1, the shared-KV layers read their source layer's cache; checked against HF by
    tests/vlm/test_gemma4_parity.py). For a ``Gemma4ForCausalLM`` on ``torch_native`` the
    adjustments run with the architecture's name hidden (that branch holds only the assert)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of  # SGLang's: the plugin loads before it

    if getattr(server_args, "attention_backend", None) != "torch_native":
        return original(server_args, *args, **kwargs)
    hf_config = model_config_of(server_args).hf_config
    architectures = list(hf_config.architectures or [])
    if architectures[:1] != [GEMMA4_CAUSAL_LM]:
        return original(server_args, *args, **kwargs)
    hf_config.architectures = [f"{GEMMA4_CAUSAL_LM} on torch_native"]
    try:
        return original(server_args, *args, **kwargs)
    finally:
        hf_config.architectures = architectures


def gemma4_per_layer_inputs(original: Callable, self: Any, input_ids: Any, positions: Any,
                            forward_batch: Any, input_embeds: Any = None,
                            per_layer_inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of SGLang's ``Gemma4TextModel.forward`` where span rows replace embeddings
    (the model runner passes the ids and the scattered rows together, which SGLang 0.5.23's
    Gemma 4 refuses: "You must specify exactly one of input_ids or inputs_embeds"): the per-layer
    inputs (E2B / E4B) looked up from the ids with the text config's pad id at every span row, as
    HF's ``Gemma4Model`` looks them up at image positions, and their context part projected from
    the rows as sent (SGLang's own ``project_per_layer_inputs``); then the rows alone go on."""
    if input_ids is None or input_embeds is None:
        return original(self, input_ids, positions, forward_batch, input_embeds, per_layer_inputs,
                        *args, **kwargs)
    if self.embed_tokens_per_layer is not None and per_layer_inputs is None:
        ids = input_ids
        if forward_batch.replace_positions is not None:
            ids = ids.clone()
            ids[forward_batch.replace_positions] = self.config.pad_token_id
        per_layer_inputs = self.get_per_layer_inputs(ids)
    return original(self, None, positions, forward_batch, input_embeds, per_layer_inputs,
                    *args, **kwargs)
