"""HF transformers as the reference for generated tokens (float32, greedy).

Random-weight test models have near-ties (top-2 logit gaps under 1e-3) that float rounding may
flip; ``assert_same_tokens`` compares token by token and tolerates a divergence only at a
position where the reference's own top-2 gap is that small (and stops comparing there, since the
two sequences legitimately differ afterwards).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

NEAR_TIE = 1e-3


@lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def embed_ids(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """The model's own embedding rows of ``ids`` ([n, hidden], float32)."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).float()


@torch.no_grad()
def greedy(model_dir: str | Path, inputs_embeds: torch.Tensor, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of HF ``generate(inputs_embeds=...)`` and the top-2 logit gap at each step."""
    model = hf_model(str(model_dir))
    out = model.generate(
        inputs_embeds=inputs_embeds.float().unsqueeze(0), attention_mask=torch.ones(1, inputs_embeds.shape[0], dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id,
    )
    tokens = out.sequences[0].tolist()[-len(out.scores):]
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return tokens, gaps


def assert_same_tokens(ours: list[int], ref: list[int], gaps: list[float], context: str = "") -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < NEAR_TIE, (
                f"{context}token {i} differs: ours {a} vs HF {b} (HF top-2 gap {gaps[i]:.2e}); "
                f"ours={ours} hf={ref}"
            )
            return
    assert len(ours) == len(ref), f"{context}lengths differ: ours={ours} hf={ref}"


def text_embeds(model_dir: str | Path, text: str, first: bool) -> torch.Tensor:
    """Embedding rows of ``text`` tokenized as sgl_embeds does (specials only on the first segment)."""
    tok = hf_tokenizer(str(model_dir))
    return embed_ids(model_dir, tok.encode(text, add_special_tokens=first))
