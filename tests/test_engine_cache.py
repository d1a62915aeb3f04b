"""Radix cache behaviour of span prompts, chunked prefill across spans, eviction and retraction."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from helpers import body, generate, seeded_rows, span, text

A = "the red fox near the house and"
B = " describe it"
C = " what is the color"



def _cached(out: dict) -> int:
    return out["meta_info"]["cached_tokens"]


def test_prefix_hits_cover_spans_and_never_collide(llama_server, llama_dir):
    from sgl_embeds.testing.reference import hf_tokenizer

    n_a = len(hf_tokenizer(str(llama_dir)).encode(A))
    E, F = seeded_rows(100, 12), seeded_rows(101, 12)
    first = generate(llama_server, body([text(A), span(E), text(B)]))
    again = generate(llama_server, body([text(A), span(E), text(B)]))
    total = again["meta_info"]["prompt_tokens"]
    assert _cached(again) == total - 1  # everything but the last position, as for text
    assert again["output_ids"] == first["output_ids"]
    other_tail = generate(llama_server, body([text(A), span(E), text(C)]))
    assert _cached(other_tail) >= n_a + E.shape[0]  # reuses A and the span
    other_span = generate(llama_server, body([text(A), span(F), text(B)]))
    assert _cached(other_span) == n_a  # a different span of the same length: no hit past A
    # and the different span really changes the answer's computation (no false sharing)
    assert other_span["output_ids"] != first["output_ids"] or not torch.equal(E, F)


def test_shared_leading_rows_of_full_prompt_embeds_share_cache(llama_server):
    from sgl_embeds import wire

    head = seeded_rows(200, 20)
    x1 = torch.cat([head, seeded_rows(201, 5)])
    x2 = torch.cat([head, seeded_rows(202, 5)])
    sp = {"temperature": 0, "max_new_tokens": 4}
    generate(llama_server, {"input_embeds": wire.encode_tensor(x1), "sampling_params": sp})
    out = generate(llama_server, {"input_embeds": wire.encode_tensor(x2), "sampling_params": sp})
    assert _cached(out) == 20


def test_cached_and_uncached_runs_are_identical(llama_server):
    parts = [text("a small bird"), span(seeded_rows(300, 30)), text(" on the tree")]
    cold = generate(llama_server, body(parts, 12))
    assert _cached(cold) < 5
    warm = generate(llama_server, body(parts, 12))
    assert _cached(warm) > 30 and warm["output_ids"] == cold["output_ids"]


def test_chunked_prefill_splits_spans_and_matches_unconstrained(llama_server, constrained_server):
    # chunk size 16: a 40-row span is split across three chunks
    parts = [text("the quick fox"), span(seeded_rows(400, 40)), text(" is"), span(seeded_rows(401, 7)), text(" very")]
    want = generate(llama_server, body(parts, 10))["output_ids"]
    got = generate(constrained_server, body(parts, 10))
    assert got["output_ids"] == want
    assert "Prefill batch" in constrained_server.log_path.read_text()


def test_eviction_and_retraction_keep_outputs_identical(llama_server, constrained_server):
    # 8 concurrent requests of ~34 positions + 40 new tokens each need far more than 256 KV slots
    prompts = [[text("one two"), span(seeded_rows(500 + i, 30)), text(" three")] for i in range(8)]
    want = [generate(llama_server, body(p, 40, ))["output_ids"] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: generate(constrained_server, body(p, 40)), prompts))
    assert [g["output_ids"] for g in got] == want
    log = constrained_server.log_path.read_text()
    retracted = sum(g["meta_info"].get("num_retractions", 0) for g in got)
    assert retracted > 0, "the KV pool was meant to force retraction"
