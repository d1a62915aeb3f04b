"""Tiny random-weight Qwen-VL checkpoints (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3.5) that SGLang
serves natively and HF loads as they are, and HF's own class on each as the token reference.

Each is an ordinary HF directory built once into ``models.py``'s cache with fixed seeds. The
invariant the tests rely on: the config's vision token ids are the tokenizer's ids of the same
tokens, and the image processor turns a small image into few patches (at most
``MAX_IMAGE_TOKENS`` rows in the prompt).
"""

from __future__ import annotations

import base64
import io
import shutil
from functools import lru_cache
from pathlib import Path

import torch

from sgl_embeds.serve import build_once
from sgl_embeds_testing.models import cache_dir, train_tokenizer
from sgl_embeds_testing.hub_layout import publish_layout
from sgl_embeds_testing.reference import Greedy, _greedy_from_scores
from sgl_embeds_protocol.family import FAMILIES, NATIVE

QWEN_VL_CACHE_VERSION = "v6"  # v6: the processor files laid out as published (hub_layout.py)
# v5: as transformers saves them, without the fields SGLang reads and they lack (serve writes
# them: serve.hybrid_config_fixes)
HYBRID_CACHE_VERSION = "v5"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_SPECIALS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# What one image (one clip) becomes in a prompt before the processor expands the pad to
# t*h*w/merge**2 (a Qwen3-VL clip: frame by frame, each after its time).
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PLACEHOLDER = VISION_START + VIDEO_PAD + VISION_END
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
QWEN3_PATCH = 16  # Qwen3-VL's patch size
# Gated DeltaNet + attention, Qwen3-VL's vision half
HYBRID_FAMILIES = tuple(f.name for f in FAMILIES if f.hybrid and f.served_as == NATIVE)
QWEN3_FAMILIES = ("qwen3_vl", *HYBRID_FAMILIES)  # Qwen3-VL's processor, interleaved M-RoPE
FACTOR = PATCH * MERGE  # image sides are resized to multiples of this (Qwen2-VL, Qwen2.5-VL)
MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS = 4, 16
# The Qwen chat format, with an image (a video) content part rendered as its placeholder.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'video' %}"
    + VIDEO_PLACEHOLDER + "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# seed, language-model weight scale, vision-merger weight scale (see tiny_qwen2_5_vl_dir)
_INIT = (7, 3.0, 2.0)


def tiny_qwen2_5_vl_dir() -> Path:
    """A tiny random-weight ``Qwen2_5_VLForConditionalGeneration`` saved as an HF directory.

    Language model: hidden 64, 2 layers, 4 heads (2 KV), head dim 16, M-RoPE sections [2, 3, 3].
    Vision tower: hidden 32, depth 2, 2 heads; window 56 px (2x2 merged patches), so block 0 runs
    windowed attention on any image of more than 2x2 merged patches and block 1 full attention.
    Images are resized to multiples of 28 px holding 4 to 16 merged patches (prompt rows).
    The language model is scaled x3 and the merger x2 from the default init, so that the image
    changes the greedy answer from its first token on (measured: at the default init two images
    of tests/vlm/test_qwen_vl_native.py gave varied answers with the same first token; with the LM
    scaled alone, one answer fell into a two-token loop).
    """
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return _qwen2_5_vl_dir(f"tiny-qwen2_5_vl-{QWEN_VL_CACHE_VERSION}", text, vision,
                           (MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS), _INIT)


def bench_qwen2_5_vl_dir() -> Path:
    """A random-weight Qwen2.5-VL big enough that prefill and the vision tower take visible time
    on a CPU (for ``benchmarks/bench_native_vlm.py``): LM hidden 1024, 8 layers, 16 heads (4 KV);
    tower hidden 512, depth 8, 8 heads; up to 256 rows per image (a 448x448 image)."""
    text = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=8192)
    vision = dict(depth=8, hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=1024)
    return _qwen2_5_vl_dir(f"bench-qwen2_5_vl-{QWEN_VL_CACHE_VERSION}", text, vision, (4, 256), (7, 1.0, 1.0))


