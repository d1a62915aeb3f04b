"""``python -m sgl_embeds.demo``: a real trained model answers questions about a span.

The span is the embedding rows of a short description, fed as precomputed embeddings (the
model never sees the description as text). A second question about the same span shows the
cache hit: its prefill skips the whole span.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import sglang as sgl
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

import sgl_embeds  # noqa: F401  (installs sgl.embeds)
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.testing.models import demo_model_dir
from sgl_embeds.testing.server import Server

DESCRIPTION = "A red bicycle with a wicker basket is parked next to a blue door."
QUESTIONS = ["What color is the bicycle?", "What is next to the bicycle?"]


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
    with Server(model_dir) as server:
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
