"""HF's greedy decoding held to a regex, as SGLang's grammar backend holds a request's: the
reference for ``sgl.gen(regex=...)`` on PaliGemma (tests/vlm/test_paligemma_programs.py, the
notebook examples/09_paligemma_detect_and_ask.ipynb).

Each step allows the tokens whose text keeps the answer a prefix of a match (``regex``'s partial
matching) and the end token only once the answer is a full match; HF's ``generate`` takes the
argmax of the allowed ones (``prefix_allowed_tokens_fn``).
"""

from __future__ import annotations

from pathlib import Path

import regex
import torch
from PIL import Image

from sgl_embeds_testing import reference as ref


@torch.no_grad()
def paligemma_constrained(checkpoint: str | Path, prompt: str, image: Image.Image, pattern: str,
                          max_new_tokens: int, prefix: list[int] = ()) -> ref.Greedy:
    """HF's greedy answer of the checkpoint's PaliGemma (float32) to ``prompt`` about ``image``
    after ``prefix``, held to ``pattern`` (module docstring). The gaps and runner-ups are those of
    the allowed tokens, for ``ref.check_greedy``."""
    model, processor = ref.hf_paligemma(str(checkpoint))
    tok = processor.tokenizer
    pieces = [tok.decode([t]) for t in range(len(tok))]
    compiled, eos = regex.compile(pattern), ref.eos_ids(model)
    inputs = ref.paligemma_inputs(checkpoint, prompt, [image])
    inputs.pop("labels", None)
    start = inputs["input_ids"].shape[1]
    if prefix:
        extra = torch.tensor([list(prefix)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.ones_like(extra)], dim=1)

    def allowed(_batch: int, ids: torch.Tensor) -> list[int]:
        text = tok.decode(ids[start:].tolist())
        out = [t for t, piece in enumerate(pieces) if t not in eos and piece
               and compiled.fullmatch(text + piece, partial=True)]
        return out + sorted(eos) * bool(compiled.fullmatch(text))

    out = model.generate(**inputs, max_new_tokens=max_new_tokens - len(prefix), do_sample=False,
                         prefix_allowed_tokens_fn=allowed, output_scores=True,
                         return_dict_in_generate=True,
                         pad_token_id=model.config.text_config.pad_token_id)
    tokens = out.sequences[0, -len(out.scores):].tolist()
    top2 = [s[0].topk(2) for s in out.scores]
    return ref.Greedy(tokens, [int(t.indices[1]) for t in top2],
                      [float(t.values[0] - t.values[1]) for t in top2])
