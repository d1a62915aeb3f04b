"""Random-weight LLaVA-NeXT and LLaVA-OneVision checkpoints as transformers saves them: tiny ones
for the tests, ``bench_*`` ones of the real vision geometry for the benchmarks.

Each is an ordinary HF directory built once into ``models.py``'s cache with fixed seeds. The tiny
towers take 32 px tiles of 4x4 patches (16 rows a tile; an image costs 36 to about 170 rows) in
front of the tiny language models (hidden 64, 2 layers), scaled up from the default init so that
the image changes HF's greedy answer; the ``bench_*`` ones keep the default init, their language
model as wide as the LLM the benchmark serves.
"""

from __future__ import annotations

from pathlib import Path

from transformers import (
    CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessor,
    LlavaNextProcessor, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor,
    Qwen2Config, SiglipVisionConfig,
)

from sgl_embeds_testing.models import (
    LLAVA_CHAT_TEMPLATE, TINY_HIDDEN, _rename_to_model_layout, _tiny_config,
    cache_dir, save_scaled_vlm, train_tokenizer,
)
from sgl_embeds.serve import build_once
from sgl_embeds_testing.hub_layout import publish_layout
from sgl_embeds.vlm import split
from sgl_embeds.vlm.tower import CONFIG_NAME

ANYRES_CACHE_VERSION = "v2"  # v2: the processor files laid out as published
# The real checkpoints' pinpoints: LLaVA-1.6's (336 px tiles: 1x2, 2x1, 2x2, 1x3, 3x1 tiles) and
# OneVision's (1 to 6 tiles a side at 384 px)
NEXT_336_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
ONEVISION_384_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
TILE, PATCH = 32, 8  # the tiny towers' image_size and patch_size: 4x4 patches per tile
# LLaVA-1.6's pinpoints at 32 px tiles
NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
# OneVision's at 32 px tiles, 1 to 4 a side: a 3x4 feature map of 4x4 patches is over
# anyres_max_9 and is down-scaled
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
# the benchmarks' checkpoints keep the default init: only what their towers cost matters
_BENCH_INIT = {"llava_next": (22, 1.0, 1.0), "llava_onevision": (24, 1.0, 1.0)}


def tiny_llava_next_dir(layout: str = "saved") -> Path:
    """A tiny ``LlavaNextForConditionalGeneration`` with its ``LlavaNextProcessor``: CLIP tower
    (hidden 32, 3 layers, QuickGELU; feature layer -2, class token dropped), GELU projector,
    ``NEXT_PINPOINTS``, the tiny Llama language model and the LLaVA-1.5 prompt format.
    ``layout``: as ``models.tiny_llava_dir``'s."""
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=TILE, patch_size=PATCH,
                              hidden_act="quick_gelu", projection_dim=32)
    return _llava_next_dir(f"tiny-llava_next-{layout}", layout, vision, NEXT_PINPOINTS,
                           TINY_HIDDEN, _INIT["llava_next"])


def bench_llava_next_dir(llm_hidden: int) -> Path:
    """A ``LlavaNextForConditionalGeneration`` with the vision half of LLaVA-1.6 at its real size
    (CLIP ViT-L/14 at 336 px, ``NEXT_336_PINPOINTS``; random weights) and the tiny Llama of width
    ``llm_hidden`` (for ``benchmarks/bench_encoder_cache.py``)."""
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14,
                              hidden_act="quick_gelu", projection_dim=768)
    return _llava_next_dir(f"bench-llava_next-h{llm_hidden}", "saved", vision,
                           NEXT_336_PINPOINTS, llm_hidden, _BENCH_INIT["llava_next"])


def tiny_llava_onevision_dir(layout: str = "saved") -> Path:
    """A tiny ``LlavaOnevisionForConditionalGeneration`` with its ``LlavaOnevisionProcessor``:
    SigLIP tower (hidden 32, 3 layers, tanh GELU, layer-norm eps 1e-6; the last layer's
    features, all kept), GELU projector, ``ONEVISION_PINPOINTS`` with ``anyres_max_9``, SigLIP's
    normalization (mean and std 0.5), the tiny Qwen2 language model and the Qwen chat format.
    ``layout``: as ``models.tiny_llava_dir``'s."""
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, image_size=TILE, patch_size=PATCH)
    return _llava_onevision_dir(f"tiny-llava_onevision-{layout}", layout, vision,
                                ONEVISION_PINPOINTS, TINY_HIDDEN, _INIT["llava_onevision"])


def bench_llava_onevision_dir(llm_hidden: int) -> Path:
    """A ``LlavaOnevisionForConditionalGeneration`` with the vision half of LLaVA-OneVision at its
    real size (SigLIP so400m-patch14-384 less its last layer, as the OneVision checkpoints carry
    it: 26 layers, no pooling head; ``ONEVISION_384_PINPOINTS``, ``anyres_max_9``; random weights)
    and the tiny Qwen2 of width ``llm_hidden`` (for ``benchmarks/bench_encoder_cache.py``)."""
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                                num_attention_heads=16, image_size=384, patch_size=14,
                                vision_use_head=False)
    return _llava_onevision_dir(f"bench-llava_onevision-h{llm_hidden}", "saved", vision,
                                ONEVISION_384_PINPOINTS, llm_hidden, _BENCH_INIT["llava_onevision"])


