"""A tiny random-weight Florence-2 (``Florence2ForConditionalGeneration``) as transformers saves
it, with its ``Florence2Processor``, built once into ``models.py``'s cache with a fixed seed: a
four-stage DaViT on 128 px images (17 rows an image, the pooled row first) in front of a BART
(d_model 64, 2 + 2 layers, ``scale_embedding``), scaled up so that the image and the task change
HF's greedy answer. The tokenizer has ``<image>``, ``<loc_0>`` .. ``<loc_999>`` and the task tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer, BartConfig, CLIPImageProcessor, Florence2Config, Florence2ForConditionalGeneration,
    Florence2Processor, Florence2VisionConfig,
)

from sgl_embeds.serve import build_once
from sgl_embeds_testing.models import TINY_HIDDEN, cache_dir, train_tokenizer

FLORENCE2_CACHE_VERSION = "v2"  # v2: the processor lists its parse types
IMAGE_SIZE = 128
ROWS_PER_IMAGE = (IMAGE_SIZE // 32) ** 2 + 1  # the grid after a total stride of 32, and the pooled row
IMAGE_TOKEN = "<image>"
LOC_TOKENS = tuple(f"<loc_{i}>" for i in range(1000))
# the tokens Florence-2's post-processor parses besides the boxes
TASK_TOKENS = ("<od>", "</od>", "<ocr>", "</ocr>", "<poly>", "</poly>", "<sep>", "<region_cap>", "</region_cap>")
# (seed, language-model scale, token-embedding scale, learned-position scale, projector scale):
# picked in HF alone so that the greedy answers are varied and change with the image and with the
# task prompt (with the positions at the LM's scale the tied LM head repeats one token), and calm:
# a 1e-7 relative change of the image rows moves HF's chosen-token logprobs by 4.8e-7 (x24 without
# the position scale was as varied but moved them by 1.8e-4, over the logprob tolerance)
_INIT = (7, 6.0, 3.0, 150.0, 2.0)
MAX_POSITIONS = 256  # the encoder's and the decoder's learned positions (BART offsets them by 2)


TINY_TEXT = dict(d_model=TINY_HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 max_position_embeddings=MAX_POSITIONS, scale_embedding=True)
TINY_VISION = dict(embed_dim=[16, 32, 48, 64], num_heads=[2, 4, 4, 8], num_groups=[2, 4, 4, 8], depths=[1, 1, 1, 1],
                   window_size=2, projection_dim=TINY_HIDDEN)
# Florence-2-base's sizes (its config.json as the converted florence-community checkpoints and
# third-party readers of it write them; not read from the hub here): a BART of d_model 768, 6 + 6
# layers, 12 heads, vocabulary 51289, 1024 positions, behind a DaViT of four stages on 768 px
# images (577 rows an image)
PUBLISHED_BASE = ("microsoft/Florence-2-base", 768, dict(
    d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
    encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_position_embeddings=1024, scale_embedding=False,
    vocab_size=51289), dict(
    embed_dim=[128, 256, 512, 1024], num_heads=[4, 8, 16, 32], num_groups=[4, 8, 16, 32], depths=[1, 1, 9, 1],
    window_size=12, projection_dim=768))


def tiny_florence2_dir() -> Path:
    """A tiny random-weight ``Florence2ForConditionalGeneration`` (float32) with its processor."""
    return _florence2_dir(f"tiny-florence2-{FLORENCE2_CACHE_VERSION}", IMAGE_SIZE, TINY_TEXT, TINY_VISION, _INIT)


def published_florence2_dir() -> Path:
    """Florence-2-base at its published sizes (``PUBLISHED_BASE``), random weights at HF's init,
    float32, our tokenizer with the embeddings at the published vocabulary size (for
    ``benchmarks/florence2_repeat.py``: timings, not answers)."""
    _, image_size, text, vision = PUBLISHED_BASE
    return _florence2_dir(f"published-florence2_base-{FLORENCE2_CACHE_VERSION}", image_size, text, vision,
                          (0, 1.0, 1.0, 1.0, 1.0))


def _florence2_dir(name: str, image_size: int, text_size: dict, vision_size: dict,
                   init: tuple[int, float, float, float, float]) -> Path:
    """A random ``Florence2ForConditionalGeneration`` of these BART and DaViT settings (the
    vocabulary is our tokenizer's unless ``text_size`` says) with its processor; ``init``: as
    ``_INIT``'s."""

    def build(tmp: Path) -> None:
        train_tokenizer(tmp / "tokenizer", extra_specials=(IMAGE_TOKEN, *TASK_TOKENS))
        tok = AutoTokenizer.from_pretrained(tmp / "tokenizer", extra_special_tokens={"image_token": IMAGE_TOKEN})
        shutil.rmtree(tmp / "tokenizer")
        tok.add_tokens(list(LOC_TOKENS))
        tok.chat_template = None  # Florence-2 has none: its processor lays the prompt out
        image_processor = CLIPImageProcessor(
            size={"height": image_size, "width": image_size}, crop_size=None, do_center_crop=False,
            image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
        image_processor.image_seq_length = (image_size // 32) ** 2 + 1  # the grid, and the pooled row
        # every parse type the post-processor knows, as the published processors list them
        parse_types = ("ocr", "phrase_grounding", "pure_text", "description_with_bboxes", "description_with_polygons",
                       "polygons", "bboxes", "description_with_bboxes_or_polygons")
        processor = Florence2Processor(image_processor=image_processor, tokenizer=tok,
                                       post_processor_config={name: {} for name in parse_types})
        text = BartConfig(**{"vocab_size": len(tok), **text_size}, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          decoder_start_token_id=tok.eos_token_id, forced_bos_token_id=tok.bos_token_id,
                          forced_eos_token_id=tok.eos_token_id)
        vision = Florence2VisionConfig(**vision_size)
        config = Florence2Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                 image_token_id=tok.image_token_id)
        seed, lm_scale, embed_scale, position_scale, projector_scale = init
        torch.manual_seed(seed)
        model = Florence2ForConditionalGeneration(config).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "shared" in name or "embed_tokens" in name:
                    p.mul_(embed_scale)
                elif "embed_positions" in name:
                    p.mul_(position_scale)
                elif "language_model" in name and "norm" not in name:
                    p.mul_(lm_scale)
                elif "multi_modal_projector" in name and "norm" not in name:
                    p.mul_(projector_scale)
        model.generation_config.forced_bos_token_id = tok.bos_token_id
        model.generation_config.decoder_start_token_id = tok.eos_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)

    return build_once(cache_dir() / name, build)