def bench_qwen3_vl_dir() -> Path:
    """A random-weight Qwen3-VL of ``bench_qwen2_5_vl_dir``'s sizes (LM hidden 1024, 8 layers, 16
    heads (4 KV), head dim 64; tower hidden 512, depth 8, 8 heads, patch 16) with deepstack rows
    from blocks 1, 3 and 5 (an image's span is ``[n, 1024 x 4]``); up to 256 rows per image (a
    512x512 image)."""
    text = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
    vision = dict(depth=8, hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=1024,
                  deepstack_visual_indexes=[1, 3, 5])
    return _qwen_vl_dir(f"bench-qwen3_vl-{QWEN_VL_CACHE_VERSION}", "qwen3_vl", text, vision, (4, 256), (7, 1.0, 1.0))


# Published sizes (each checkpoint's config.json: text, vision, rotary), for random-weight copies
# with our tokenizer (benchmarks/real_size.py); all four tie their word embeddings
PUBLISHED = {
    "qwen3_vl_2b": ("qwen3_vl", "Qwen/Qwen3-VL-2B-Instruct", dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
        rms_norm_eps=1e-6), dict(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
        num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
        {"rope_theta": 5e6, "mrope_section": [24, 20, 20]}),
    "qwen2_vl_2b": ("qwen2_vl", "Qwen/Qwen2-VL-2B-Instruct", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6), dict(
        depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, hidden_act="quick_gelu"),
        {"rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    "qwen2_5_vl_3b": ("qwen2_5_vl", "Qwen/Qwen2.5-VL-3B-Instruct", dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rms_norm_eps=1e-6), dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu"),
        {"rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    # hybrid: three Gated DeltaNet layers, then one full attention; a vision half without deepstack
    "qwen3_5_0_8b": ("qwen3_5", "Qwen/Qwen3.5-0.8B", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, vocab_size=248320, max_position_embeddings=262144,
        rms_norm_eps=1e-6, full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16), dict(
        depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
        num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh"),
        {"rope_theta": 1e7, "mrope_section": [11, 11, 10]}),
}
PUBLISHED_IMAGE_TOKENS = (4, 16384)  # the processors' min_pixels / max_pixels, in merged patches


def published_qwen_vl_dir(name: str) -> Path:
    """A random-weight Qwen-VL at the size of the published checkpoint ``name`` of ``PUBLISHED``,
    float32, with our tokenizer and the processor's published image limits; the language model
    x4 and the merger x2 from HF's init (``llava_next.PUBLISHED_INIT``: why)."""
    family, _, text, vision, rope = PUBLISHED[name]
    return _qwen_vl_dir(f"published-{name}-lm4-{QWEN_VL_CACHE_VERSION}", family, text, vision,
                        PUBLISHED_IMAGE_TOKENS, (7, 4.0, 2.0), rope=rope, tie=True)


def _mrope_section(text_size: dict) -> list[int]:
    """Rotary pairs per axis (time, height, width) over the head's half: [2, 3, 3] at head dim 16,
    Qwen2.5-VL's own [16, 24, 24] at 128."""
    half = text_size["hidden_size"] // text_size["num_attention_heads"] // 2
    time_pairs = half // 4
    return [time_pairs, (half - time_pairs) // 2, (half - time_pairs) // 2]


def tiny_qwen2_vl_dir() -> Path:
    """A tiny random-weight ``Qwen2VLForConditionalGeneration`` (Qwen2-VL): the language model of
    ``tiny_qwen2_5_vl_dir``; a vision tower of width 32, depth 2, no windows, its merger out to the
    LM's hidden 64; patch 14, images of 4 to 16 merged patches."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    # seed 3: at seed 7 every image gave one token repeated (measured); at 3 the answers vary
    # and change with the image
    return _qwen_vl_dir(f"tiny-qwen2_vl-{QWEN_VL_CACHE_VERSION}", "qwen2_vl", text, vision,
                        (MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS), (3, *_INIT[1:]))


def tiny_qwen3_vl_dir() -> Path:
    """A tiny random-weight ``Qwen3VLForConditionalGeneration`` (Qwen3-VL): language model hidden
    64, 4 layers, 4 heads (2 KV), head dim 16, interleaved M-RoPE sections [2, 3, 3]; vision tower
    width 32, depth 4, learned position embeddings (8x8), patch 16, and three deepstack layers, as
    the published checkpoints have, from blocks 0, 1 and 3 (``deepstack_visual_indexes``: the LLM
    adds them after its layers 0, 1 and 2; a layer added after the last one would reach no
    answer); images of 4 to 16 merged patches. An image's span is ``[n, 64 x 4]``: its rows, then
    each deepstack layer's."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[0, 1, 3])
    return _qwen_vl_dir(f"tiny-qwen3_vl-{QWEN_VL_CACHE_VERSION}", "qwen3_vl", text, vision,
                        (MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS), _INIT)


def tiny_qwen3_5_dir() -> Path:
    """A tiny random-weight ``Qwen3_5ForConditionalGeneration`` (Qwen3.5: hybrid, natively
    multimodal): language model hidden 64, 4 layers, three Gated DeltaNet (linear attention: 2 key
    heads and 4 value heads of 16, conv kernel 4) then one full attention (4 heads, 2 KV, head dim
    32, output gate, rotary on a quarter of the head: interleaved M-RoPE sections [2, 1, 1]); the
    vision half is Qwen3-VL's without deepstack (width 32, depth 2, patch 16). The zero-centred
    norms get small random weights, so a kernel that drops their ``1 +`` is seen."""
    return _qwen_vl_dir(f"tiny-qwen3_5-{HYBRID_CACHE_VERSION}", "qwen3_5", _HYBRID_TEXT, _HYBRID_VISION,
                        (MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS), _INIT)


def tiny_qwen3_5_moe_dir() -> Path:
    """A tiny random-weight ``Qwen3_5MoeForConditionalGeneration`` (Qwen3.5-MoE): the layers of
    ``tiny_qwen3_5_dir`` with each MLP a mixture of 4 experts (2 per token, width 32) and a
    shared expert (width 64)."""
    text = dict(_HYBRID_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=64)
    return _qwen_vl_dir(f"tiny-qwen3_5_moe-{HYBRID_CACHE_VERSION}", "qwen3_5_moe", text, _HYBRID_VISION,
                        (MIN_IMAGE_TOKENS, MAX_IMAGE_TOKENS), _INIT)


# Qwen3.5's sizes (tiny_qwen3_5_dir): its language model, and Qwen3-VL's vision half without deepstack
_HYBRID_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4)
_HYBRID_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64)


