"""HF transformers as the reference for generated tokens (float32, greedy), and the one rule for
how exactly our numbers must equal HF's (docs/reliability.md, "How exact").

Bit equality (``assert_same_rows``) where the same operations run on the same shapes; a stated
tolerance where batching or order differ: rows within ``ROW_TOL`` (``assert_rows_close``),
logprobs within ``LOGPROB_TOL``, tokens under ``check_greedy``'s counted near-tie rule.
``assert_matches_hf`` applies it to a prompt of embeddings and checks that the reference is not
degenerate; ``assert_response_logprobs`` reads a response's logprobs in full.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Collection, Iterator

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from transformers.modeling_outputs import BaseModelOutputWithPooling

from sgl_embeds.vlm.checkpoint import load_split_llm
from sgl_embeds_protocol.split_weights import renamed, weight_names

NEAR_TIE = 1e-3
# Every near-tie forgiven since the last reset, by context: tests/conftest.py resets it before each
# test and fails a test that forgave more than one, whatever number of sequences it compared.
FORGIVEN: list[str] = []


@dataclass
class Greedy:
    """HF's greedy continuation: its tokens, and at each step the runner-up, the top-2 gap and the
    chosen token's logprob (log-softmax of the logits)."""

    tokens: list[int]
    runner_ups: list[int]
    gaps: list[float]
    logprobs: list[float] = field(default_factory=list)
    # each step's whole log-softmax (float64), for comparing top-k maps
    distributions: list[torch.Tensor] = field(default_factory=list, repr=False)


def _greedy_from_scores(sequences: torch.Tensor, scores: tuple) -> Greedy:
    tokens = sequences[0].tolist()[-len(scores):]
    top2 = [s[0].float().topk(2) for s in scores]
    distributions = [s[0].double().log_softmax(-1) for s in scores]
    logprobs = [float(d[t]) for d, t in zip(distributions, tokens)]
    return Greedy(tokens, [int(t.indices[1]) for t in top2], [float(t.values[0] - t.values[1]) for t in top2],
                  logprobs, distributions)


@lru_cache(maxsize=4)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """The causal LM in ``model_dir``; a split LLM's weights read where ``split`` left them."""
    return load_split_llm(model_dir, dtype=dtype).eval()


def split_llm_weights(llm_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors the split LLM in ``llm_dir`` loads, by its names, from its linked files."""
    names = weight_names(llm_dir)
    assert names is not None, f"{llm_dir} is not a split LLM"
    files = sorted(Path(llm_dir).glob("*.safetensors"))
    stored = ((key, tensor) for f in files for key, tensor in load_file(str(f)).items())
    return dict(renamed(stored, names, str(llm_dir)))


@lru_cache(maxsize=4)
def hf_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def embed_ids(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """The model's own embedding rows of ``ids`` ([n, hidden], float32)."""
    model = hf_model(str(model_dir))
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).float()


@torch.no_grad()
def greedy_after(model_dir: str | Path, inputs_embeds: torch.Tensor, max_new_tokens: int, prefix: list[int] = (),
                 dtype: torch.dtype = torch.float32, blocks: Collection[tuple[int, int]] = ()) -> Greedy:
    """HF's greedy continuation of ``inputs_embeds`` followed by the tokens ``prefix``, with the
    model in ``dtype``; ``blocks``: ``[start, end)`` ranges of the prompt attended both ways
    (``greedy_with_blocks``)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    if blocks:
        return greedy_with_blocks(model_dir, inputs_embeds, max_new_tokens, blocks, prefix)
    if prefix:
        inputs_embeds = torch.cat([inputs_embeds.float(), embed_ids(model_dir, list(prefix))])
    model = hf_model(str(model_dir), dtype)
    out = model.generate(
        inputs_embeds=inputs_embeds.to(dtype).unsqueeze(0), attention_mask=torch.ones(1, inputs_embeds.shape[0], dtype=torch.long),
        max_new_tokens=max_new_tokens - len(prefix), do_sample=False, output_scores=True, return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id,
    )
    return _greedy_from_scores(out.sequences, out.scores)


def block_mask(n: int, blocks: Collection[tuple[int, int]], window: int | None = None) -> torch.Tensor:
    """``[1, 1, n, n]`` bool (True: attends): causal (within HF's sliding ``window``: ``q - k <
    window``), then each block's positions seeing the whole block."""
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if window is not None:
        allowed &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
    for start, end in blocks:
        allowed[start:end, start:end] = True
    return allowed[None, None]


