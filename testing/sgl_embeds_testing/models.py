"""Models without a hub: tiny random-weight Llama / Qwen2 / LLaVA test models.

Everything is built once into a cache directory (``$SGLANG_EMBEDS_CACHE`` or ``.cache/`` at the
repository root) with fixed seeds, and reused by tests, examples and benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM, CLIPImageProcessor, CLIPVisionConfig, Gemma3TextConfig, LlamaConfig, LlavaConfig,
    LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast, Qwen2Config,
)

from sgl_embeds.serve import build_once
from sgl_embeds_protocol.environment import setting
from sgl_embeds_testing.hub_layout import publish_layout

CACHE_VERSION = "v1"
LLAVA_CACHE_VERSION = "v3"  # v3: the processor files laid out as published
TINY_VOCAB = 512
TINY_HIDDEN = 64  # the tiny language models' width
_CORPUS_WORDS = (
    "the a an red green blue small large quick lazy fox dog cat bird image picture photo shows "
    "contains left right top bottom corner center person car tree house sky water road what is "
    "color of describe briefly answer question yes no one two three four five there are and "
    "with on in at near under above behind this that it very bright dark light object region"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    root = setting("SGLANG_EMBEDS_CACHE")
    path = Path(root) if root else Path(__file__).resolve().parents[2] / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def train_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB, extra_specials: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on a synthetic corpus, with BOS/EOS and a chat template
    (``extra_specials``: more special tokens, e.g. a VLM's image token)."""
    gen = torch.Generator().manual_seed(0)
    words = _CORPUS_WORDS
    lines = []
    for _ in range(2000):
        idx = torch.randint(len(words), (int(torch.randint(4, 16, (1,), generator=gen)),), generator=gen)
        lines.append(" ".join(words[i] for i in idx.tolist()) + ".")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", *extra_specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *extra_specials],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _tiny_config(arch: str, vocab: int, hidden_size: int = TINY_HIDDEN):
    common = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=16)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma3":  # sliding-window and full layers; a window shorter than the test prompts
        return Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=16, sliding_window=GEMMA3_WINDOW,
                                layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                                hidden_activation="gelu_pytorch_tanh")
    raise ValueError(f"unknown tiny architecture {arch!r}: use 'llama', 'qwen2' or 'gemma3'")


GEMMA3_WINDOW = 8  # the tiny Gemma 3's sliding window


def tiny_model_dir(arch: str = "llama") -> Path:
    """A tiny random-weight model (hidden 64, 2 layers) saved as an ordinary HF directory.

    Weights are scaled x3 from the default init: at std 0.02 such models repeat one token, which
    would make equality tests against HF nearly vacuous.
    """

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp)
        config = _tiny_config(arch, len(tok))
        torch.manual_seed(1234 if arch == "llama" else 4321)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(3.0)
        model.generation_config.eos_token_id = 1
        model.save_pretrained(tmp, safe_serialization=True)

    return build_once(cache_dir() / f"tiny-{arch}-{CACHE_VERSION}", build)


def wide_model_dir(hidden_size: int = 4096) -> Path:
    """A one-layer Llama as wide as a 7B VLM's language model (hidden 4096) with the tiny
    vocabulary, for benchmarks of real span sizes where the model's own work should stay small.
    Its weights are bfloat16 values stored as float32, so bfloat16 span rows taken from its
    embedding table are exactly those rows."""

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp)
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=1024, num_hidden_layers=1,
            num_attention_heads=hidden_size // 128, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=8192, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            tie_word_embeddings=False, torch_dtype="float32")
        torch.manual_seed(4096)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        model.generation_config.eos_token_id = 1
        model.save_pretrained(tmp, safe_serialization=True)

    return build_once(cache_dir() / f"wide-llama-{hidden_size}-{CACHE_VERSION}", build)


