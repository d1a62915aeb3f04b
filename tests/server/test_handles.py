"""Span handles over HTTP: upload once, refer by handle everywhere (the store itself:
``unit/test_span_store.py``)."""

from __future__ import annotations

import pytest
import requests
import torch

from helpers import LOGPROBS, OUTPUT_LOGPROBS, body, generate, reference_embeds, seeded_rows, span, text, with_other_spans
from sgl_embeds_protocol import wire
from sgl_embeds_testing import reference as ref



def test_upload_once_and_refer_by_handle_everywhere(llama_server):
    url = llama_server.url
    rows = torch.randn(10, 64, generator=torch.Generator().manual_seed(42)) * 0.05
    up = requests.post(url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(rows)}, timeout=60)
    assert up.status_code == 200, up.text
    handle = up.json()["handle"]
    assert up.json()["shape"] == [10, 64] and handle.startswith("span-")
    again = requests.post(url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(rows, "json")}, timeout=60).json()
    assert again["handle"] == handle
    inline = generate(llama_server, body([text("the fox"), span(rows)], 8, **LOGPROBS))
    by_handle = generate(llama_server, body([text("the fox"), {"type": "embeds", "embeds": {"handle": handle}}], 8,
                                            **OUTPUT_LOGPROBS))
    assert by_handle["output_ids"] == inline["output_ids"]
    prompt = reference_embeds(llama_server.model_dir, ["the fox", rows])
    other = reference_embeds(llama_server.model_dir, ["the fox", rows.flip(0)])
    for out in (inline, by_handle):
        ref.assert_matches_hf(out, llama_server.model_dir, prompt, 8, other_span_embeds=other)
    assert by_handle["meta_info"]["cached_tokens"] >= 10  # same rows, same placeholders, same cache
    full = generate(llama_server, {"input_embeds": {"handle": handle}, "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                                   **OUTPUT_LOGPROBS})
    assert full["meta_info"]["prompt_tokens"] == 10
    ref.assert_matches_hf(full, llama_server.model_dir, rows, 8, "whole prompt by handle: ", other_span_embeds=rows.flip(0))
    def chat(part):
        r = requests.post(url + "/v1/chat/completions", json={"model": "default", "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "input_embeds", "input_embeds": part}]}]}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    chat_inline, chat_by_handle = chat(wire.encode_tensor(rows)), chat({"handle": handle})
    assert chat_by_handle["choices"][0]["message"]["content"] == chat_inline["choices"][0]["message"]["content"]
    assert chat_by_handle["usage"]["prompt_tokens"] == chat_inline["usage"]["prompt_tokens"]
    info = requests.get(url + "/sgl_embeds/info", timeout=30).json()["span_store"]
    assert info["count"] >= 1 and info["bytes"] >= 10 * 64 * 4
    assert requests.delete(url + f"/sgl_embeds/spans/{handle}", timeout=30).json() == {"deleted": True}
    assert requests.delete(url + f"/sgl_embeds/spans/{handle}", timeout=30).status_code == 404
    gone = llama_server.generate(body([text("the fox"), {"type": "embeds", "embeds": {"handle": handle}}], 2))
    assert gone.status_code == 400 and "unknown span handle" in gone.json()["message"]


@pytest.mark.parametrize("payload, message", [
    ({"embeds": wire.encode_tensor(torch.zeros(2, 65))}, "hidden size 65"),
    ({"embeds": wire.encode_tensor(torch.full((1, 64), float("inf")))}, "NaN or Inf"),
    ({"tensor": [[0.0] * 64]}, "upload a span as"),
    ({"embeds": {"handle": "span-x", "data": "AAAA"}}, "unknown keys"),
])
def test_bad_uploads_are_400s(llama_server, payload, message):
    r = requests.post(llama_server.url + "/sgl_embeds/spans", json=payload, timeout=60)
    assert r.status_code == 400 and message in r.json()["message"], r.text


def test_a_kept_span_crosses_to_the_scheduler_once(llama_server):
    """After its first request a span sent by handle stays in the HTTP process; the scheduler
    uses the rows it kept (srt/transport.py), also when the cache no longer holds the span."""
    url, model_dir = llama_server.url, llama_server.model_dir
    rows, other = seeded_rows(77, 24), seeded_rows(78, 24)
    handle = requests.post(url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(rows)}, timeout=60).json()["handle"]
    by_handle = {"type": "embeds", "embeds": {"handle": handle}}

    def counts() -> dict:
        return requests.get(url + "/sgl_embeds/info", timeout=30).json()["rows_to_scheduler"]

    start = counts()
    assert start["on"]
    generate(llama_server, body([text("the fox"), by_handle], 2))
    first = counts()
    assert (first["rows_sent"] - start["rows_sent"], first["rows_left_out"] - start["rows_left_out"]) == (24, 0)
    assert requests.post(url + "/flush_cache", timeout=60).status_code == 200
    out = generate(llama_server, body([text("a cat"), by_handle, text(" is")], 8, **OUTPUT_LOGPROBS))
    again = counts()
    assert (again["rows_sent"] - first["rows_sent"], again["rows_left_out"] - first["rows_left_out"]) == (0, 24)
    assert out["meta_info"]["cached_tokens"] == 0  # the span's KV was computed from the kept rows
    parts = ["a cat", rows, " is"]
    ref.assert_matches_hf(out, model_dir, reference_embeds(model_dir, parts), 8,
                          other_span_embeds=reference_embeds(model_dir, with_other_spans(parts)))
    mixed = generate(llama_server, body([text("a cat"), by_handle, text(" and"), span(other)], 8))
    inline = generate(llama_server, body([text("a cat"), span(rows), text(" and"), span(other)], 8))
    assert mixed["output_ids"] == inline["output_ids"]
    # the handle's rows stayed; an inline span crosses once too (its key is its rows' hash, here
    # the handle's): `other` crossed in the first request, nothing in the second
    last = counts()
    assert (last["rows_sent"] - again["rows_sent"], last["rows_left_out"] - again["rows_left_out"]) == (24, 24 + 48)
    held = last["held_spans"]
    assert requests.delete(url + f"/sgl_embeds/spans/{handle}", timeout=30).json() == {"deleted": True}
    assert counts()["held_spans"] == held - 1
