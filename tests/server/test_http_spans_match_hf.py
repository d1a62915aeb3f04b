"""Span prompts on a real SGLang server (CPU, float32, tiny models): tokens equal HF transformers."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers import LOGPROBS, body, generate, reference_embeds, seeded_rows, span, text, to_segments, with_other_spans
from sgl_embeds_testing import reference as ref

WORDS = ["the red fox", " near the blue house", " what is the color of", " describe the image", " yes"]


def _random_prompt(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    n_spans = 1 + seed % 3
    parts: list = []
    for k in range(n_spans):
        if k or seed % 2 == 0:
            parts.append(WORDS[(seed + k) % len(WORDS)])
        rows = int(torch.randint(1, 24, (1,), generator=g))
        parts.append(torch.randn(rows, 64, generator=g) * 0.05)  # random, not token-derived
    parts.append(WORDS[seed % len(WORDS)])
    return parts


@pytest.mark.parametrize("arch", helpers.pooled(["llama", "qwen2"], {"llama": "llama", "qwen2": "qwen"}.get))
@pytest.mark.parametrize("seed", range(4))
def test_random_spans_match_hf_generate(arch, seed, servers):
    server = servers.get({"llama": "llama", "qwen2": "qwen"}[arch])[0]
    model_dir = server.model_dir
    parts = _random_prompt(seed * 7 + (arch == "qwen2"))
    out = generate(server, body(to_segments(parts), max_new_tokens=12, **LOGPROBS))
    ref.assert_matches_hf(out, model_dir, reference_embeds(model_dir, parts), 12, f"{arch} seed {seed}: ",
                          other_span_embeds=reference_embeds(model_dir, with_other_spans(parts)))
    assert out["meta_info"]["prompt_tokens"] == reference_embeds(model_dir, parts).shape[0]


@pytest.mark.parametrize("where", ["text before the span", "inside the span", "text after it"])
def test_input_logprobs_from_a_later_position_match_hf(llama_server, llama_dir, where):
    """``logprob_start_len`` > 0 with spans in the prompt: one entry per position from there, each
    text position's logprob HF's, each span row's null (the nulls counted from the start asked)."""
    parts = ["the red fox", seeded_rows(5, 8), " near the blue house", seeded_rows(6, 3), " yes"]
    before = len(ref.hf_tokenizer(str(llama_dir)).encode(parts[0]))
    start = {"text before the span": before - 2, "inside the span": before + 3, "text after it": before + 9}[where]
    out = generate(llama_server, body(to_segments(parts), 8, **{**LOGPROBS, "logprob_start_len": start}))
    ref.assert_matches_hf(out, llama_dir, reference_embeds(llama_dir, parts), 8, f"from position {start}: ",
                          other_span_embeds=reference_embeds(llama_dir, with_other_spans(parts)),
                          logprob_start_len=start)


def test_token_embeddings_as_a_span_equal_the_same_ids_as_text(llama_server, llama_dir):
    tok = ref.hf_tokenizer(str(llama_dir))
    ids = tok.encode(" the quick red fox near the house", add_special_tokens=False)
    as_text = generate(llama_server, body([text("describe"), {"type": "input_ids", "input_ids": ids}], 12))
    as_span = generate(llama_server, body([text("describe"), span(ref.embed_ids(llama_dir, ids))], 12))
    assert as_span["output_ids"] == as_text["output_ids"]
    plain = generate(llama_server, {"text": "describe the quick red fox near the house", "sampling_params": {"temperature": 0, "max_new_tokens": 12}})
    assert tok.encode("describe the quick red fox near the house") == tok.encode("describe") + ids  # same ids as text
    assert plain["output_ids"] == as_text["output_ids"]


def test_outputs_vary_with_the_span(llama_server):
    outs = {tuple(generate(llama_server, body([text("the"), span(torch.randn(4, 64, generator=torch.Generator().manual_seed(s)))], 8))["output_ids"]) for s in range(4)}
    assert len(outs) > 1


@pytest.mark.parametrize("fmt, dtype", [("json", None), ("base64", "float32"), ("base64", "float16"), ("base64", "bfloat16")])
def test_full_prompt_input_embeds_in_every_encoding(llama_server, llama_dir, fmt, dtype):
    from sgl_embeds_protocol import wire

    x = seeded_rows(3, 9)
    enc = wire.encode_tensor(x, fmt, dtype)
    out = generate(llama_server, {"input_embeds": enc, "sampling_params": {"temperature": 0, "max_new_tokens": 10},
                                  **LOGPROBS})
    seen = wire.decode_tensor(enc).float()  # what the server saw after rounding to the wire dtype
    ref.assert_matches_hf(out, llama_dir, seen, 10, f"{fmt} {dtype}: ", other_span_embeds=seeded_rows(99, 9))


def test_batch_form_equals_each_prompt_alone(llama_server):
    prompts = [to_segments(_random_prompt(s)) for s in (1, 2, 3)]
    alone = [generate(llama_server, body(p, 8))["output_ids"] for p in prompts]
    batch = generate(llama_server, {"input_segments": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert [b["output_ids"] for b in batch] == alone
    xs = [torch.randn(5, 64, generator=torch.Generator().manual_seed(s)) for s in (7, 8)]
    from sgl_embeds_protocol import wire

    batch = generate(llama_server, {"input_embeds": [wire.encode_tensor(x) for x in xs], "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    solo = [generate(llama_server, {"input_embeds": wire.encode_tensor(x), "sampling_params": {"temperature": 0, "max_new_tokens": 6}})["output_ids"] for x in xs]
    assert [b["output_ids"] for b in batch] == solo


def test_a_request_inside_a_concurrent_batch_equals_it_alone(llama_server):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [to_segments(_random_prompt(s)) for s in range(10, 18)]
    alone = [generate(llama_server, body(p, 10))["output_ids"] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(llama_server, body(p, 10))["output_ids"], prompts))
    assert together == alone