def block_masks(model, n: int, blocks: Collection[tuple[int, int]]) -> torch.Tensor | dict:
    """The 4-D mask ``model`` takes for a prompt of ``n`` with ``blocks``: per layer type where
    it has sliding-window layers (each window with the blocks over it, HF's order)."""
    config = model.config
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return block_mask(n, blocks)
    return {"full_attention": block_mask(n, blocks),
            "sliding_attention": block_mask(n, blocks, config.sliding_window)}


@torch.no_grad()
def greedy_with_blocks(model_dir: str | Path, inputs_embeds: torch.Tensor, max_new_tokens: int,
                       blocks: Collection[tuple[int, int]], prefix: list[int] = ()) -> Greedy:
    """HF's greedy continuation of a prompt whose ``blocks`` attend both ways: the prompt runs once
    with that 4-D mask (``block_mask``), then each new token attends its cache causally, in
    float32; the tokens ``prefix`` are forced first."""
    model = hf_model(str(model_dir))
    eos = eos_ids(model)
    out = model(inputs_embeds=inputs_embeds.float()[None], attention_mask=block_masks(model, inputs_embeds.shape[0], blocks),
                use_cache=True)
    tokens, scores = [], []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1]
        token = list(prefix)[step] if step < len(prefix) else int(logits[0].argmax())
        if step >= len(prefix):
            scores.append(logits)
        tokens.append(token)
        if token in eos and step >= len(prefix):
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return _greedy_from_scores(torch.tensor([tokens]), tuple(scores))


def assert_matches_hf(ours: list[int] | dict, model_dir: str | Path, inputs_embeds: torch.Tensor,
                      max_new_tokens: int, context: str = "", other_span_embeds: torch.Tensor | None = None,
                      dtype: torch.dtype = torch.float32, near_tie: float = NEAR_TIE,
                      logprob_start_len: int = 0, blocks: Collection[tuple[int, int]] = ()) -> Greedy:
    """Our greedy tokens equal HF ``generate(inputs_embeds=...)`` under ``check_greedy``'s rule;
    the reference must not be degenerate, and (given ``other_span_embeds``, the same prompt with
    a different span) must change with the span. Returns HF's reference.

    ``ours``: the output ids, or a ``/generate`` response sent with ``return_logprob``, whose
    numbers are then compared too (``assert_response_logprobs``; its input logprobs, when it has
    them, by ``assert_input_logprobs`` from ``logprob_start_len``, the position the request asked
    them from). ``blocks``: ranges of the prompt HF attends both ways (``greedy_with_blocks``)."""
    tokens = ours["output_ids"] if isinstance(ours, dict) else ours
    reference = greedy_after(model_dir, inputs_embeds, max_new_tokens, dtype=dtype, blocks=blocks)
    if other_span_embeds is None:
        assert_not_degenerate(reference.tokens, context, min_distinct=3)
    else:
        other = greedy_after(model_dir, other_span_embeds, max_new_tokens, dtype=dtype, blocks=blocks).tokens
        assert other != reference.tokens, f"{context}the span does not change HF's output: {other}"
    check_greedy(tokens, lambda prefix: greedy_after(model_dir, inputs_embeds, max_new_tokens, prefix, dtype, blocks),
                 context, near_tie, eos_ids(hf_model(str(model_dir))))
    if isinstance(ours, dict):
        tol = LOGPROB_TOL if dtype == torch.float32 else BF16_LOGPROB_TOL
        assert_response_logprobs(ours, reference, context, tol)
        if ours["meta_info"].get("input_token_logprobs"):  # sent with a logprob_start_len
            assert_input_logprobs(ours, model_dir, inputs_embeds, context, tol, dtype, logprob_start_len, blocks)
    return reference


