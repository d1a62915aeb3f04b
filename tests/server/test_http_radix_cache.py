"""Radix cache behaviour of span prompts, chunked prefill across spans, eviction and retraction."""

from __future__ import annotations

import re

import torch

import helpers
from helpers import LOGPROBS, OUTPUT_LOGPROBS, body, generate, reference_embeds, seeded_rows, span, text
from sgl_embeds_testing import reference as ref

A = "the red fox near the house and"
B = " describe it"
C = " what is the color"



def _cached(out: dict) -> int:
    return out["meta_info"]["cached_tokens"]


def test_prefix_hits_cover_spans_and_never_collide(llama_server, llama_dir):
    from sgl_embeds_testing.reference import hf_tokenizer

    n_a = len(hf_tokenizer(str(llama_dir)).encode(A))
    E, F = seeded_rows(100, 12), seeded_rows(101, 12)
    first = generate(llama_server, body([text(A), span(E), text(B)]))
    again = generate(llama_server, body([text(A), span(E), text(B)]))
    total = again["meta_info"]["prompt_tokens"]
    assert _cached(again) == total - 1  # everything but the last position, as for text
    assert again["output_ids"] == first["output_ids"]
    other_tail = generate(llama_server, body([text(A), span(E), text(C)]))
    assert _cached(other_tail) == n_a + E.shape[0]  # reuses A and the span, and nothing of B
    other_span = generate(llama_server, body([text(A), span(F), text(B)], **OUTPUT_LOGPROBS))
    assert _cached(other_span) == n_a  # a different span of the same length: no hit past A
    # no false sharing: the answer for F is HF's answer for F, which differs from HF's for E
    ref.assert_matches_hf(other_span, llama_dir, reference_embeds(llama_dir, [A, F, B]), 8,
                          other_span_embeds=reference_embeds(llama_dir, [A, E, B]))


def test_shared_leading_rows_of_full_prompt_embeds_share_cache(llama_server):
    from sgl_embeds_protocol import wire

    head = seeded_rows(200, 20)
    x1 = torch.cat([head, seeded_rows(201, 5)])
    x2 = torch.cat([head, seeded_rows(202, 5)])
    sp = {"temperature": 0, "max_new_tokens": 4}
    generate(llama_server, {"input_embeds": wire.encode_tensor(x1), "sampling_params": sp})
    out = generate(llama_server, {"input_embeds": wire.encode_tensor(x2), "sampling_params": sp})
    assert _cached(out) == 20


def test_cached_and_uncached_runs_are_identical_and_equal_hf(llama_server, llama_dir):
    rows = seeded_rows(300, 30)
    parts = [text("a small bird"), span(rows), text(" on the tree")]
    cold = generate(llama_server, body(parts, 12, **OUTPUT_LOGPROBS))
    assert _cached(cold) < 5
    warm = generate(llama_server, body(parts, 12, **OUTPUT_LOGPROBS))
    assert _cached(warm) == warm["meta_info"]["prompt_tokens"] - 1 and warm["output_ids"] == cold["output_ids"]
    prompt = reference_embeds(llama_dir, ["a small bird", rows, " on the tree"])
    other = reference_embeds(llama_dir, ["a small bird", seeded_rows(301, 30), " on the tree"])
    for out in (cold, warm):  # the cache hit's numbers too
        ref.assert_matches_hf(out, llama_dir, prompt, 12, other_span_embeds=other)


