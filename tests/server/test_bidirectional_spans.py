"""Bidirectional spans (``"attention": "bidirectional"``) on real SGLang servers (CPU, float32, a
tiny Llama): tokens and logprobs equal HF run with the same 4-D mask (the span's rows one block),
whole, at chunk sizes that would cut the block, after a cached repeat and beside other requests.
Each prompt's HF answer changes when the same rows are attended causally, so an ignored mask fails.
"""

from __future__ import annotations

import pytest
import requests
import torch

import helpers
from helpers import OUTPUT_LOGPROBS, body, error_message, generate, reference_embeds, seeded_rows, span, text
from sgl_embeds_protocol import binary_body, wire
from sgl_embeds_protocol import segments as seg
from sgl_embeds_testing import reference as ref

MAX_TOKENS = 10


def _rows(seed: int, n: int) -> torch.Tensor:
    return seeded_rows(seed, n, scale=0.5)  # larger than the token rows: the mask shows in HF's answer


def _segments(parts: list, bidirectional: bool = True) -> list:
    out = []
    for p in parts:
        out.append(text(p) if isinstance(p, str) else span(p))
        if not isinstance(p, str) and bidirectional:
            out[-1][seg.ATTENTION] = seg.BIDIRECTIONAL
    return out


def _blocks(model_dir, parts: list) -> list[tuple[int, int]]:
    """Where each span's rows stand in the prompt HF runs (``reference_embeds``)."""
    tok, blocks, pos = ref.hf_tokenizer(str(model_dir)), [], 0
    for i, p in enumerate(parts):
        n = len(tok.encode(p, add_special_tokens=i == 0)) if isinstance(p, str) else p.shape[0]
        if not isinstance(p, str):
            blocks.append((pos, pos + n))
        pos += n
    return blocks


def _check(out: dict, model_dir, parts: list, context: str) -> ref.Greedy:
    """``out`` equals HF with the spans as blocks; HF's causal answer over the same rows differs."""
    embeds, blocks = reference_embeds(model_dir, parts), _blocks(model_dir, parts)
    reference = ref.assert_matches_hf(out, model_dir, embeds, MAX_TOKENS, context, blocks=blocks)
    causal = ref.greedy_after(model_dir, embeds, MAX_TOKENS)
    assert causal.tokens != reference.tokens, f"{context}HF's answer must change when the block is attended causally"
    return reference


PROMPTS = {
    "a block after text": ["the red fox", _rows(0, 12), " near the blue house"],
    "two blocks": ["the red fox", _rows(1, 20), " near", _rows(51, 12), " the blue house"],
}