def eos_ids(model) -> set[int]:
    """The end tokens HF's ``generate`` stops on for ``model``."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def text_embeds(model_dir: str | Path, text: str, first: bool) -> torch.Tensor:
    """Embedding rows of ``text`` tokenized as sgl_embeds does (specials only on the first segment)."""
    tok = hf_tokenizer(str(model_dir))
    return embed_ids(model_dir, tok.encode(text, add_special_tokens=first))


def prompt_embeds(model_dir: str | Path, parts: list) -> torch.Tensor:
    """The embedding rows the model sees for a prompt of str / tensor parts, in order."""
    rows = [text_embeds(model_dir, part, first=(i == 0)) if isinstance(part, str) else part.float()
            for i, part in enumerate(parts)]
    return torch.cat(rows)


# -- the comparison ---------------------------------------------------------------------------


def check_greedy(ours: list[int], continue_from: Callable[[list[int]], Greedy], context: str = "",
                 near_tie: float = NEAR_TIE, eos_ids: Collection[int] = ()) -> int:
    """Compare our greedy tokens with HF's; returns the number of forgiven near-ties.

    ``continue_from(prefix)`` is HF's greedy continuation after ``prefix`` (our tokens so far). A
    divergence is forgiven only where HF's top-2 gap is under ``NEAR_TIE`` *and* our token is HF's
    runner-up, never at the first token, and at most once; after it HF is re-run from our prefix
    so the rest of the sequence is still compared. Our run ending where HF's runner-up is an end
    token (``eos_ids``) is such a divergence too: we took the end token, whether or not our
    output lists it."""
    forgiven, ref, j = 0, continue_from([]), 0

    def forgive(i: int, token: int | None) -> None:
        nonlocal forgiven
        tie = ref.gaps[j] < near_tie and (token == ref.runner_ups[j] or token is None and ref.runner_ups[j] in eos_ids)
        ours_text = "the end of our output" if token is None else f"ours {token}"
        assert tie and i > 0 and forgiven == 0, (
            f"{context}token {i} differs: {ours_text} vs HF {ref.tokens[j]} (HF runner-up "
            f"{ref.runner_ups[j]}, top-2 gap {ref.gaps[j]:.2e}, forgiven so far {forgiven}); ours={ours}")
        forgiven += 1
        FORGIVEN.append(f"{context}token {i}")

    for i, token in enumerate(ours):
        assert j < len(ref.tokens), f"{context}HF stopped after {i} tokens, we did not: ours={ours}"
        if token != ref.tokens[j]:
            forgive(i, token)
            if token in eos_ids:
                return forgiven  # our run ended on the end token HF ranked second
            ref, j = continue_from(ours[: i + 1]), 0
            continue
        j += 1
    if j < len(ref.tokens):
        assert eos_ids, f"{context}we stopped after {len(ours)} tokens, HF did not: ours={ours}"
        forgive(len(ours), None)
    return forgiven


# rows of the same model computed in another batching or order: seen <= 3e-8 (AVX2 vs AVX-512
# GEMMs, LLaVA-NeXT tiles batched by HF); a wrong layer or projector moves them by > 1e-2
ROW_TOL = 1e-6
# the top-k maps a compared response asks for (``top_logprobs_num``: tests/helpers.py)
TOP_K = 3
LOGPROB_TOL = 1e-4  # float32 both sides: seen <= 5e-7 (tiny Qwen2.5-VL); the rows x1.01 move them 4.4e-4
BF16_LOGPROB_TOL = 0.1  # bfloat16 both sides (different kernels): only a gross error shows


def assert_logprobs_match(tokens: list[int], logprobs: list[float], reference: Greedy, context: str = "",
                          tol: float = LOGPROB_TOL) -> int:
    """Our output tokens' logprobs equal HF's within ``tol`` up to the first token where our run
    left HF's (a forgiven near-tie); returns how many were compared."""
    n = 0
    while n < min(len(tokens), len(reference.tokens)) and tokens[n] == reference.tokens[n]:
        n += 1
    assert n > 0, f"{context}no logprobs to compare"
    assert len(logprobs) == len(tokens), f"{context}{len(logprobs)} logprobs for {len(tokens)} tokens"
    ours = logprobs
    worst = max(abs(a - b) for a, b in zip(ours[:n], reference.logprobs[:n]))
    assert worst <= tol, (f"{context}logprobs differ from HF's by up to {worst:.2e} (tolerance {tol:.0e}): "
                          f"ours {[round(x, 4) for x in ours[:n]]} vs HF {[round(x, 4) for x in reference.logprobs[:n]]}")
    return n