def _qwen2_5_vl_dir(name: str, text_size: dict, vision_size: dict, image_tokens: tuple[int, int],
                    init: tuple[int, float, float]) -> Path:
    vision = dict(**vision_size, window_size=2 * FACTOR, fullatt_block_indexes=[1], tokens_per_second=2)
    return _qwen_vl_dir(name, "qwen2_5_vl", text_size, vision, image_tokens, init)


def _family_classes(family: str) -> tuple:
    """(config, model, processor, video processor) classes of a Qwen-VL family, and its patch size."""
    import transformers as tf

    return {
        "qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor,
                     tf.Qwen2VLVideoProcessor, PATCH),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor,
                       tf.Qwen2VLVideoProcessor, PATCH),
        "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLProcessor,
                     tf.Qwen3VLVideoProcessor, QWEN3_PATCH),
        "qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, tf.Qwen3VLProcessor,
                    tf.Qwen3VLVideoProcessor, QWEN3_PATCH),
        "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration, tf.Qwen3VLProcessor,
                        tf.Qwen3VLVideoProcessor, QWEN3_PATCH),
    }[family]


def _qwen_vl_dir(name: str, family: str, text_size: dict, vision_size: dict, image_tokens: tuple[int, int],
                 init: tuple[int, float, float], rope: dict | None = None, tie: bool = False) -> Path:
    """A random Qwen-VL model of ``family`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``) and the
    given sizes, with our tokenizer (vision specials included), the processor (images of
    ``image_tokens`` rows, min to max) and the chat template; ``init``: seed, language-model and
    merger weight scales; ``rope``: rotary settings over the tiny ones; ``tie``: tied embeddings.
    A ``vocab_size`` in ``text_size`` sizes the embeddings past our tokenizer's."""

    def build(tmp: Path) -> None:
        from transformers import Qwen2VLImageProcessor

        config_class, model_class, processor_class, video_class, patch = _family_classes(family)
        factor = patch * MERGE
        tok = train_tokenizer(tmp, extra_specials=VISION_SPECIALS)
        ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_SPECIALS}
        # theta 10, not 10^4: over a few patches even the slowest rotary frequencies (those of the
        # width axis) turn, so an image's 3-D positions change the answer (a wrong grid or 1-D
        # positions must fail the parity tests). Qwen3-VL interleaves the axes' frequencies (HF
        # always does; SGLang where the config says so, as real Qwen3-VL configs do).
        rope_parameters = {"rope_type": "default", "rope_theta": 10.0, "mrope_section": _mrope_section(text_size)}
        if family in QWEN3_FAMILIES:
            rope_parameters["mrope_interleaved"] = True
        if family in HYBRID_FAMILIES:  # rotary on a quarter of the head (Qwen3.5's own factor)
            rope_parameters.update(partial_rotary_factor=0.25, mrope_section=[2, 1, 1])
        rope_parameters.update(rope or {})
        text = {"vocab_size": len(tok), **text_size, "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                "rope_parameters": rope_parameters}
        vision = dict(**vision_size, patch_size=patch, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH)
        config = config_class(
            text_config=text, vision_config=vision, tie_word_embeddings=tie,
            image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
            vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
            **({} if family in QWEN3_FAMILIES else dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                     pad_token_id=tok.pad_token_id)),
        )
        seed, lm_scale, merger_scale = init
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    if family in HYBRID_FAMILIES and "language_model" in name:  # zero-centred: 1 + w
                        p.add_(0.3 * torch.randn_like(p))
                    continue
                if "language_model" in name or name.startswith("lm_head"):
                    p.mul_(lm_scale)
                elif "merger" in name:
                    p.mul_(merger_scale)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        min_tokens, max_tokens = image_tokens
        pixels = dict(patch_size=patch, merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH)
        image_processor = Qwen2VLImageProcessor(min_pixels=min_tokens * factor**2, max_pixels=max_tokens * factor**2,
                                                **pixels)
        if family in QWEN3_FAMILIES:
            video_processor = video_class(size={"shortest_edge": min_tokens * factor**2,
                                                "longest_edge": 4 * max_tokens * factor**2},
                                          do_sample_frames=False, **pixels)
        else:
            video_processor = video_class(min_pixels=min_tokens * factor**2, max_pixels=max_tokens * factor**2,
                                          **pixels)
        processor = processor_class(image_processor=image_processor, video_processor=video_processor,
                                    tokenizer=tok, chat_template=QWEN_VL_CHAT_TEMPLATE)
        processor.save_pretrained(tmp)  # transformers 5 nests both processors' settings in it
        # and the classic files, for loaders that read the image processor on its own
        processor.image_processor.save_pretrained(tmp)  # preprocessor_config.json
        processor.video_processor.save_pretrained(tmp)  # video_preprocessor_config.json
        publish_layout(tmp, family)

    return build_once(cache_dir() / name, build)


