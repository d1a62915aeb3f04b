"""The binary request body through a real server (``binary_body.py``): a prompt sent as a binary
body gives what its JSON form gives (the same rows, so the same placeholder ids and cache), on
``/generate`` (``EmbedsEndpoint.run`` too) and the upload route; a bad one is a 400 naming the
fault, and the server keeps serving; under granian (SGLang's ``--enable-http2``) the same answers
as under uvicorn."""

from __future__ import annotations

import pytest
import requests

from helpers import GREEDY, LOGPROBS, body, generate, seeded_rows, span, text
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_protocol import binary_body, keys
from sgl_embeds_protocol.segments import Span, Text


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


@pytest.mark.pooled("gateway_worker")
def test_under_granian_a_binary_body_gives_what_uvicorn_gives(llama_server, servers):
    """The pool's second Llama server runs granian (``GRANIAN_ARGS``), the first uvicorn, on the
    same weights: a span prompt as a binary body gets the same output ids and logprobs from both,
    a 5 MB span (many chunks of the body read) is held under the handle its rows give, and a
    malformed body is a 400 after which the server keeps serving."""
    granian = servers.get("gateway_worker")[0]
    for server, name in ((granian, "granian"), (llama_server, "uvicorn")):
        assert requests.get(server.url + "/health", timeout=30).headers.get("server") == name
    request = {**body([text("the fox"), {"type": "embeds", "embeds": seeded_rows(304, 12)},
                       text(" is")], 8), **LOGPROBS}
    # bit equality holds where both compute the same shapes: neither may reuse a cached prefix
    # (an earlier test sends this prompt to the uvicorn server)
    for server in (granian, llama_server):
        assert requests.post(server.url + "/flush_cache", timeout=60).status_code == 200
    got, want = post_binary(granian, request), post_binary(llama_server, request)
    assert got.status_code == 200 and want.status_code == 200, (got.text, want.text)
    assert got.json()["meta_info"]["cached_tokens"] == want.json()["meta_info"]["cached_tokens"] == 0
    assert got.json()["output_ids"] == want.json()["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert got.json()["meta_info"][key] == want.json()["meta_info"][key], key
    large = seeded_rows(305, 20_000)
    up = post_binary(granian, {"embeds": large}, path="/sgl_embeds/spans")
    assert up.status_code == 200 and up.json()["handle"] == keys.content_key(large), up.text
    truncated = post_binary(granian, request, cut=8)
    assert truncated.status_code == 400 and "end past" in truncated.json()["message"], truncated.text
    assert post_binary(granian, request).json()["output_ids"] == want.json()["output_ids"]