@pytest.mark.parametrize("name", PROMPTS)
def test_bidirectional_spans_match_hf_with_the_same_mask(llama_server, llama_dir, name):
    parts = PROMPTS[name]
    out = generate(llama_server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    _check(out, llama_dir, parts, f"{name}: ")


@pytest.mark.pooled("gemma3")
@pytest.mark.parametrize("seed", [1, 5])
def test_a_gemma3_with_sliding_window_layers_matches_hf(servers, seed):
    """Gemma 3's local layers see a window of 8 positions, shorter than the prompt, with the
    block over the window (HF's order); 16-position chunks would cut the block. HF's answer
    changes without the window, so a window the mask dropped would fail."""
    server = servers.get("gemma3")[0]
    parts = ["the red fox near", seeded_rows(seed, 12, scale=0.5), " the blue house and the sky"]
    out = generate(server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    _check(out, server.model_dir, parts, f"Gemma 3, seed {seed}: ")
    model, embeds, blocks = ref.hf_model(str(server.model_dir)), reference_embeds(server.model_dir, parts), _blocks(server.model_dir, parts)
    no_window = ref.block_mask(embeds.shape[0], blocks)
    with torch.no_grad():
        windowed = model(inputs_embeds=embeds[None], attention_mask=ref.block_masks(model, embeds.shape[0], blocks)).logits[0, -1]
        unwindowed = model(inputs_embeds=embeds[None], attention_mask={"full_attention": no_window,
                                                                        "sliding_attention": no_window}).logits[0, -1]
    assert (windowed.log_softmax(-1) - unwindowed.log_softmax(-1)).abs().max() > 1e-2, "the window must matter"


def test_input_logprobs_see_the_block(llama_server, llama_dir):
    """The prompt's own logprobs (every position recomputed) come from the masked forward too."""
    parts = PROMPTS["a block after text"]
    out = generate(llama_server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS, logprob_start_len=0))
    compared = ref.assert_input_logprobs(out, llama_dir, reference_embeds(llama_dir, parts),
                                         blocks=_blocks(llama_dir, parts))
    assert compared >= 4


CHUNK_CUTS = {  # on the constrained server: 16-position chunks
    # the first chunk would end inside [4, 16 + 8): it ends at 4, the next takes the block whole
    "a block longer than a chunk": ["the red fox", _rows(0, 20), " near the blue house"],
    # the block [9, 21) would be cut at 16: the first chunk ends before it
    "a block across a chunk end": ["the red fox near the blue house and", _rows(5, 12), " the sky"],
}


@pytest.mark.parametrize("name", CHUNK_CUTS)
def test_prefill_chunks_never_cut_a_block(servers, name):
    server = servers.get("constrained")[0]
    parts = CHUNK_CUTS[name]
    start, end = _blocks(server.model_dir, parts)[0]
    assert start < 16 < end, "the block must straddle the first chunk's end"
    out = generate(server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    _check(out, server.model_dir, parts, f"{name}: ")


def test_a_repeat_hits_the_cache_and_a_causal_twin_does_not_leak_into_the_block(llama_server, llama_dir):
    """The same rows sent causally first: the bidirectional span must not reuse their cached KV
    (its first placeholder id names the block); its own repeat hits inside the block and stays
    exact."""
    parts = ["the blue house", _rows(7, 12), " and the red fox"]
    start, end = _blocks(llama_dir, parts)[0]
    causal = generate(llama_server, body(_segments(parts, bidirectional=False), MAX_TOKENS, **OUTPUT_LOGPROBS))
    ref.assert_matches_hf(causal, llama_dir, reference_embeds(llama_dir, parts), MAX_TOKENS, "causal first: ")
    first = generate(llama_server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    assert first["meta_info"]["cached_tokens"] <= start, "a causal span's cache must not serve a block"
    _check(first, llama_dir, parts, "block after its causal twin: ")
    repeat = generate(llama_server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    assert repeat["meta_info"]["cached_tokens"] >= end, "a repeat of the same block hits the cache past it"
    _check(repeat, llama_dir, parts, "repeat: ")


def test_a_batch_mixing_blocks_and_causal_spans(llama_server, llama_dir):
    block_parts, causal_parts = PROMPTS["a block after text"], ["the sky", _rows(9, 8), " is"]
    out = generate(llama_server, {
        "input_segments": [_segments(block_parts), _segments(causal_parts, bidirectional=False)],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS}, **OUTPUT_LOGPROBS})
    _check(out[0], llama_dir, block_parts, "batched block: ")
    ref.assert_matches_hf(out[1], llama_dir, reference_embeds(llama_dir, causal_parts), MAX_TOKENS, "batched causal: ")


@pytest.mark.parametrize("value", ["sideways", 1, True])
def test_an_unknown_attention_is_a_400(llama_server, value):
    segments = _segments(["the red fox", _rows(0, 4)])
    segments[1][seg.ATTENTION] = value
    r = llama_server.generate(body(segments, 4))
    assert r.status_code == 400 and "attention must be 'causal' or 'bidirectional'" in error_message(r), r.text
    assert llama_server.generate(body(_segments(["the red fox", _rows(0, 4)]), 4)).status_code == 200


def test_every_route_carries_a_block(llama_server, llama_dir):
    """By handle, in a binary body and as an OpenAI chat part, a bidirectional span gives what the
    inline one gives, which is HF's with the block (the chat part: its first tokens)."""
    parts = PROMPTS["a block after text"]
    inline = generate(llama_server, body(_segments(parts), MAX_TOKENS, **OUTPUT_LOGPROBS))
    _check(inline, llama_dir, parts, "inline: ")
    up = requests.post(llama_server.url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(parts[1])}, timeout=60)
    assert up.status_code == 200, up.text
    handle_segments = _segments(parts)
    handle_segments[1]["embeds"] = {"handle": up.json()["handle"]}
    assert generate(llama_server, body(handle_segments, MAX_TOKENS))["output_ids"] == inline["output_ids"]
    binary_segments = _segments(parts)
    binary_segments[1]["embeds"] = parts[1]
    raw, content_type = binary_body.encode_body(body(binary_segments, MAX_TOKENS))
    r = requests.post(llama_server.url + "/generate", data=raw, headers={"Content-Type": content_type}, timeout=120)
    assert r.status_code == 200 and r.json()["output_ids"] == inline["output_ids"], r.text
    completion = requests.post(llama_server.url + "/v1/completions", json={
        "model": "default", "max_tokens": MAX_TOKENS, "temperature": 0, "input_segments": _segments(parts)}, timeout=60)
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == inline["text"], completion.text

    def chat_logprobs(attention: str) -> list[float]:
        part = {"type": "input_embeds", "input_embeds": wire.encode_tensor(parts[1]), seg.ATTENTION: attention}
        r = requests.post(llama_server.url + "/v1/chat/completions", json={
            "model": "default", "max_tokens": 4, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": parts[0]}, part]}]}, timeout=60)
        assert r.status_code == 200, r.text
        return [e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]]

    both_ways, causal = chat_logprobs(seg.BIDIRECTIONAL), chat_logprobs(seg.CAUSAL)
    assert abs(both_ways[0] - causal[0]) > 1e-3, "a chat part's attention must reach the extend step"


def test_a_vlm_served_natively_refuses_a_block_and_keeps_serving(qwen_vl_spans_server):
    """A Qwen-VL attends its image rows as its own model does: a bidirectional image span is a
    400 saying so, and the same span sent causally is served."""
    from qwen_vl_harness import grid_span, span_segments
    from sgl_embeds_testing.encoders import synthetic_scene
    from sgl_embeds_testing.qwen_vl import IMAGE_PLACEHOLDER, tiny_qwen2_5_vl_dir

    span_dict, text = grid_span(tiny_qwen2_5_vl_dir(), synthetic_scene()), f"{IMAGE_PLACEHOLDER} what is it"
    segments = span_segments(text, [{**span_dict, seg.ATTENTION: seg.BIDIRECTIONAL}])
    r = qwen_vl_spans_server.generate(body(segments, 4))
    assert r.status_code == 400 and "served natively attends its image rows" in error_message(r), r.text
    assert qwen_vl_spans_server.generate(body(span_segments(text, [span_dict]), 4)).status_code == 200


def test_retraction_keeps_blocks_exact(llama_server, constrained_server, llama_dir):
    """8 concurrent block prompts of ~34 positions + 40 new tokens overflow the constrained
    server's 256 KV slots: requests are retracted and prefilled again (their blocks cut by
    16-position chunks, a hit inside a block from the same block), and every answer equals the
    one the roomy server gives alone, which is HF's with the same mask over all 40 tokens."""
    def matches_hf(segments: list, out: dict) -> None:
        parts = helpers.segment_parts(segments)
        ref.assert_matches_hf(out, llama_dir, reference_embeds(llama_dir, parts), 40, "retracted: ",
                              blocks=_blocks(llama_dir, parts))

    helpers.assert_retraction_keeps_outputs(llama_server, constrained_server, lambda attempt: [
        _segments(["one two", _rows(600 + 10 * attempt + i, 30), " three"]) for i in range(8)], matches_hf)