# -- HF's Qwen-VL classes as the reference (float32, greedy) -----------------------------------


@lru_cache(maxsize=4)
def hf_qwen_vl(checkpoint: str):
    """HF's model (the checkpoint's own class: Qwen2-VL, Qwen2.5-VL or Qwen3-VL) and processor,
    loaded once."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def qwen_vl_inputs(checkpoint: str | Path, text: str, images: list, add_special_tokens: bool = True,
                   clips: list = ()) -> dict:
    """What HF's processor builds for ``text`` (one ``IMAGE_PLACEHOLDER`` per image, one
    ``VIDEO_PLACEHOLDER`` per clip): the pads expanded, ``pixel_values`` and ``image_grid_thw``,
    and for ``clips`` (``(frames, fps)``: all frames used, sampled at ``fps``) the videos' too.
    ``add_special_tokens=False`` for a rendered chat, as ``apply_chat_template`` tokenizes it."""
    _, processor = hf_qwen_vl(str(checkpoint))
    videos = {}
    if clips:
        videos = dict(videos=[frames for frames, _ in clips], do_sample_frames=False,
                      video_metadata=[{"fps": fps, "total_num_frames": len(frames),
                                       "frames_indices": list(range(len(frames)))} for frames, fps in clips])
    return dict(processor(text=[text], images=images or None, return_tensors="pt",
                          add_special_tokens=add_special_tokens, **videos))


@torch.no_grad()
def qwen_vl_greedy(checkpoint: str | Path, text: str, images: list, max_new_tokens: int,
                   prefix: list[int] = (), add_special_tokens: bool = True, clips: list = ()) -> Greedy:
    """HF's Qwen-VL ``generate`` (float32, greedy) after ``text`` +
    ``prefix``, for ``reference.check_greedy`` (``add_special_tokens``, ``clips``: see
    ``qwen_vl_inputs``)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    model, _ = hf_qwen_vl(str(checkpoint))
    inputs = qwen_vl_inputs(checkpoint, text, images, add_special_tokens, clips)
    if prefix:  # text tokens after the prompt: M-RoPE continues them from the prompt's last position
        extra = torch.tensor([list(prefix)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:
            types = inputs["mm_token_type_ids"]
            inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros_like(extra)], dim=1)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens - len(prefix), do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=model.config.text_config.pad_token_id)
    return _greedy_from_scores(out.sequences, out.scores)


