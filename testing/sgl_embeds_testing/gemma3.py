"""Tiny random-weight Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``, float32) as
transformers saves them, with their ``Gemma3Processor`` and a Gemma-3-style chat template.

Built once into ``models.py``'s cache with fixed seeds: a SigLIP tower on 32 px images (4x4
patches pooled to 4 rows an image), a Gemma 3 text model (hidden 64; sliding, sliding, full,
sliding layers; sliding window 8, shorter than every test prompt), scaled up from the default init
so that the image blocks change HF's answers. The tokenizer has Gemma 3's image and turn tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
    Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig,
)

from sgl_embeds.serve import build_once
from sgl_embeds_testing.hub_layout import publish_layout
from sgl_embeds_testing.models import (
    TINY_HIDDEN, _rename_to_model_layout, cache_dir, save_scaled_vlm, train_tokenizer,
)

GEMMA3_CACHE_VERSION = "v4"  # v4: the processor files laid out as published
IMAGE_SIZE, PATCH = 32, 8  # 4x4 patches
ROWS_PER_IMAGE = 4  # mm_tokens_per_image: the patches pooled 2x2
SLIDING_WINDOW = 8  # shorter than every test prompt; not shorter than an image's rows
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
TURN_START, TURN_END = "<start_of_turn>", "<end_of_turn>"
# A chat template in Gemma 3's shape: the bos, turns as <start_of_turn>{role}\n...<end_of_turn>\n
# (the assistant is "model"), an image part as <start_of_image>; a system turn's text opens the
# first user turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% set ns.system = (m['content'] if m['content'] is string else m['content'][0]['text']) + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# (seed, language-model weight scale, projector weight scale): picked so that the greedy answers
# are varied and change when the images are attended causally; the (tied) token embeddings keep
# the default init (``EMBED_SCALE``), as PaliGemma's tiny model does
_INIT = (4, 8.0, 2.0)
EMBED_SCALE = 1.0
PROJECTION_STD = 0.5  # the projector's matrix (zero at init): rows of about the text rows' size
LOGIT_SCALE = 8.0  # the final norm's gain (1 + weight): wider top-2 gaps (paligemma.py)
_PROJECTION = "multi_modal_projector.mm_input_projection_weight"
_PROJECTOR_NORM = "multi_modal_projector.mm_soft_emb_norm.weight"
_FINAL_NORM = "language_model.model.norm.weight"


# google/gemma-3-4b-it's config.json (the smallest Gemma 3 with images): the text model (five
# sliding layers to one full; linear rope x8 on the full layers) and the SigLIP tower at 896 px
PUBLISHED_4B = ("google/gemma-3-4b-it", dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
    max_position_embeddings=131072, rms_norm_eps=1e-6, vocab_size=262208,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    image_size=896, patch_size=14), 256)
# the language model x4 from HF's init, as the other published sizes (llava_next.PUBLISHED_INIT).
# That alone leaves a degenerate reference at 34 layers: HF's greedy answer repeats one token
# (208, the same for every image; measured in HF alone, docs/performance.md "Real sizes"). The
# image's rows are about 19 times the text rows' size and nearly alike (cosine 0.96 to their
# mean), so every later position reads one constant from them; and each sublayer adds a unit-size
# output (Gemma's norms after attention and MLP) to a stream that the current token's own
# embedding dominates. A projector 10 times smaller, the norms after attention and MLP at gain 8
# and the query and key norms at gain 2 give varied answers that change with the image and are
# not chaotic: a 1e-7 relative change of the image rows moves HF's first top-5 logprobs by
# 3.7e-5 (probed in HF alone; gains 4 and 4 vary too but move them by 0.096, so that two
# float32 implementations cannot agree within 1e-4; the projector, the post norms or the query
# and key norms alone still repeat a token)
PUBLISHED_INIT = (4, 4.0, 2.0)
PUBLISHED_PROJECTION_STD = 0.05
PUBLISHED_NORM_GAINS = {"post_attention_layernorm": 8.0, "post_feedforward_layernorm": 8.0,
                        "self_attn.q_norm": 2.0, "self_attn.k_norm": 2.0}


def tiny_gemma3_dir(layout: str = "saved") -> Path:
    """A tiny random-weight ``Gemma3ForConditionalGeneration`` (float32) with its processor
    (module docstring). ``layout``: as ``models.tiny_llava_dir``'s (``"saved"``: transformers'
    ``save_pretrained`` keys; ``"model"``: ``model.language_model.*``,
    ``model.vision_tower.vision_model.*``, ...)."""
    if layout not in ("saved", "model"):
        raise ValueError(f"layout must be 'saved' or 'model', got {layout!r}")
    text = dict(hidden_size=TINY_HIDDEN, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
                layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
                max_position_embeddings=1024)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    return _gemma3_dir(f"tiny-gemma3-{layout}-{GEMMA3_CACHE_VERSION}", layout, text, vision,
                       ROWS_PER_IMAGE, _INIT)


def published_gemma3_dir() -> Path:
    """Gemma 3 4B at its published sizes (``PUBLISHED_4B``), random weights (``PUBLISHED_INIT``),
    float32, our tokenizer with the embeddings at the published vocabulary size (for
    ``benchmarks/real_size.py``)."""
    _, text, vision, rows = PUBLISHED_4B
    return _gemma3_dir(f"published-gemma3_4b-{GEMMA3_CACHE_VERSION}-gains8-2", "saved", text, vision, rows,
                       PUBLISHED_INIT, PUBLISHED_PROJECTION_STD, PUBLISHED_NORM_GAINS)


def _gemma3_dir(name: str, layout: str, text_size: dict, vision_size: dict, rows_per_image: int,
                init: tuple[int, float, float], projection_std: float = PROJECTION_STD,
                norm_gains: dict[str, float] | None = None) -> Path:
    """A random ``Gemma3ForConditionalGeneration`` of these text and SigLIP settings (the vocabulary
    is our tokenizer's unless ``text_size`` says), ``rows_per_image`` soft tokens an image, with
    its processor; ``init``: as ``save_scaled_vlm``'s; ``norm_gains``: the gain (1 + weight) of
    the language model's norms whose names contain a key."""

    def build(tmp: Path) -> None:
        train_tokenizer(tmp / "tokenizer", extra_specials=(BOI, IMAGE, EOI, TURN_START, TURN_END))
        tok = AutoTokenizer.from_pretrained(tmp / "tokenizer", extra_special_tokens={
            "boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI})
        shutil.rmtree(tmp / "tokenizer")
        pixels = vision_size["image_size"]
        image_processor = Gemma3ImageProcessor(
            size={"height": pixels, "width": pixels}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                                    chat_template=CHAT_TEMPLATE, image_seq_length=rows_per_image)
        text = Gemma3TextConfig(**{"vocab_size": len(tok), **text_size},
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
        vision = SiglipVisionConfig(**vision_size, vision_use_head=False)
        config = Gemma3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(),
            mm_tokens_per_image=rows_per_image, boi_token_index=tok.boi_token_id,
            eoi_token_index=tok.convert_tokens_to_ids(EOI), image_token_index=tok.image_token_id)
        save_scaled_vlm(Gemma3ForConditionalGeneration, config, init, tmp, embed_scale=EMBED_SCALE)
        weights = load_file(str(tmp / "model.safetensors"))
        torch.manual_seed(init[0])
        weights[_PROJECTION] = torch.randn_like(weights[_PROJECTION]) * projection_std
        weights[_PROJECTOR_NORM] = torch.randn_like(weights[_PROJECTOR_NORM]) * 0.5  # zero at init
        weights[_FINAL_NORM] += LOGIT_SCALE - 1.0
        for key in weights:
            gain = next((g for part, g in (norm_gains or {}).items()
                         if key.startswith("language_model.") and part in key), None)
            if gain is not None:
                weights[key] += gain - 1.0
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        processor.save_pretrained(tmp)
        publish_layout(tmp, "gemma3")
        if layout == "model":
            _rename_to_model_layout(tmp)

    return build_once(cache_dir() / name, build)
