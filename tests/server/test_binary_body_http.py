"""The binary request body through a real server (``binary_body.py``): a prompt sent as a binary
body gives what its JSON form gives (the same rows, so the same placeholder ids and cache), on
``/generate`` (``EmbedsEndpoint.run`` too) and the upload route; a bad one is a 400 naming the
fault, and the server keeps serving."""

from __future__ import annotations

import requests

from helpers import GREEDY, LOGPROBS, body, generate, seeded_rows, span, text
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_srt import binary_body, keys
from sgl_embeds_srt.segments import Span, Text


def post_binary(server, request: dict, path: str = "/generate", cut: int = 0) -> requests.Response:
    """``request`` (its spans tensors) as a binary body, its last ``cut`` bytes left out."""
    raw, content_type = binary_body.encode_body(request)
    return requests.post(server.url + path, data=raw[:len(raw) - cut],
                         headers={"Content-Type": content_type}, timeout=120)


def test_a_binary_body_gives_what_its_json_form_gives(llama_server):
    rows = seeded_rows(301, 12)
    as_json = generate(llama_server, body([text("the fox"), span(rows), text(" is")], 8))
    binary = post_binary(llama_server, body([text("the fox"), {"type": "embeds", "embeds": rows},
                                             text(" is")], 8))
    assert binary.status_code == 200, binary.text
    assert binary.json()["output_ids"] == as_json["output_ids"]
    assert binary.json()["meta_info"]["cached_tokens"] >= 12  # the JSON request's span, cached
    up = post_binary(llama_server, {"embeds": rows}, path="/sgl_embeds/spans")
    assert up.status_code == 200 and up.json()["handle"] == keys.content_key(rows), up.text
    by_handle = generate(llama_server, body([text("the fox"), {"type": "embeds", "embeds": {
        "handle": up.json()["handle"]}}, text(" is")], 8))
    assert by_handle["output_ids"] == as_json["output_ids"]


def test_run_over_the_binary_body_equals_the_json_path(llama_server):
    """``EmbedsEndpoint.run`` straight to the server sends its spans as a binary body; the output
    ids and logprobs (of every position: neither request hits the prefix cache) are the JSON
    path's."""
    prompt = [Text("the fox"), Span(seeded_rows(303, 12)), Text(" is")]
    ask = {"sampling_params": {**GREEDY, "max_new_tokens": 8}, **LOGPROBS}
    binary = EmbedsEndpoint(llama_server.url, span_handles=False)
    as_json = EmbedsEndpoint(llama_server.url, span_handles=False, send_binary=False)
    assert binary.sends_binary and not as_json.sends_binary
    got, want = binary.run(input_segments=prompt, **ask), as_json.run(input_segments=prompt, **ask)
    assert binary.sends_binary  # the server took the binary body (no fallback to JSON)
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert got["meta_info"][key] == want["meta_info"][key], key


def test_a_bad_binary_body_is_a_400_and_the_server_keeps_serving(llama_server):
    rows = seeded_rows(302, 4)
    request = body([text("a"), {"type": "embeds", "embeds": rows}], 2)
    truncated = post_binary(llama_server, request, cut=8)
    assert truncated.status_code == 400 and "end past" in truncated.json()["message"], truncated.text
    nan = rows.clone()
    nan[1, 2] = float("nan")
    bad = post_binary(llama_server, body([text("a"), {"type": "embeds", "embeds": nan}], 2))
    assert bad.status_code == 400 and "NaN or Inf (first in row 1)" in bad.json()["message"], bad.text
    assert post_binary(llama_server, request).status_code == 200
    info = requests.get(llama_server.url + "/sgl_embeds/info", timeout=30).json()
    assert info["binary_body"] == binary_body.CONTENT_TYPE
