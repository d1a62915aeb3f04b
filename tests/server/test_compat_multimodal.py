"""Spans next to server-side multimodal inputs (``image_data``, ``video_data``, ``audio_data``, or an
``image_url`` chat part) are refused with a 400 that names the combination; the server keeps
serving. (Why refused, and why it cannot be checked against HF here: docs/engine.md.)"""

from __future__ import annotations

import pytest
import requests

from helpers import body, generate, seeded_rows, span, text
from sgl_embeds_protocol import wire

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("field", ["image_data", "video_data", "audio_data"])
def test_spans_with_server_side_media_are_refused_by_name(llama_server, field):
    rows = seeded_rows(1701, 4)
    for payload in (body([text("look"), span(rows)], 2), {"input_embeds": wire.encode_tensor(rows), "sampling_params": {"max_new_tokens": 2}}):
        r = llama_server.generate({**payload, field: IMAGE})
        assert r.status_code == 400 and field in r.json()["message"] and "span" in r.json()["message"], r.text
    assert generate(llama_server, body([text("look"), span(rows)], 2))["meta_info"]["prompt_tokens"] > 4


def test_a_chat_with_a_span_and_an_image_part_is_refused(llama_server):
    r = requests.post(llama_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "input_embeds", "input_embeds": wire.encode_tensor(seeded_rows(1702, 3))}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["message"], r.text