# -- the client's half: an image's rows, as HF's own vision module computes them --------------


@torch.no_grad()
def image_rows(checkpoint: str | Path, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The rows HF's Qwen-VL model puts at an image's pad tokens and the image's grid (t, h, w),
    from the checkpoint's own processor and vision module: ``[t*h*w/merge**2, width]`` float32,
    where a Qwen3-VL's width holds its deepstack rows after its main ones (SGLang's layout:
    ``[n, hidden x (1 + deepstack layers)]``)."""
    model, processor = hf_qwen_vl(str(checkpoint))
    pixels = processor.image_processor(images=[image], return_tensors="pt")
    (grid,) = pixels["image_grid_thw"].tolist()
    features = model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    return _one_item_rows(features), tuple(grid)


def _one_item_rows(features) -> torch.Tensor:
    """The rows of HF's ``get_image_features`` / ``get_video_features`` of one image or clip,
    float32, with any deepstack rows after the main ones along the width (SGLang's layout)."""
    (rows,) = features.pooler_output
    deepstack = [layer[0] for layer in getattr(features, "deepstack_features", None) or []]
    return torch.cat([rows, *deepstack], dim=1).float()


@torch.no_grad()
def clip_rows(checkpoint: str | Path, frames, fps: float) -> tuple[torch.Tensor, dict]:
    """The rows HF's Qwen-VL model puts at a clip's pad tokens (``get_video_features``, frame
    after frame; Qwen3-VL's deepstack rows after the main ones along the width) and the clip's
    span fields: ``video_grid_thw`` and the time HF's processor uses (Qwen2.5-VL
    ``second_per_grid_t``, temporal patch / fps; Qwen3-VL ``video_timestamps``, from its
    processor's own ``_calculate_timestamps``). ``frames``: ``[n, height, width, 3]`` uint8, all
    used, sampled at ``fps``."""
    model, processor = hf_qwen_vl(str(checkpoint))
    videos = processor.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    (grid,) = videos["video_grid_thw"].tolist()
    rows = _one_item_rows(model.get_video_features(videos["pixel_values_videos"], videos["video_grid_thw"]))
    fields = {"video_grid_thw": grid}
    temporal_patch = processor.video_processor.temporal_patch_size
    if model.config.model_type == "qwen2_5_vl":
        fields["second_per_grid_t"] = temporal_patch / fps
    elif model.config.model_type in QWEN3_FAMILIES:  # Qwen3.5 takes Qwen3-VL's processor
        fields["video_timestamps"] = processor._calculate_timestamps(list(range(len(frames))), fps, temporal_patch)
    return rows, fields


def sample_clip(n_frames: int, width: int, height: int, seed: int = 0):
    """``[n_frames, height, width, 3]`` uint8: a square of one colour moving across a background
    of another (colours and path drawn from ``seed``), so that each frame, and their order, differ."""
    import numpy as np

    rng = np.random.default_rng(seed)
    background, square = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    side = max(4, min(width, height) // 2)
    frames = np.empty((n_frames, height, width, 3), np.uint8)
    frames[:] = background
    for i in range(n_frames):
        x = (i * (width - side)) // max(1, n_frames - 1)
        y = int(rng.integers(0, height - side + 1))
        frames[i, y:y + side, x:x + side] = square
    return frames


def poisoned_vision_dir(checkpoint: Path) -> Path:
    """A copy of ``checkpoint`` whose vision tower and merger weights are all NaN: a server on it
    answers raw images with garbage, so a span served exactly proves the tower never ran."""
    from safetensors.torch import load_file, save_file

    def build(tmp: Path) -> None:
        for f in checkpoint.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, tmp / f.name)
        for f in checkpoint.glob("*.safetensors"):
            weights = load_file(f)
            poisoned = {k: torch.full_like(v, float("nan")) if "visual" in k else v for k, v in weights.items()}
            assert any("visual" in k for k in weights), "no vision weights to poison"
            save_file(poisoned, tmp / f.name, metadata={"format": "pt"})

    return build_once(checkpoint.with_name(checkpoint.name + "-nan-vision"), build)


# -- what the tests show the model -------------------------------------------------------------


def sample_images() -> dict:
    """Images of different sizes and aspect ratios: stripes (grid 1x4x8, two attention windows),
    a disc (1x6x4, windows padded), a square (1x4x4), and checks of the stripes' size (so two
    images can trade rows)."""
    from PIL import Image, ImageDraw

    stripes = Image.new("RGB", (120, 48), (240, 240, 240))
    for x in range(0, 120, 24):
        ImageDraw.Draw(stripes).rectangle((x, 0, x + 11, 48), fill=(20, 120, 40))
    disc = Image.new("RGB", (64, 96), (30, 30, 200))
    ImageDraw.Draw(disc).ellipse((10, 20, 50, 70), fill=(250, 200, 0))
    square = Image.new("RGB", (56, 56), (200, 60, 60))
    ImageDraw.Draw(square).rectangle((8, 8, 30, 40), fill=(10, 10, 10))
    checks = Image.new("RGB", (120, 48), (250, 250, 250))
    for x in range(0, 120, 20):
        for y in range(0, 48, 16):
            if (x // 20 + y // 16) % 2:
                ImageDraw.Draw(checks).rectangle((x, y, x + 19, y + 15), fill=(90, 20, 160))
    return {"stripes": stripes, "disc": disc, "square": square, "checks": checks}


def png_base64(image) -> str:
    """An image as stock ``image_data`` takes it."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
