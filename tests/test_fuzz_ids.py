"""Token ids at the boundaries, on every route and form that takes ids: each hostile request gets
a 4xx that says what is wrong, and the server answers a valid request right after it.

Stock SGLang 0.5.23 passes such ids to the embedding lookup, where they kill the scheduler
process (see docs/reliability.md). Also the unit checks of the scheduler's last guard."""

from __future__ import annotations

from array import array

import pytest
import requests
import torch

from helpers import seeded_rows, span, text
from sgl_embeds_srt import scheduler, token_ids
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE
from sgl_embeds_srt.transport import PromptRows

VOCAB = 507  # the tiny Llama's (its tokenizer's size; checked against the server below)


def _hostile(vocab: int) -> list:
    return [vocab, vocab + 1, 2**31, 2**62, 2**62 + 12345, 2**63 - 1, 2**63, 2**64 + 5, -1, -3, 1.5, "7", True, None]


# a valid span prompt start on each server: a plain span, or an image span (grid 1x4x4: 4 rows)
SPAN_STARTS = {
    "llama": [text("the"), span(seeded_rows(1, 3))],
    "qwen_vl_spans": [text("the <|vision_start|>"), {**span(seeded_rows(1, 4)), "image_grid_thw": [1, 4, 4]}],
}


def _forms(bad, span_start: list) -> dict[str, tuple[str, dict, str]]:
    """Each form: its route, its body, and where its refusal must say the bad id stands."""
    one = {"max_new_tokens": 2, "temperature": 0}
    return {
        "generate ids": ("/generate", {"input_ids": [1, 2, bad], "sampling_params": one}, "input_ids[2]"),
        "generate batch ids": ("/generate", {"input_ids": [[1, 2], [3, bad]], "sampling_params": one}, "input_ids[1][1]"),
        "generate span + ids segment": ("/generate", {"input_segments": [
            *span_start, {"type": "input_ids", "input_ids": [5, bad]}], "sampling_params": one}, "segment 2: "),
        "completions ids": ("/v1/completions", {"model": "default", "prompt": [1, 2, bad], "max_tokens": 2}, "prompt[2]"),
        "completions batch ids": ("/v1/completions", {"model": "default", "prompt": [[1, 2], [bad]], "max_tokens": 2},
                                  "prompt[1][0]"),
        "chat input_ids": ("/v1/chat/completions", {"model": "default", "max_tokens": 2, "input_ids": [1, bad],
                                                    "messages": [{"role": "user", "content": "hi"}]}, "input_ids[1]"),
    }


def _message(r: requests.Response) -> str:
    payload = r.json()
    return payload.get("message") or (payload.get("error") or {}).get("message", "")


def _alive(server) -> None:
    r = requests.post(server.url + "/generate", json={"text": "the red fox", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("server_name", sorted(SPAN_STARTS))
def test_boundary_ids_get_4xx_and_never_take_the_server_down(servers, server_name):
    server = servers.get(server_name)[0]
    vocab = requests.get(server.url + "/sgl_embeds/info", timeout=30).json()["vocab_size"]
    if server_name == "llama":
        assert vocab == VOCAB
    unnamed = []  # refusals that do not say where the bad id stands
    for bad in _hostile(vocab):
        for form, (path, body, where) in _forms(bad, SPAN_STARTS[server_name]).items():
            r = requests.post(server.url + path, json=body, timeout=60)
            assert 400 <= r.status_code < 500, (form, bad, r.status_code, r.text[:300])
            if where not in _message(r):
                unnamed.append((form, bad, _message(r)[:200]))
            assert server.alive(), (form, bad)
        _alive(server)
    assert not unnamed, "\n".join(map(str, unnamed))
    # the last valid id is served on every form
    for form, (path, body, _) in _forms(vocab - 1, SPAN_STARTS[server_name]).items():
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


def test_first_bad_position_skips_span_rows_only():
    assert token_ids.first_bad_position([1, 2, 3], 10) is None
    assert token_ids.first_bad_position([1, -1, 3], 10) == 1
    assert token_ids.first_bad_position([1, PLACEHOLDER_BASE, 3], 10, span_positions=[1]) is None
    assert token_ids.first_bad_position([PLACEHOLDER_BASE, 10, PLACEHOLDER_BASE], 10, span_positions=[0]) == 1
    assert token_ids.first_bad_position([1, 2**64, 3], 10) == 1  # beyond int64


class _FakeReq:
    """Just what the guard reads and writes of SGLang's ``Req``; ``span_positions``: a span
    prompt whose rows stand there (as ``scheduler.req_init`` leaves it)."""

    def __init__(self, ids, span_positions=None):
        self.origin_input_ids, self.vocab_size, self.input_embeds = array("q", ids), 10, None
        self.positional_embed_overrides = (
            None if span_positions is None
            else PromptRows(torch.zeros(len(span_positions), 4), span_positions, span_prompt=True))
        self.aborted = None

    def set_finish_with_abort(self, message):
        self.aborted = message


def test_the_scheduler_guard_aborts_only_the_bad_request():
    good = _FakeReq([1, PLACEHOLDER_BASE + 1, 3], span_positions=[1])
    assert not scheduler.abort_unlookupable(good) and good.aborted is None
    stray = _FakeReq([1, PLACEHOLDER_BASE + 1, PLACEHOLDER_BASE + 2], span_positions=[1])
    assert scheduler.abort_unlookupable(stray)
    assert "at position 2" in stray.aborted and "without its rows" in stray.aborted
    assert stray.positional_embed_overrides is None
    negative = _FakeReq([1, -4])
    assert scheduler.abort_unlookupable(negative) and "token id -4" in negative.aborted


@pytest.mark.parametrize("ids, where", [([1, 2**63], "input_ids[1]"), ([[1], [0.5]], "input_ids[1][0]"), ("1 2", "input_ids")])
def test_check_id_lists_names_the_place(ids, where):
    with pytest.raises(ValueError, match=where.replace("[", "\\[").replace("]", "\\]")):
        token_ids.check_id_lists(ids, VOCAB, "input_ids")