# A LLaVA prompt format (as llava-1.5 checkpoints use), for the tiny VLM's processor.
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] != 'user' %}</s>{% endif %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
TINY_IMAGE_SIZE, TINY_PATCH = 32, 8
# arch -> (seed, language-model weight scale, projector weight scale)
_LLAVA_INIT = {"llama": (2024, 4.0, 2.0), "qwen2": (1, 4.0, 2.0)}


def tiny_llava_dir(arch: str = "llama", layout: str = "saved") -> Path:
    """A tiny random-weight ``LlavaForConditionalGeneration`` checkpoint with its ``LlavaProcessor``.

    CLIP tower (hidden 32, 3 layers, QuickGELU, 32x32 pixels in 8x8 patches: 16 rows per image
    with the "default" strategy), GELU MLP projector, and the tiny ``arch`` language model.
    ``layout="saved"`` keeps the keys as transformers 5.19 ``save_pretrained`` writes them
    (``language_model.model.*``, ``vision_tower.*``); ``"model"`` renames them to the layout of
    the in-memory modules (``model.language_model.*``, ``model.vision_tower.vision_model.*``,
    ``lm_head.*``), which transformers also loads. The language model
    and the projector are scaled up (see ``tiny_model_dir``) so that the image changes the answer
    (seeds and scales picked so that the parity tests' greedy answers of 10 tokens are varied).
    """
    if layout not in ("saved", "model"):
        raise ValueError(f"layout must be 'saved' or 'model', got {layout!r}")

    def build(tmp: Path) -> None:
        tok = train_tokenizer(tmp, extra_specials=("<image>",))
        vision = CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=TINY_IMAGE_SIZE, patch_size=TINY_PATCH, hidden_act="quick_gelu", projection_dim=32,
        )
        config = LlavaConfig(
            vision_config=vision.to_dict(), text_config=_tiny_config(arch, len(tok)).to_dict(),
            image_token_index=tok.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
            vision_feature_layer=-2, vision_feature_select_strategy="default",
        )
        save_scaled_vlm(LlavaForConditionalGeneration, config, _LLAVA_INIT[arch], tmp)
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(
                size={"shortest_edge": TINY_IMAGE_SIZE}, crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}),
            tokenizer=tok, patch_size=TINY_PATCH, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE,
        )
        processor.save_pretrained(tmp)
        publish_layout(tmp, "llava")
        if layout == "model":
            _rename_to_model_layout(tmp)

    return build_once(cache_dir() / f"tiny-llava-{arch}-{layout}-{LLAVA_CACHE_VERSION}", build)


def save_scaled_vlm(model_class, config, init: tuple[int, float, float], out: Path,
                    embed_scale: float | None = None) -> None:
    """Save a random ``model_class(config)`` (a LLaVA-style VLM) to ``out``, its language model
    and projector scaled up; ``init``: (seed, language-model scale, projector scale).
    ``embed_scale``: the language model's token embeddings scaled by this instead (with tied
    embeddings, embeddings as large as the layers' weights make the LM head repeat a token)."""
    seed, lm_scale, projector_scale = init
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or name.startswith("lm_head"):
                if embed_scale is not None and "embed_tokens" in name:
                    p.mul_(embed_scale)
                elif "norm" not in name:
                    p.mul_(lm_scale)
            elif "multi_modal_projector" in name:
                p.mul_(projector_scale)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out, safe_serialization=True)


def _rename_to_model_layout(directory: Path) -> None:
    """Rewrite a saved LLaVA checkpoint's keys in the module layout (``model.language_model.*``,
    ``model.vision_tower.vision_model.*``, ``model.multi_modal_projector.*``, ``lm_head.*``)."""
    path = directory / "model.safetensors"
    renamed = {}
    for key, value in load_file(str(path)).items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith("language_model.lm_head."):
            key = key[len("language_model."):]
        elif key.startswith("vision_tower."):
            key = "model.vision_tower.vision_model." + key[len("vision_tower."):]
        else:
            key = "model." + key
        renamed[key] = value.contiguous()
    save_file(renamed, str(path), metadata={"format": "pt"})
