"""Tiny random-weight PaliGemma checkpoints (PaliGemma 1: a Gemma LLM; PaliGemma 2: a Gemma2 LLM)
as transformers saves them, with their ``PaliGemmaProcessor``.

Built once into ``models.py``'s cache with fixed seeds. The SigLIP tower takes 32 px images in
8x8 patches (16 rows an image) in front of a tiny Gemma / Gemma2 (hidden 64, 2 layers), scaled up
from the default init so that the image, and the mask the prompt is attended with, change HF's
greedy answer. The tokenizer has PaliGemma's added tokens: ``<image>``, ``<loc0000>`` ..
``<loc1023>`` and ``<seg000>`` .. ``<seg127>``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import (
    Gemma2Config, GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration,
    PaliGemmaProcessor, SiglipImageProcessor, SiglipVisionConfig,
)

from sgl_embeds.serve import build_once
from sgl_embeds_testing.hub_layout import publish_layout
from sgl_embeds_testing.models import (
    TINY_HIDDEN, _rename_to_model_layout, cache_dir, save_scaled_vlm, train_tokenizer,
)

PALIGEMMA_CACHE_VERSION = "v3"  # v3: the processor files laid out as published
_FINAL_NORM = "language_model.model.norm.weight"
IMAGE_SIZE, PATCH = 32, 8  # 16 rows an image
ROWS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
# Gemma2's soft caps, lower than the real checkpoints' (50 and 30) so that they act on the tiny
# model's numbers; the sliding window longer than any test prompt
ATTN_SOFTCAP, FINAL_SOFTCAP, SLIDING_WINDOW = 20.0, 10.0, 256
# generation -> (seed, language-model weight scale, projector weight scale): picked so that the
# greedy answers are varied and change when the prompt is attended causally; the (tied) token
# embeddings keep the default init (``EMBED_SCALE``), or the LM head repeats the last token
_INIT = {1: (2, 8.0, 2.0), 2: (1, 8.0, 2.0)}
EMBED_SCALE = 1.0
# the final norm's gain (Gemma's RMSNorm multiplies by 1 + weight): logits of the tied LM head this
# many times larger, the same greedy tokens with wider top-2 gaps (else logits stay under 1)
LOGIT_SCALE = 8.0


# google/paligemma-3b-pt-224's config.json (the smallest PaliGemma): Gemma 2B (18 layers, one
# key-value head of 256) behind SigLIP So400m at 224 px (256 rows an image)
PUBLISHED_3B = ("google/paligemma-3b-pt-224", dict(
    hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
    num_key_value_heads=1, head_dim=256, max_position_embeddings=8192, vocab_size=257216), dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    image_size=224, patch_size=14))
# the language model x4 from HF's init, as the other published sizes (llava_next.PUBLISHED_INIT)
PUBLISHED_INIT = (4, 4.0, 2.0)


def tiny_paligemma_dir(generation: int = 1, layout: str = "saved") -> Path:
    """A tiny random-weight ``PaliGemmaForConditionalGeneration`` (float32) with its processor:
    SigLIP tower (hidden 32, 2 layers, no head), the linear projector, a Gemma (``generation=1``)
    or Gemma2 (``generation=2``: attention and final logit soft-capping, a sliding window on
    every other layer) language model with tied embeddings. ``layout``: as
    ``models.tiny_llava_dir``'s (``"saved"``: transformers' ``save_pretrained`` keys;
    ``"model"``: ``model.language_model.*``, ``model.vision_tower.vision_model.*``, ...)."""
    if generation not in _INIT:
        raise ValueError(f"generation must be 1 or 2, got {generation!r}")
    if layout not in ("saved", "model"):
        raise ValueError(f"layout must be 'saved' or 'model', got {layout!r}")

    text = dict(hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    if generation == 2:
        text.update(query_pre_attn_scalar=16, attn_logit_softcapping=ATTN_SOFTCAP,
                    final_logit_softcapping=FINAL_SOFTCAP, sliding_window=SLIDING_WINDOW)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    return _paligemma_dir(f"tiny-paligemma{generation}-{layout}-{PALIGEMMA_CACHE_VERSION}", generation,
                          layout, text, vision, _INIT[generation])


def published_paligemma_dir() -> Path:
    """PaliGemma 3B at its published sizes (``PUBLISHED_3B``), random weights (``PUBLISHED_INIT``),
    float32, our tokenizer with the embeddings at the published vocabulary size (for
    ``benchmarks/real_size.py``)."""
    _, text, vision = PUBLISHED_3B
    return _paligemma_dir(f"published-paligemma_3b-{PALIGEMMA_CACHE_VERSION}", 1, "saved", text, vision,
                          PUBLISHED_INIT)


def _paligemma_dir(name: str, generation: int, layout: str, text_size: dict, vision_size: dict,
                   init: tuple[int, float, float]) -> Path:
    """A random ``PaliGemmaForConditionalGeneration`` of these Gemma (``generation`` 1) or Gemma2
    (2) and SigLIP settings (the vocabulary is our tokenizer's unless ``text_size`` says), with its
    processor; ``init``: as ``save_scaled_vlm``'s, the final norm at gain ``LOGIT_SCALE``."""

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp / "tokenizer", extra_specials=("<image>",))
        shutil.rmtree(tmp / "tokenizer")
        tok.chat_template = None  # PaliGemma has none: its processor lays the prompt out
        side = vision_size["image_size"]
        image_processor = SiglipImageProcessor(
            size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        image_processor.image_seq_length = (side // vision_size["patch_size"]) ** 2
        processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)  # adds loc/seg
        text = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id, "tie_word_embeddings": True, **text_size}
        text_config = GemmaConfig(**text) if generation == 1 else Gemma2Config(**text)
        vision = SiglipVisionConfig(**vision_size, vision_use_head=False)
        config = PaliGemmaConfig(
            vision_config=vision.to_dict(), text_config=text_config.to_dict(),
            image_token_index=processor.image_token_id, projection_dim=text["hidden_size"],
            hidden_size=text["hidden_size"], vocab_size=text["vocab_size"])
        save_scaled_vlm(PaliGemmaForConditionalGeneration, config, init, tmp, embed_scale=EMBED_SCALE)
        weights = load_file(str(tmp / "model.safetensors"))
        weights[_FINAL_NORM] += LOGIT_SCALE - 1.0
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        processor.save_pretrained(tmp)
        publish_layout(tmp, "paligemma")
        if layout == "model":
            _rename_to_model_layout(tmp)

    return build_once(cache_dir() / name, build)


