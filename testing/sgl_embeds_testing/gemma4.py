"""Tiny random-weight Gemma 4 checkpoints (``Gemma4ForConditionalGeneration``, float32) with
``Gemma4Processor`` and a Gemma-4-style chat template, built once with fixed seeds in two layouts:
``"e2b"`` (E2B / E4B: images causal, per-layer inputs, shared-KV last layers) and ``"31b"``
(26B-A4B / 31B: each image one block on the sliding layers only, k=v full layers of their own head
width, experts beside the MLP, a standardized tower). Both: a tower of 4 px patches pooled 3x3,
at most ``MAX_SOFT_TOKENS`` rows an image (63 to 70 for the test images), a text model of hidden
64 whose sliding window (``SLIDING_WINDOW``) is shorter than an image and every test prompt;
weights scaled so that greedy answers vary and change with the image."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4Config, Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor, Gemma4Processor, Gemma4TextConfig, Gemma4VideoProcessor,
    Gemma4VisionConfig,
)

from sgl_embeds.serve import build_once
from sgl_embeds_testing.models import TINY_HIDDEN, cache_dir, save_scaled_vlm, train_tokenizer

GEMMA4_CACHE_VERSION = "v1"
LAYOUTS = ("e2b", "31b")
PATCH, POOLING = 4, 3  # patch side in pixels; patches pooled POOLING x POOLING into one row
MAX_SOFT_TOKENS = 70  # the smallest budget Gemma4ImageProcessor allows: at most 70 rows an image
SLIDING_WINDOW = 48  # shorter than an image's rows and than every test prompt
LAYER_TYPES = {
    "e2b": ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
            "sliding_attention", "full_attention"),
    "31b": ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
            "full_attention"),
}
KV_SHARED_LAYERS = 2  # "e2b": layers 4 and 5 reuse layer 3's (sliding) and 2's (full) keys
PER_LAYER_HIDDEN = 16  # "e2b": hidden_size_per_layer_input
# Gemma 4's tokens (the released tokenizer's strings)
BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
BOA, AUDIO, EOA = "<|audio>", "<|audio|>", "<audio|>"
VIDEO = "<|video|>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
# A chat template in Gemma 4's shape: the bos, turns as <|turn>{role}\n...<turn|>\n (the
# assistant is "model"), an image part as the image token (the processor expands it)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
# layout -> (seed, language-model weight scale, projector weight scale): picked so that the
# greedy answers are varied, change with the image and with each mask rule the tests break
_INIT = {"e2b": (7, 4.0, 1.0), "31b": (11, 4.0, 1.0)}
EMBED_SCALE = 1.0  # the tied token embeddings keep the default init (gemma3.py)
TOWER_SCALE = 8.0  # the vision tower's weights: patches that differ give rows that differ
POSITION_STD = 1.0  # the tower's 2-D position table (all ones at init)
LOGIT_SCALE = 8.0  # the final norm's gain: wider top-2 gaps (Gemma 4 multiplies by the weight)
_POSITIONS = "model.vision_tower.patch_embedder.position_embedding_table"
_FINAL_NORM = "model.language_model.norm.weight"


def _text_config(layout: str, tok) -> Gemma4TextConfig:
    layer_types = list(LAYER_TYPES[layout])
    common = dict(
        vocab_size=len(tok), hidden_size=TINY_HIDDEN, intermediate_size=128,
        num_hidden_layers=len(layer_types), layer_types=layer_types, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=SLIDING_WINDOW,
        max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    if layout == "e2b":
        return Gemma4TextConfig(
            **common, hidden_size_per_layer_input=PER_LAYER_HIDDEN,
            vocab_size_per_layer_input=len(tok), num_kv_shared_layers=KV_SHARED_LAYERS)
    return Gemma4TextConfig(
        **common, use_bidirectional_attention="vision", hidden_size_per_layer_input=0,
        attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def _tokenizer_and_processor(tmp: Path, patch: int, max_soft_tokens: int):
    """Our tokenizer with Gemma 4's specials, and a ``Gemma4Processor`` around it of ``patch`` px
    patches pooled ``POOLING`` x ``POOLING``, at most ``max_soft_tokens`` rows an image."""
    train_tokenizer(tmp / "tokenizer", extra_specials=(
        BOI, IMAGE, EOI, BOA, AUDIO, EOA, VIDEO, TURN_START, TURN_END))
    tok = AutoTokenizer.from_pretrained(tmp / "tokenizer", extra_special_tokens={
        "boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI, "boa_token": BOA,
        "audio_token": AUDIO, "eoa_token": EOA})
    shutil.rmtree(tmp / "tokenizer")
    sizes = dict(patch_size=patch, pooling_kernel_size=POOLING, max_soft_tokens=max_soft_tokens)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(**sizes),
        video_processor=Gemma4VideoProcessor(**sizes), tokenizer=tok,
        chat_template=CHAT_TEMPLATE, image_seq_length=max_soft_tokens)
    return tok, processor


def _config(tok, text: Gemma4TextConfig, vision: Gemma4VisionConfig) -> Gemma4Config:
    """The VLM's config: ``text`` and ``vision`` with our tokenizer's special ids, no audio."""
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("boi_token_id", BOI), ("eoi_token_id", EOI), ("image_token_id", IMAGE), ("video_token_id", VIDEO),
        ("boa_token_id", BOA), ("eoa_token_index", EOA), ("audio_token_id", AUDIO))}
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, **ids)


def tiny_gemma4_dir(layout: str) -> Path:
    """A tiny random-weight ``Gemma4ForConditionalGeneration`` (float32) of ``layout``
    (``"e2b"`` or ``"31b"``, the module docstring) with its processor."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    def build(tmp: Path) -> None:
        tok, processor = _tokenizer_and_processor(tmp, PATCH, MAX_SOFT_TOKENS)
        vision = Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, patch_size=PATCH, pooling_kernel_size=POOLING,
            position_embedding_size=MAX_SOFT_TOKENS * POOLING + 1, standardize=(layout == "31b"))
        config = _config(tok, _text_config(layout, tok), vision)
        save_scaled_vlm(Gemma4ForConditionalGeneration, config, _INIT[layout], tmp,
                        embed_scale=EMBED_SCALE)
        weights = load_file(str(tmp / "model.safetensors"))
        torch.manual_seed(_INIT[layout][0])
        for key in weights:
            if key.startswith("model.vision_tower.encoder.") and "norm" not in key:
                weights[key] *= TOWER_SCALE
            elif key.startswith("model.embed_vision."):
                weights[key] *= _INIT[layout][2]
        weights[_POSITIONS] = torch.randn_like(weights[_POSITIONS]) * POSITION_STD
        weights[_FINAL_NORM] *= LOGIT_SCALE
        if layout == "31b":  # the standardization's bias and scale: zero and one at init
            weights["model.vision_tower.std_bias"] = torch.randn(32) * 0.1
            weights["model.vision_tower.std_scale"] = 1.0 + torch.randn(32) * 0.1
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        processor.save_pretrained(tmp)

    return build_once(cache_dir() / f"tiny-gemma4-{layout}-{GEMMA4_CACHE_VERSION}", build)