# Qwen2-0.5B, the language model of llava-hf/llava-onevision-qwen2-0.5b-ov-hf (its config.json)
PUBLISHED_ONEVISION_TEXT = dict(
    vocab_size=152000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


# seed, language-model and projector scales of the published sizes' random weights: at HF's init
# a 24-layer random LM repeats one token whatever the image (measured on OneVision-0.5B: 27070
# eight times, for both images); x4, three random prompts gave eight distinct tokens each
PUBLISHED_INIT = (24, 4.0, 2.0)


def published_llava_onevision_dir() -> Path:
    """LLaVA-OneVision-0.5B at its published size (``bench_llava_onevision_dir``'s vision half, the
    language model ``PUBLISHED_ONEVISION_TEXT``), random weights (``PUBLISHED_INIT``), float32, our
    tokenizer (for ``benchmarks/real_size.py``)."""
    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                                num_attention_heads=16, image_size=384, patch_size=14,
                                vision_use_head=False)
    return _llava_onevision_dir("published-llava_onevision_0_5b-lm4", "saved", vision, ONEVISION_384_PINPOINTS,
                                PUBLISHED_ONEVISION_TEXT["hidden_size"], PUBLISHED_INIT,
                                text_size=PUBLISHED_ONEVISION_TEXT)


def split_dir(checkpoint: Path) -> Path:
    """``split``'s output of ``checkpoint`` (``llm/`` and ``vision/``), made once next to it in
    the cache."""
    return build_once(checkpoint.with_name(checkpoint.name + "-split"),
                             lambda tmp: split(checkpoint, tmp, log=lambda message: None),
                             done=f"vision/{CONFIG_NAME}")


def _llava_next_dir(name: str, layout: str, vision: CLIPVisionConfig,
                    pinpoints: list[list[int]], llm_hidden: int,
                    init: tuple[int, float, float]) -> Path:
    """A random ``LlavaNextForConditionalGeneration`` of the ``vision`` tower and the tiny Llama
    of width ``llm_hidden``, with our tokenizer, the processor for ``pinpoints`` and the LLaVA-1.5
    prompt format; ``init``: as ``save_scaled_vlm``'s."""
    tile = vision.image_size

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp, extra_specials=("<image>",))
        config = LlavaNextConfig(
            vision_config=vision.to_dict(),
            text_config=_tiny_config("llama", len(tok), llm_hidden).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
            vision_feature_layer=-2, vision_feature_select_strategy="default",
            image_grid_pinpoints=pinpoints,
        )
        save_scaled_vlm(LlavaNextForConditionalGeneration, config, init, tmp)
        image_processor = LlavaNextImageProcessor(
            size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
            image_grid_pinpoints=pinpoints)
        processor = LlavaNextProcessor(
            image_processor=image_processor, tokenizer=tok, patch_size=vision.patch_size,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=LLAVA_CHAT_TEMPLATE)
        processor.save_pretrained(tmp)
        publish_layout(tmp, "llava_next")
        if layout == "model":
            _rename_to_model_layout(tmp)

    return _build(name, layout, build)


def _llava_onevision_dir(name: str, layout: str, vision: SiglipVisionConfig,
                         pinpoints: list[list[int]], llm_hidden: int,
                         init: tuple[int, float, float], text_size: dict | None = None) -> Path:
    """A random ``LlavaOnevisionForConditionalGeneration`` of the ``vision`` tower and the tiny
    Qwen2 of width ``llm_hidden`` (``text_size``: a Qwen2 of these settings instead), with our
    tokenizer, the processor for ``pinpoints`` and ``anyres_max_9``, SigLIP's normalization and
    the Qwen chat format; ``init``: as ``save_scaled_vlm``'s."""
    tile = vision.image_size

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp, extra_specials=("<image>", "<video>"))
        config = LlavaOnevisionConfig(
            vision_config=vision.to_dict(),
            text_config=(_tiny_config("qwen2", len(tok), llm_hidden) if text_size is None else Qwen2Config(
                bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32", **text_size)).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"),
            video_token_index=tok.convert_tokens_to_ids("<video>"), projector_hidden_act="gelu",
            vision_feature_layer=-1, vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=pinpoints,
            tie_word_embeddings=bool((text_size or {}).get("tie_word_embeddings")),
        )
        save_scaled_vlm(LlavaOnevisionForConditionalGeneration, config, init, tmp)
        siglip = dict(size={"height": tile, "width": tile}, image_mean=[0.5] * 3,
                      image_std=[0.5] * 3)
        processor = LlavaOnevisionProcessor(
            image_processor=LlavaOnevisionImageProcessor(image_grid_pinpoints=pinpoints, **siglip),
            video_processor=LlavaOnevisionVideoProcessor(**siglip), tokenizer=tok,
            num_image_tokens=(tile // vision.patch_size) ** 2,
            vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
            chat_template=ONEVISION_CHAT_TEMPLATE)
        processor.save_pretrained(tmp)
        publish_layout(tmp, "llava_onevision")
        if layout == "model":
            _rename_to_model_layout(tmp)

    return _build(name, layout, build)


def _build(name: str, layout: str, build) -> Path:
    if layout not in ("saved", "model"):
        raise ValueError(f"layout must be 'saved' or 'model', got {layout!r}")
    return build_once(cache_dir() / f"{name}-{ANYRES_CACHE_VERSION}", build)