def test_chunked_prefill_splits_spans_and_matches_unconstrained(llama_server, constrained_server, llama_dir):
    # chunk size 16: the 40-row span cannot fit in one chunk
    from sgl_embeds_testing.reference import hf_tokenizer

    parts = [text("the quick fox"), span(seeded_rows(400, 40)), text(" is"), span(seeded_rows(401, 7)), text(" very")]
    want = generate(llama_server, body(parts, 10))["output_ids"]
    log_before = len(constrained_server.log_path.read_text())
    got = generate(constrained_server, body(parts, 10, **LOGPROBS))
    assert got["output_ids"] == want
    rows = [seeded_rows(400, 40), seeded_rows(401, 7)]
    ref.assert_matches_hf(got, llama_dir, reference_embeds(llama_dir, ["the quick fox", rows[0], " is", rows[1], " very"]), 10,
                          other_span_embeds=reference_embeds(llama_dir, ["the quick fox", rows[1].repeat(6, 1)[:40], " is",
                                                                         rows[1], " very"]))
    # the scheduler logs one "Prefill batch" line per chunk, with its "#new-token" count
    log = constrained_server.log_path.read_text()[log_before:]
    chunks = [int(m) for m in re.findall(r"Prefill batch.*?#new-token: (\d+)", log)]
    assert sum(chunks) == got["meta_info"]["prompt_tokens"] - _cached(got) and max(chunks) <= 16, chunks
    start = _cached(got)
    ends = [start + sum(chunks[: i + 1]) for i in range(len(chunks))]  # the position after each chunk
    span_start = len(hf_tokenizer(str(llama_dir)).encode("the quick fox"))
    inside = [e for e in ends if span_start < e < span_start + 40]
    assert len(inside) >= 2, (chunks, start, span_start)  # the span was cut in (at least) three pieces


def test_eviction_and_retraction_keep_outputs_identical(llama_server, constrained_server, llama_dir):
    """8 concurrent requests of ~34 positions + 40 new tokens each need far more than 256 KV
    slots: each answer equals the one served alone, which is HF's over all 40 tokens."""
    helpers.assert_retraction_keeps_outputs(llama_server, constrained_server, lambda attempt: [
        [text("one two"), span(seeded_rows(500 + 10 * attempt + i, 30)), text(" three")] for i in range(8)],
        lambda segments, out: ref.assert_matches_hf(
            out, llama_dir, reference_embeds(llama_dir, helpers.segment_parts(segments)), 40, "retracted: "))


def test_a_cache_salt_or_extra_key_keeps_span_prompts_apart(llama_server):
    """SGLang's own tenant fields on span prompts: a prompt sent with a ``cache_salt`` (or an
    ``extra_key``) hits the cache only under the same value, on ``/generate`` (JSON and the
    binary body) and on the chat route; another value, or none, starts from nothing."""
    from sgl_embeds.backend import EmbedsEndpoint
    from sgl_embeds_protocol.segments import Span, Text

    rows = seeded_rows(131, 12)
    segments = [text(A), span(rows), text(B)]
    for field in ("cache_salt", "extra_key"):
        first = generate(llama_server, body(segments, 2, **{field: f"tenant-a {field}"}))
        assert _cached(first) == 0, f"{field}: a new tenant's first prompt"
        again = generate(llama_server, body(segments, 2, **{field: f"tenant-a {field}"}))
        assert _cached(again) == again["meta_info"]["prompt_tokens"] - 1, field
        assert again["output_ids"] == first["output_ids"]
        assert _cached(generate(llama_server, body(segments, 2, **{field: f"tenant-b {field}"}))) == 0, field
    unsalted = generate(llama_server, body(segments, 2))
    assert _cached(generate(llama_server, body(segments, 2))) == unsalted["meta_info"]["prompt_tokens"] - 1
    assert _cached(generate(llama_server, body(segments, 2, cache_salt="tenant-c"))) == 0

    endpoint = EmbedsEndpoint(llama_server.url)  # the binary body carries the field too
    sent = [Text(A), Span(rows), Text(" and the binary body")]
    params = {**helpers.GREEDY, "max_new_tokens": 2}
    assert _cached(endpoint.run(input_segments=sent, sampling_params=params, cache_salt="tenant-d")) == 0
    hit = endpoint.run(input_segments=sent, sampling_params=params, cache_salt="tenant-d")
    assert _cached(hit) == hit["meta_info"]["prompt_tokens"] - 1
    assert _cached(endpoint.run(input_segments=sent, sampling_params=params, cache_salt="tenant-e")) == 0

    def chat(salt: str) -> int:
        import requests

        res = requests.post(llama_server.url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 2, "temperature": 0, "cache_salt": salt,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": A}, {"type": "input_embeds", "input_embeds": span(rows)["embeds"]}]}]})
        assert res.status_code == 200, res.text
        return res.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert chat("tenant-f") == 0
    assert chat("tenant-f") > rows.shape[0]
    assert chat("tenant-g") == 0
