"""Token ids at the boundaries, on every route and form that takes ids: each hostile request gets
a 4xx that says what is wrong, and the server answers a valid request right after it; on a server
of every family served (``helpers.FAMILY_SERVERS``).

Stock SGLang 0.5.23 passes such ids to the embedding lookup, where they kill the scheduler
process (see docs/reliability.md). The unit checks of the id guards: ``unit/test_token_ids.py``."""

from __future__ import annotations

import pytest
import requests

import helpers
from helpers import seeded_rows, span, text
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE
from strategies import HELD_ROWS, held_grid

pytestmark = pytest.mark.per_server  # each family's tests where its server runs anyway
VOCAB = 507  # the tiny Llama's (its tokenizer's size; checked against the server below)


def _hostile(vocab: int) -> list:
    return [vocab, vocab + 1, 2**31, 2**62, 2**62 + 12345, 2**63 - 1, 2**63, 2**64 + 5, -1, -3, 1.5, "7", True, None]


def _span_start(info: dict) -> list:
    """A valid span prompt start on a server (its /sgl_embeds/info): a plain span, or on an M-RoPE
    VLM an image span between the vision tokens."""
    rows = seeded_rows(1, HELD_ROWS, info["span_width"])
    if info["vision"] is None:
        return [text("the"), span(rows)]
    return [text("the <|vision_start|>"), {**span(rows), "image_grid_thw": held_grid(info["vision"]["merge_size"])},
            text("<|vision_end|>")]


def _forms(bad, span_start: list) -> dict[str, tuple[str, dict, str]]:
    """Each form: its route, its body, and where its refusal must say the bad id stands."""
    one = {"max_new_tokens": 2, "temperature": 0}
    return {
        "generate ids": ("/generate", {"input_ids": [1, 2, bad], "sampling_params": one}, "input_ids[2]"),
        "generate batch ids": ("/generate", {"input_ids": [[1, 2], [3, bad]], "sampling_params": one}, "input_ids[1][1]"),
        "generate span + ids segment": ("/generate", {"input_segments": [
            *span_start, {"type": "input_ids", "input_ids": [5, bad]}], "sampling_params": one},
            f"segment {len(span_start)}: "),
        "completions ids": ("/v1/completions", {"model": "default", "prompt": [1, 2, bad], "max_tokens": 2}, "prompt[2]"),
        "completions batch ids": ("/v1/completions", {"model": "default", "prompt": [[1, 2], [bad]], "max_tokens": 2},
                                  "prompt[1][0]"),
        "chat input_ids": ("/v1/chat/completions", {"model": "default", "max_tokens": 2, "input_ids": [1, bad],
                                                    "messages": [{"role": "user", "content": "hi"}]}, "input_ids[1]"),
    }


def _alive(server) -> None:
    r = requests.post(server.url + "/generate", json={"text": "the red fox", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("server_name", helpers.pooled(helpers.FAMILY_SERVERS))
def test_boundary_ids_get_4xx_and_never_take_the_server_down(servers, server_name):
    server = servers.get(server_name)[0]
    info = requests.get(server.url + "/sgl_embeds/info", timeout=30).json()
    vocab = info["vocab_size"]
    if server_name == "llama":
        assert vocab == VOCAB
    unnamed = []  # refusals that do not say where the bad id stands
    for bad in _hostile(vocab):
        for form, (path, body, where) in _forms(bad, _span_start(info)).items():
            r = requests.post(server.url + path, json=body, timeout=60)
            assert 400 <= r.status_code < 500, (form, bad, r.status_code, r.text[:300])
            if where not in helpers.error_message(r):
                unnamed.append((form, bad, helpers.error_message(r)[:200]))
            assert server.alive(), (form, bad)
        _alive(server)
    assert not unnamed, "\n".join(map(str, unnamed))
    # the last valid id is served on every form
    for form, (path, body, _) in _forms(vocab - 1, _span_start(info)).items():
        r = requests.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, (form, r.text[:300])


def test_the_refusal_names_the_field_and_the_id(llama_server):
    r = requests.post(llama_server.url + "/generate", json={"input_ids": [1, PLACEHOLDER_BASE + 7]}, timeout=60)
    assert r.status_code == 400
    assert f"input_ids[1] = {PLACEHOLDER_BASE + 7} is outside the vocabulary [0, {VOCAB})" in r.json()["message"]
    assert "span placeholder id" in r.json()["message"]


def test_span_prompts_in_a_session_are_refused_and_the_session_keeps_working(llama_server):
    sid = requests.post(llama_server.url + "/open_session", json={"capacity_of_str_len": 1000}, timeout=60).json()
    try:
        params = {"id": sid, "rid": None, "offset": -1, "replace": False}
        first = requests.post(llama_server.url + "/generate", json={"text": "the red fox", "session_params": params,
                                                                    "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert first.status_code == 200, first.text
        params["rid"] = first.json()["meta_info"]["id"]
        spans = requests.post(llama_server.url + "/generate", json={
            "input_segments": [text(" and"), span(seeded_rows(2, 4))], "session_params": params,
            "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert spans.status_code == 400 and "cannot continue a session" in spans.json()["message"]
        ids = requests.post(llama_server.url + "/generate", json={"input_ids": [3, 2**62 + 5], "session_params": params,
                                                                  "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert ids.status_code == 400
        more = requests.post(llama_server.url + "/generate", json={"text": " is", "session_params": params,
                                                                   "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert more.status_code == 200, more.text
    finally:
        requests.post(llama_server.url + "/close_session", json={"session_id": sid}, timeout=60)
    _alive(llama_server)