# a mask decoder of vae-oid.npz's layout at small widths: codebook, 1x1 conv, two residual blocks,
# four transposed convolutions, 1x1 conv (sgl_embeds.vlm.paligemma_masks)
MASK_DECODER_WIDTHS = dict(codes=128, embedding=8, hidden=16, upsampled=(16, 8, 4, 2))


def mask_decoder_weights(seed: int = 0) -> dict:
    """Random weights named and shaped as in ``vae-oid.npz`` (PyTorch layouts), at the widths of
    ``MASK_DECODER_WIDTHS``; NumPy's generator, so the same on every machine."""
    import numpy as np

    rng, w = np.random.default_rng(seed), MASK_DECODER_WIDTHS
    out = {"_vq_vae._embedding": rng.standard_normal((w["codes"], w["embedding"]), dtype=np.float32)}

    def conv(name, shape):
        fan_in = shape[1] * shape[2] * shape[3]
        out[name + ".weight"] = (2 * rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)
        out[name + ".bias"] = (0.1 * rng.standard_normal(shape[0], dtype=np.float32)).astype(np.float32)

    hidden = w["hidden"]
    conv("decoder.0", (hidden, w["embedding"], 1, 1))
    for block in ("decoder.2.net", "decoder.3.net"):
        conv(block + ".0", (hidden, hidden, 3, 3))
        conv(block + ".2", (hidden, hidden, 3, 3))
        conv(block + ".4", (hidden, hidden, 1, 1))
    widths = (hidden, *w["upsampled"])
    for name, (c_in, c_out) in zip(("decoder.4", "decoder.6", "decoder.8", "decoder.10"), zip(widths, widths[1:])):
        conv(name, (c_out, c_in, 4, 4))  # drawn as [out, in, k, k] for its scale, stored as [in, out, k, k]
        out[name + ".weight"] = np.ascontiguousarray(out[name + ".weight"].transpose(1, 0, 2, 3))
    conv("decoder.12", (1, widths[-1], 1, 1))
    return out