def assert_response_logprobs(out: dict, reference: Greedy, context: str = "", tol: float = LOGPROB_TOL,
                             top_k: int = TOP_K) -> int:
    """A ``/generate`` response's output-token logprobs (and its top-k maps, when it has them)
    equal HF's log-softmax at the same steps within ``tol``, up to the first divergence; each
    entry names its output token; a top-k map, one per token, holds ``top_k`` distinct tokens,
    HF's top-k (order free where values tie within ``tol``)."""
    meta = out["meta_info"]
    assert meta.get("output_token_logprobs"), f"{context}send return_logprob to compare numbers"
    tokens, entries = out["output_ids"], meta["output_token_logprobs"]
    assert [token for _, token, _ in entries] == tokens[:len(entries)], (
        f"{context}the logprob entries name tokens {[token for _, token, _ in entries]}, the output is {tokens}")
    n = assert_logprobs_match(tokens, [lp for lp, _, _ in entries], reference, context, tol)
    maps = meta.get("output_top_logprobs") or []
    if any(maps):  # asked for (top_logprobs_num)
        assert len(maps) == len(tokens), f"{context}{len(maps)} top-k maps for {len(tokens)} tokens"
        sizes = [len({token for _, token, _ in top}) for top in maps]
        assert sizes == [top_k] * len(maps), f"{context}top-k maps of {sizes} distinct tokens, {top_k} asked"
    for step, top in enumerate(maps[:n]):
        hf = reference.distributions[step]
        ours = {token: lp for lp, token, _ in top}
        for token, lp in ours.items():
            assert abs(lp - float(hf[token])) <= tol, (
                f"{context}step {step}: top-k logprob of token {token} is {lp:.5f}, HF's {float(hf[token]):.5f}")
        kth = float(hf.topk(len(ours)).values[-1])
        missing = [int(t) for t in hf.topk(len(ours)).indices if int(t) not in ours and float(hf[t]) > kth + tol]
        assert not missing, f"{context}step {step}: HF's top-{len(ours)} tokens {missing} are not in ours {sorted(ours)}"
    return n


@torch.no_grad()
def assert_input_logprobs(out: dict, model_dir: str | Path, inputs_embeds: torch.Tensor, context: str = "",
                          tol: float = LOGPROB_TOL, dtype: torch.dtype = torch.float32,
                          logprob_start_len: int = 0, blocks: Collection[tuple[int, int]] = ()) -> int:
    """The response's input logprobs, entry ``j`` at prompt position ``logprob_start_len + j``:
    at every text position but the start (a row of the prompt that is a token's embedding, found
    here from the rows, not from the response) an entry naming that token, its logprob HF's
    log-softmax of the prompt's forward at the position before within ``tol``; at a span row
    ``[None, None, None]``; ``blocks``: ranges the forward attends both ways. Returns how many were
    compared."""
    entries, n = out["meta_info"]["input_token_logprobs"], inputs_embeds.shape[0]
    assert len(entries) == n - logprob_start_len, (
        f"{context}{len(entries)} input logprobs from position {logprob_start_len} of {n}")
    masked = {"attention_mask": block_masks(hf_model(str(model_dir), dtype), n, blocks)} if blocks else {}
    logits = hf_model(str(model_dir), dtype)(inputs_embeds=inputs_embeds.to(dtype).unsqueeze(0), **masked).logits[0]
    distributions = logits.double().log_softmax(-1)
    table = hf_model(str(model_dir)).get_input_embeddings().weight.float()
    compared = 0
    for i, (lp, token, _) in enumerate(entries, start=logprob_start_len):
        row = inputs_embeds[i].float()
        if token is None:
            assert lp is None and not (table == row).all(-1).any(), (
                f"{context}input position {i}: a null entry ({lp}) at a text position")
            continue
        assert torch.equal(table[token], row), f"{context}input position {i}: entry of token {token}, not this row's"
        if i == logprob_start_len:
            continue  # SGLang gives the first entry no logprob (at 0, there is no position before it)
        assert lp is not None, f"{context}input position {i} (token {token}): no logprob"
        hf = float(distributions[i - 1][token])
        assert abs(lp - hf) <= tol, f"{context}input position {i} (token {token}): logprob {lp:.5f}, HF's {hf:.5f}"
        compared += 1
    return compared  # 0 for a prompt of span rows only


def assert_vlm_matches_hf(out: dict, greedy: Callable[..., Greedy], eos: Collection[int], context: str,
                          min_compared: int, min_distinct: int = 3) -> Greedy:
    """A response about images vs HF's VLM on the pixels: ``greedy(prefix=())`` is HF's greedy
    continuation; our tokens under ``check_greedy``'s rule (at least ``min_compared`` of them),
    then their logprobs and top-k maps (``assert_response_logprobs``). Returns HF's reference."""
    ours = out["output_ids"]
    reference = greedy()
    assert_not_degenerate(reference.tokens, context, min_distinct)
    forgiven = check_greedy(ours, greedy, context, eos_ids=eos)
    assert len(ours) >= min_compared, f"{context}only {len(ours)} tokens compared"
    n = assert_response_logprobs(out, reference, context)
    print(f"{context}{len(ours)} tokens equal HF's ({forgiven} near-tie(s) forgiven), "
          f"{n} logprobs within {LOGPROB_TOL:.0e}")
    return reference