# google/gemma-4-E2B-it's config.json (the smallest Gemma 4; text settings as public config
# parsers' fixtures write them down, the vision half at HF's defaults, which are E2B's tower):
# per-layer inputs of 256 over the whole vocabulary, the last 20 layers reusing earlier keys and
# values with MLPs twice as wide, four sliding layers (window 512) to one full (head dim 512)
PUBLISHED_E2B = ("google/gemma-4-E2B-it", dict(
    hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=1, head_dim=256, global_head_dim=512, vocab_size=262144,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
    use_double_wide_mlp=True, sliding_window=512, max_position_embeddings=131072, rms_norm_eps=1e-6,
    final_logit_softcapping=30.0, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
                     "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}), dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
    num_key_value_heads=12, head_dim=64, patch_size=16, use_clipped_linears=True), 280)


def published_gemma4_e2b_dir() -> Path:
    """Gemma 4 E2B at its published sizes (``PUBLISHED_E2B``), random weights at HF's init, stored
    in bfloat16 as the hub stores it (about 9.6 GB: in float32 its language model alone is 18.5
    GB), our tokenizer with the embeddings at the published vocabulary size (for
    ``benchmarks/real_size.py``)."""
    _, text_size, vision_size, max_soft_tokens = PUBLISHED_E2B

    def build(tmp: Path) -> None:
        tok, processor = _tokenizer_and_processor(tmp, vision_size["patch_size"], max_soft_tokens)
        text = Gemma4TextConfig(**text_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        vision = Gemma4VisionConfig(**vision_size, pooling_kernel_size=POOLING)
        torch.manual_seed(_INIT["e2b"][0])
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # built in float32, it would not fit beside its copy
        try:
            model = Gemma4ForConditionalGeneration(_config(tok, text, vision))
        finally:
            torch.set_default_dtype(default)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)

    return build_once(cache_dir() / f"published-gemma4_e2b-{GEMMA4_CACHE_VERSION}", build)
