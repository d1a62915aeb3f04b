"""Sampling features with spans: n>1, streaming, stop strings, seeded sampling, logprobs."""

from __future__ import annotations

import json

import requests

from helpers import body, generate, seeded_rows, span, text

PARTS = [text("the red fox"), span(seeded_rows(9, 6)), text(" near the")]


def test_parallel_sampling_n_greater_than_one(llama_server):
    # ignore_eos: at temperature 1 the tiny model (512 tokens) sometimes samples its end token early
    sampled = {"temperature": 1.0, "n": 3, "max_new_tokens": 6, "sampling_seed": 1, "ignore_eos": True}
    out = generate(llama_server, {"input_segments": PARTS, "sampling_params": sampled})
    assert isinstance(out, list) and len(out) == 3
    assert all(len(o["output_ids"]) == 6 for o in out)
    batch = generate(llama_server, {"input_segments": [PARTS, PARTS[:2]], "sampling_params": {"temperature": 0.0, "n": 2, "max_new_tokens": 5}})
    assert len(batch) == 4
    solo = [generate(llama_server, body(p, 5))["output_ids"] for p in (PARTS, PARTS[:2])]
    assert sorted(tuple(b["output_ids"]) for b in batch) == sorted(tuple(s) for s in solo * 2)


def test_streaming_yields_the_same_tokens(llama_server):
    want = generate(llama_server, body(PARTS, 8))
    chunks = []
    with requests.post(llama_server.url + "/generate", json={**body(PARTS, 8), "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) > 1
    assert chunks[-1]["output_ids"] == want["output_ids"] or sum((c["output_ids"] for c in chunks), []) == want["output_ids"]


def test_stop_strings_end_generation(llama_server):
    full = generate(llama_server, body(PARTS, 12))
    stop = full["text"][3:6]
    assert stop, full
    out = generate(llama_server, {"input_segments": PARTS, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop": [stop]}})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert stop not in out["text"] and full["text"].startswith(out["text"])


def test_temperature_top_p_sampling_with_spans(llama_server):
    """Sampling draws from the span-conditioned distribution: varied draws, and top_k=1 is greedy.

    (Per-request ``sampling_seed`` is honoured by SGLang only with --enable-deterministic-inference,
    which needs a GPU attention backend; see docs/engine.md.)"""

    def sample(**extra):
        sp = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "ignore_eos": True, **extra}
        return generate(llama_server, {"input_segments": PARTS, "sampling_params": sp})["output_ids"]

    draws = {tuple(sample()) for _ in range(5)}
    assert len(draws) > 1 and all(len(d) == 10 for d in draws)
    greedy = generate(llama_server, {"input_segments": PARTS, "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}})
    assert sample(top_k=1) == greedy["output_ids"]


def test_output_logprobs_and_null_input_logprobs_at_span_rows(llama_server):
    out = generate(llama_server, {**body(PARTS, 4), "return_logprob": True, "logprob_start_len": 0,
                                  "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    assert all(lp is not None and lp <= 0 and tid < 1000 for lp, tid, _ in meta["output_token_logprobs"])
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"]
    n_a = 1 + len(__import__("sgl_embeds_testing.reference", fromlist=["x"]).hf_tokenizer(str(llama_server.model_dir)).encode("the red fox", add_special_tokens=False))
    span_entries = inputs[n_a : n_a + 6]
    assert all(e == [None, None, None] for e in span_entries), span_entries
    text_entries = inputs[n_a + 6 :]
    assert text_entries and all(lp is not None and tid < 1000 for lp, tid, _ in text_entries)


def test_text_only_requests_are_untouched(llama_server):
    sp = {"temperature": 0, "max_new_tokens": 8}
    a = generate(llama_server, {"text": "the blue bird on the tree", "sampling_params": sp})
    b = generate(llama_server, {"text": "the blue bird on the tree", "sampling_params": sp})
    assert a["output_ids"] == b["output_ids"] and b["meta_info"]["cached_tokens"] > 0
    ids = generate(llama_server, {"input_ids": [0, 20, 30, 40], "sampling_params": sp})
    assert len(ids["output_ids"]) == 8


def test_penalties_with_spans_take_effect(llama_server):
    """The plain answer repeats tokens; with penalties on, the same prompt repeats fewer (so the
    penalties were applied), and penalising never touches a placeholder id (no error, real ids)."""
    n = 16
    plain = generate(llama_server, {"input_segments": PARTS, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    plain_ids = plain["output_ids"]
    assert len(set(plain_ids)) < n, f"the check needs a plain answer with repeats: {plain_ids}"
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.8}):
        sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **penalty}
        out = generate(llama_server, {"input_segments": PARTS, "sampling_params": sp})["output_ids"]
        assert len(out) == n and all(t < 1000 for t in out)
        assert len(set(out)) > len(set(plain_ids)), (penalty, out, plain_ids)