def assert_same_rows(ours: torch.Tensor, theirs: torch.Tensor, context: str = "") -> None:
    """Equal to the bit: only for the same operations on the same shapes (see the module's rule)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (context, ours.dtype, ours.shape, theirs.shape)
    assert torch.equal(ours, theirs), f"{context}: max difference {(ours - theirs).abs().max():.3g}"


def assert_rows_close(ours: torch.Tensor, theirs: torch.Tensor, context: str = "", tol: float = ROW_TOL) -> None:
    """Within ``tol`` of the larger of 1 and the rows' largest magnitude: for the same rows computed
    in another batching or order (see the module's rule)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (context, ours.dtype, ours.shape, theirs.shape)
    worst = float((ours.double() - theirs.double()).abs().max()) if ours.numel() else 0.0
    bound = tol * max(1.0, float(theirs.abs().max()) if theirs.numel() else 0.0)
    assert worst <= bound, f"{context}: max difference {worst:.3g} over the tolerance {bound:.1g}"


def assert_not_degenerate(tokens: list[int], context: str = "", min_distinct: int = 3) -> None:
    """A reference of one repeated token would make an equality check nearly vacuous."""
    assert len(set(tokens)) >= min_distinct, f"{context}reference output is degenerate: {tokens}"


# -- HF LLaVA as the reference for the vision path -------------------------------------------
# One reference for the three families split can split: LLaVA-1.5 (LlavaForConditionalGeneration),
# LLaVA-NeXT and LLaVA-OneVision (their processors also give image_sizes, which generate takes).


@lru_cache(maxsize=4)
def hf_llava(checkpoint: str):
    """HF's model (the checkpoint's own class: LLaVA-1.5, -NeXT or -OneVision) and processor."""
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def llava_inputs(checkpoint: str | Path, text: str, images: list) -> dict:
    """What HF's LLaVA processor builds for ``text`` (with one image token per image; the images
    as a flat list, so each one is tiled on its own by the any-resolution families)."""
    _, processor = hf_llava(str(checkpoint))
    return dict(processor(images=images or None, text=text, return_tensors="pt"))


@torch.no_grad()
def llava_greedy(checkpoint: str | Path, text: str, images: list, max_new_tokens: int,
                 prefix: list[int] = ()) -> Greedy:
    """HF ``generate`` of the checkpoint's LLaVA class (float32, greedy) after ``text`` +
    ``prefix``, with the processor's ``pixel_values`` (and ``image_sizes``)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    model, _ = hf_llava(str(checkpoint))
    inputs = llava_inputs(checkpoint, text, images)
    if prefix:
        extra = torch.tensor([list(prefix)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    out = model.generate(**inputs, max_new_tokens=max_new_tokens - len(prefix), do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=model.config.text_config.pad_token_id)
    return _greedy_from_scores(out.sequences, out.scores)


@contextlib.contextmanager
def at_most_one_forgiven_near_tie() -> Iterator[None]:
    """The comparisons inside may forgive one near-tie against HF in all the sequences they
    compare, not one each (a test's whole body, or a tutorial's cell)."""
    FORGIVEN.clear()
    yield
    assert len(FORGIVEN) <= 1, f"more than one near-tie forgiven: {FORGIVEN}"


@pytest.fixture(autouse=True)
def at_most_one_forgiven_near_tie_per_test():
    """Imported by tests/conftest.py and gpu/conftest.py."""
    with at_most_one_forgiven_near_tie():
        yield


# -- HF PaliGemma as the reference for a prefix LM --------------------------------------------
# PaliGemma attends its whole prompt (image rows, bos, text, newline) as one bidirectional block
# and what it generates causally (token_type_ids 0 for the prompt, as its processor gives them).
# Eager attention throughout: SDPA leaves out Gemma2's attention soft-capping.


@lru_cache(maxsize=4)
def hf_paligemma(checkpoint: str):
    """HF's ``PaliGemmaForConditionalGeneration`` (float32, eager attention) and processor."""
    model = AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def paligemma_inputs(checkpoint: str | Path, prompt: str, images: list) -> dict:
    """What HF's processor builds for ``prompt`` about ``images``: the image tokens, bos,
    ``prompt``, a newline (``input_ids``), ``token_type_ids`` all 0 (one block), the pixels."""
    _, processor = hf_paligemma(str(checkpoint))
    text = processor.image_token * len(images) + prompt
    return dict(processor(images=images, text=text, return_tensors="pt"))


@torch.no_grad()
def paligemma_greedy(checkpoint: str | Path, prompt: str, images: list, max_new_tokens: int,
                     prefix: list[int] = (), causal: bool = False) -> Greedy:
    """HF ``generate`` of the checkpoint's PaliGemma (float32, greedy) after ``prompt`` about
    ``images`` and then ``prefix`` (tokens generated before: causal, as in HF's generation).
    ``causal=True``: the prompt attended causally instead of as one block (no token_type_ids)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    inputs = paligemma_inputs(checkpoint, prompt, images)
    inputs.pop("labels", None)
    # tokens generated before are the suffix (type 1): causal, as in HF's generation
    return _typed_greedy(hf_paligemma(str(checkpoint))[0], inputs, max_new_tokens, prefix, 1, causal)


def _typed_greedy(model, inputs: dict, max_new_tokens: int, prefix: list[int], prefix_type: int,
                  drop_types: bool) -> Greedy:
    """HF ``generate`` (greedy) of a VLM that masks by ``token_type_ids``: ``inputs`` as its
    processor built them, then the tokens ``prefix`` forced, of token type ``prefix_type``;
    ``drop_types``: without ``token_type_ids`` (every position causal)."""
    if prefix:
        extra = torch.tensor([list(prefix)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.full_like(extra, prefix_type)], dim=1)
    if drop_types:
        del inputs["token_type_ids"]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens - len(prefix), do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=model.config.text_config.pad_token_id)
    return _greedy_from_scores(out.sequences, out.scores)


@lru_cache(maxsize=4)
def hf_eager_model(model_dir: str):
    """``hf_model``'s causal LM with eager attention (float32): for custom 4-D masks."""
    return load_split_llm(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def prefix_lm_mask(length: int, block: int) -> torch.Tensor:
    """``[1, 1, length, length]`` additive mask: positions ``< block`` attend to each other both
    ways (the prompt, one block); the rest causally, to the block and what came before."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[:block, :block] = True
    mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


@torch.no_grad()
def prefix_lm_logits(model_dir: str | Path, inputs_embeds: torch.Tensor, block: int,
                     position_offset: int = 1) -> torch.Tensor:
    """``[n, vocab]`` logits of the causal LM at ``model_dir`` (a split PaliGemma's ``llm/``) over
    ``inputs_embeds`` (as the LLM's layers take them: text rows already scaled by its embedding
    layer) with the first ``block`` rows one bidirectional block (``block=0``: causal) and
    positions from ``position_offset`` (PaliGemma's are 1-based)."""
    model = hf_eager_model(str(model_dir))
    n = inputs_embeds.shape[0]
    positions = (torch.arange(n) + position_offset)[None]
    out = model(inputs_embeds=inputs_embeds.float()[None], attention_mask=prefix_lm_mask(n, block),
                position_ids=positions, use_cache=False)
    return out.logits[0]


@torch.no_grad()
def prefix_lm_greedy(model_dir: str | Path, inputs_embeds: torch.Tensor, max_new_tokens: int,
                     prefix: list[int] = (), causal: bool = False) -> Greedy:
    """The greedy continuation of a prompt of ``inputs_embeds`` (the LLM's layers' input, as in
    ``prefix_lm_logits``) attended as one block (``causal=True``: causally), then ``prefix``, by
    the causal LM at ``model_dir``; a full forward per step (tiny models only)."""
    model = hf_eager_model(str(model_dir))
    embed = model.get_input_embeddings()
    block = 0 if causal else inputs_embeds.shape[0]
    rows, tokens, scores = inputs_embeds.float(), list(prefix), []
    eos = eos_ids(model)
    if prefix:
        rows = torch.cat([rows, embed(torch.tensor(list(prefix))).float()])
    for _ in range(max_new_tokens - len(prefix)):
        logits = prefix_lm_logits(model_dir, rows, block)[-1]
        scores.append(logits[None])
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos:
            break
        rows = torch.cat([rows, embed(torch.tensor([token])).float()])
    if not scores:
        return Greedy([], [], [])
    return _greedy_from_scores(torch.tensor([tokens]), tuple(scores))


# -- HF Gemma 3 as the reference for image blocks ----------------------------------------------
# Gemma 3 attends each image's soft-token rows as one bidirectional block (token_type_ids 1 at
# them, as its processor gives them) and everything else causally, its sliding layers within
# their window as well. Eager attention, as for PaliGemma.


@lru_cache(maxsize=4)
def hf_gemma3(checkpoint: str):
    """HF's ``Gemma3ForConditionalGeneration`` (float32, eager attention) and processor."""
    model = AutoModelForImageTextToText.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def gemma3_inputs(checkpoint: str | Path, text: str, images: list) -> dict:
    """What HF's processor builds for ``text`` (a ``<start_of_image>`` where each image goes):
    each expanded to ``"\\n\\n<start_of_image>"``, the soft tokens, ``"<end_of_image>\\n\\n"``;
    ``token_type_ids`` 1 at the soft tokens. A ``text`` that starts with the bos (a rendered chat)
    is tokenized without special tokens, as ``apply_chat_template`` tokenizes it."""
    _, processor = hf_gemma3(str(checkpoint))
    specials = not text.startswith(processor.tokenizer.bos_token)
    return dict(processor(images=images or None, text=text, add_special_tokens=specials,
                          return_tensors="pt"))


@torch.no_grad()
def gemma3_greedy(checkpoint: str | Path, text: str, images: list, max_new_tokens: int,
                  prefix: list[int] = (), causal_images: bool = False) -> Greedy:
    """HF ``generate`` of the checkpoint's Gemma 3 (float32, greedy) after ``text`` about
    ``images`` (``gemma3_inputs``) and then ``prefix`` (tokens generated before).
    ``causal_images=True``: the images attended causally too (no token_type_ids)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    inputs = gemma3_inputs(checkpoint, text, images)
    # tokens generated before are text (type 0)
    return _typed_greedy(hf_gemma3(str(checkpoint))[0], inputs, max_new_tokens, prefix, 0, causal_images)


def sliding_block_masks(n: int, blocks: Collection[tuple[int, int]],
                        sliding_window: int) -> dict[str, torch.Tensor]:
    """The ``[1, 1, n, n]`` additive masks of a Gemma 3 text model's two layer types as HF builds
    them for image blocks: full layers causal or within a block; sliding layers that and within
    the window (``kv > q - sliding_window``)."""
    allowed = block_mask(n, blocks)[0, 0]
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None]
    windowed = allowed & (kv > q - sliding_window)
    neg = torch.finfo(torch.float32).min

    def additive(a: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, n).masked_fill(~a, neg)[None, None]

    return {"full_attention": additive(allowed), "sliding_attention": additive(windowed)}


@torch.no_grad()
def sliding_block_logits(model_dir: str | Path, inputs_embeds: torch.Tensor,
                         blocks: Collection[tuple[int, int]],
                         sliding_window: int | None = None) -> torch.Tensor:
    """``[n, vocab]`` logits of the causal LM at ``model_dir`` (a split Gemma 3's ``llm/``, eager)
    over ``inputs_embeds`` (the layers' input: text rows already scaled by its embedding) with
    ``blocks`` attended both ways on every layer type (``sliding_block_masks``; ``sliding_window``:
    the model's own unless given)."""
    model = hf_eager_model(str(model_dir))
    window = sliding_window or model.config.sliding_window
    masks = sliding_block_masks(inputs_embeds.shape[0], blocks, window)
    out = model(inputs_embeds=inputs_embeds.float()[None], attention_mask=masks, use_cache=False)
    return out.logits[0]


# -- HF Gemma 4 as the reference for its two layouts ---------------------------------------------
# Gemma 4 gives each image a variable number of soft-token rows (Gemma4Processor expands each
# image token into <boi>, one image token per row, <eoi>). E2B/E4B attend them causally and look
# the per-layer inputs of their positions up by the pad id; 26B/31B attend each image as one block
# on the sliding layers only (use_bidirectional_attention="vision", blocks read from
# mm_token_type_ids). Eager attention, as for Gemma 3.

hf_gemma4 = hf_gemma3  # the same loader: the checkpoint's class (eager, float32) and processor


def gemma4_inputs(checkpoint: str | Path, text: str, images: list) -> dict:
    """What HF's processor builds for ``text`` (an image token where each image goes): each
    expanded to ``<boi>``, one image token per row, ``<eoi>``; ``mm_token_type_ids`` 1 at the
    image tokens; ``pixel_values`` and ``image_position_ids`` padded to the processor's patch
    budget. A ``text`` that starts with the bos (a rendered chat) is tokenized without special
    tokens, as ``apply_chat_template`` tokenizes it."""
    _, processor = hf_gemma4(str(checkpoint))
    specials = not text.startswith(processor.tokenizer.bos_token)
    return dict(processor(images=images or None, text=text, add_special_tokens=specials,
                          return_tensors="pt"))


@contextlib.contextmanager
def _gemma4_knobs(model, image_layer_ids: torch.Tensor | int | None,
                  sliding_window: int | None) -> Iterator[None]:
    """``model`` (HF Gemma 4) with its per-layer inputs at image positions looked up by
    ``image_layer_ids`` instead of the pad id, and its sliding layers' window (masks and cache)
    ``sliding_window``; None: as it is."""
    text_model, text_config = model.model.language_model, model.config.text_config
    lookup, window = text_model.get_per_layer_inputs, text_config.sliding_window

    def wrong_ids(input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        # HF passes the ids with the pad id at every image position (and no pad anywhere else)
        at_images = input_ids == text_config.pad_token_id
        if at_images.any():
            wrong = torch.as_tensor(image_layer_ids)
            wrong = wrong[:input_ids.shape[-1]] if wrong.dim() else wrong  # ids by position
            input_ids = torch.where(at_images, wrong, input_ids)
        return lookup(input_ids, inputs_embeds)

    if image_layer_ids is not None:
        text_model.get_per_layer_inputs = wrong_ids
    if sliding_window is not None:
        text_config.sliding_window = sliding_window
    try:
        yield
    finally:
        text_model.__dict__.pop("get_per_layer_inputs", None)
        text_config.sliding_window = window


@torch.no_grad()
def gemma4_greedy(checkpoint: str | Path, text: str, images: list, max_new_tokens: int,
                  prefix: list[int] = (), causal_images: bool = False,
                  image_layer_ids: torch.Tensor | int | None = None,
                  sliding_window: int | None = None,
                  image_rows: list[torch.Tensor] | None = None) -> Greedy:
    """HF ``generate`` of the checkpoint's Gemma 4 (float32, greedy) after ``text`` about
    ``images`` (``gemma4_inputs``) and then ``prefix`` (tokens generated before, text).

    The knobs, each a way the LLM half could go wrong: ``causal_images`` (no
    ``mm_token_type_ids``: on a ``"vision"`` model the images attended causally);
    ``image_layer_ids`` (the per-layer inputs of the image positions looked up by this id, or by
    position in a 1-D tensor at least as long as the prompt, instead of the pad id); ``sliding_window`` (the sliding layers' window).
    ``image_rows``: each image's rows given precomputed (``mm_encoder_outputs``), not its pixels."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    model, _ = hf_gemma4(str(checkpoint))
    placeholders = {model.config.image_token_id, model.config.video_token_id,
                    model.config.audio_token_id}
    if placeholders & set(prefix):
        raise ValueError(f"the prefix {list(prefix)} holds a placeholder token of "
                         f"{sorted(placeholders)}: HF Gemma 4 would read it as an image, video or "
                         "audio position, so it cannot continue such a prefix")
    inputs = gemma4_inputs(checkpoint, text, images)
    if prefix:
        extra = torch.tensor([list(prefix)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    if causal_images:
        del inputs["mm_token_type_ids"]
    if image_rows is not None:
        del inputs["pixel_values"], inputs["image_position_ids"]
        inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(
            pooler_output=tuple(r.float() for r in image_rows))}
    with _gemma4_knobs(model, image_layer_ids, sliding_window):
        out = model.generate(**inputs, max_new_tokens=max_new_tokens - len(prefix),
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=model.config.text_config.pad_token_id)
    return _greedy_from_scores(out.sequences, out.scores)


@lru_cache(maxsize=2)
def hf_florence2(checkpoint: str):
    """HF's ``Florence2ForConditionalGeneration`` (float32) and processor."""
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


@contextlib.contextmanager
def causal_encoder(model) -> Iterator[None]:
    """A Florence-2's BART encoder attending causally (each position to itself and before) while
    inside: the wrong mask, to show a test that the encoder's direction changes HF's answer."""
    layers = model.model.language_model.encoder.layers
    for layer in layers:
        layer.self_attn.is_causal = True
    try:
        yield
    finally:
        for layer in layers:
            layer.self_attn.is_causal = False


@torch.no_grad()
def florence2_greedy(checkpoint: str | Path, task: str, image, max_new_tokens: int, prefix: list[int] = (),
                     causal: bool = False) -> Greedy:
    """HF ``generate`` of the checkpoint's Florence-2 (float32, greedy) for ``task`` about
    ``image`` as its processor lays them out, from the decoder's start and forced first token
    (the generation config's) and then ``prefix`` (tokens generated before); the raw logits'
    log-softmax (not the scores its logits processors change); no end forced at the length
    limit. ``causal=True``: the encoder attended causally (``causal_encoder``)."""
    if len(prefix) >= max_new_tokens:
        return Greedy([], [], [])
    model, processor = hf_florence2(str(checkpoint))
    inputs = processor(images=image, text=task, return_tensors="pt")
    config = model.generation_config
    start = [config.decoder_start_token_id] + ([config.forced_bos_token_id] if config.forced_bos_token_id is not None else [])
    decoder = torch.tensor([start + list(prefix)])
    with causal_encoder(model) if causal else contextlib.nullcontext():
        out = model.generate(**inputs, decoder_input_ids=decoder, max_new_tokens=max_new_tokens - len(prefix),
                             do_sample=False, num_beams=1, forced_eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    return _greedy_from_scores(out.sequences, out.logits)
