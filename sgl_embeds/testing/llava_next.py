"""Tiny random-weight LLaVA-NeXT and LLaVA-OneVision checkpoints, as transformers saves them.

Each is an ordinary HF directory (config, float32 safetensors, our tokenizer with the image
token, the processor with its image processor, the chat template), built once into the cache of
``models.py`` with fixed seeds. The towers take 32x32 px tiles of 4x4 patches (16 rows per tile)
and the pinpoints are a few tiles wide, so an image costs 36 to about 170 rows; the language
models are the tiny ones SGLang serves on a CPU (hidden 64, 2 layers). The language model and the
projector are scaled up from the default init (as ``tiny_llava_dir``'s) so that the image changes
HF's greedy answer and answers are varied.
"""

from __future__ import annotations

from pathlib import Path

from transformers import (
    CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
    LlavaNextProcessor, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor,
    SiglipVisionConfig,
)

from sgl_embeds.testing.models import (
    LLAVA_CHAT_TEMPLATE, _build_atomically, _rename_to_model_layout, _tiny_config, cache_dir,
    save_scaled_vlm, train_tokenizer,
)

ANYRES_CACHE_VERSION = "v1"
TILE, PATCH = 32, 8  # the towers' image_size and patch_size: 4x4 patches per tile
# LLaVA-1.6's pinpoints (336 px tiles: 1x2, 2x1, 2x2, 1x3, 3x1 tiles) at 32 px tiles
NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
# OneVision's (1 to 6 tiles a side at 384 px) at 32 px tiles, 1 to 4 a side: a 3x4 feature map of
# 4x4 patches is over anyres_max_9 and is down-scaled
ONEVISION_PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 5) for j in range(1, 5)]
# The Qwen chat format of LLaVA-OneVision, with an image content part as "<image>\n".
ONEVISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# family -> (seed, language-model weight scale, projector weight scale)
_INIT = {"llava_next": (12, 6.0, 2.0), "llava_onevision": (14, 8.0, 4.0)}


def tiny_llava_next_dir(layout: str = "saved") -> Path:
    """A tiny ``LlavaNextForConditionalGeneration`` with its ``LlavaNextProcessor``: CLIP tower
    (hidden 32, 3 layers, QuickGELU; feature layer -2, class token dropped), GELU projector,
    ``NEXT_PINPOINTS``, the tiny Llama language model and the LLaVA-1.5 prompt format.
    ``layout``: as ``models.tiny_llava_dir``'s."""

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp, extra_specials=("<image>",))
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, image_size=TILE, patch_size=PATCH,
                                  hidden_act="quick_gelu", projection_dim=32)
        config = LlavaNextConfig(
            vision_config=vision.to_dict(), text_config=_tiny_config("llama", len(tok)).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
            vision_feature_layer=-2, vision_feature_select_strategy="default",
            image_grid_pinpoints=NEXT_PINPOINTS,
        )
        save_scaled_vlm(LlavaNextForConditionalGeneration, config, _INIT["llava_next"], tmp)
        image_processor = LlavaNextImageProcessor(
            size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
            image_grid_pinpoints=NEXT_PINPOINTS)
        processor = LlavaNextProcessor(
            image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=LLAVA_CHAT_TEMPLATE)
        processor.save_pretrained(tmp)
        if layout == "model":
            _rename_to_model_layout(tmp)

    return _build(f"tiny-llava_next-{layout}", layout, build)


def tiny_llava_onevision_dir(layout: str = "saved") -> Path:
    """A tiny ``LlavaOnevisionForConditionalGeneration`` with its ``LlavaOnevisionProcessor``:
    SigLIP tower (hidden 32, 3 layers, tanh GELU, layer-norm eps 1e-6; the last layer's
    features, all kept), GELU projector, ``ONEVISION_PINPOINTS`` with ``anyres_max_9``, SigLIP's
    normalization (mean and std 0.5), the tiny Qwen2 language model and the Qwen chat format.
    ``layout``: as ``models.tiny_llava_dir``'s."""

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp, extra_specials=("<image>", "<video>"))
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, image_size=TILE, patch_size=PATCH)
        config = LlavaOnevisionConfig(
            vision_config=vision.to_dict(), text_config=_tiny_config("qwen2", len(tok)).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            video_token_index=tok.convert_tokens_to_ids("<video>"), projector_hidden_act="gelu",
            vision_feature_layer=-1, vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=ONEVISION_PINPOINTS,
        )
        save_scaled_vlm(LlavaOnevisionForConditionalGeneration, config, _INIT["llava_onevision"],
                        tmp)
        siglip = dict(size={"height": TILE, "width": TILE}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        processor = LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(image_grid_pinpoints=ONEVISION_PINPOINTS,
                                                         **siglip),
            video_processor=LlavaOnevisionVideoProcessor(**siglip), tokenizer=tok,
            num_image_tokens=(TILE // PATCH) ** 2, vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9", chat_template=ONEVISION_CHAT_TEMPLATE)
        processor.save_pretrained(tmp)
        if layout == "model":
            _rename_to_model_layout(tmp)

    return _build(f"tiny-llava_onevision-{layout}", layout, build)


def _build(name: str, layout: str, build) -> Path:
    if layout not in ("saved", "model"):
        raise ValueError(f"layout must be 'saved' or 'model', got {layout!r}")
    return _build_atomically(cache_dir() / f"{name}-{ANYRES_CACHE_VERSION}", build)
