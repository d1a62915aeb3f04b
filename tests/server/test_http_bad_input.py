"""Bad span input: HTTP 400 naming the problem, and the server keeps serving everyone else."""

from __future__ import annotations

import base64

import requests
import torch

from helpers import body, generate, span, text
from sgl_embeds_protocol import wire

GOOD = torch.randn(3, 64) * 0.05


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def _seg(embeds) -> dict:
    return body([text("the fox"), {"type": "embeds", "embeds": embeds}])


BAD = {
    "wrong hidden size": (_seg(wire.encode_tensor(torch.zeros(2, 65))), "hidden size 65 but the model's hidden size is 64"),
    "ragged rows": (_seg([[0.0] * 64, [0.0] * 63]), "ragged"),
    "empty span": (_seg([]), "empty"),
    "nan": (_seg(wire.encode_tensor(torch.full((2, 64), float("nan")))), "NaN or Inf"),
    "inf in json": (_seg([[1e39] * 64]), "NaN or Inf"),
    "unknown dtype": (_seg({"data": _b64(torch.zeros(2, 64)), "dtype": "float64", "shape": [1, 64]}), "unknown dtype"),
    "shape vs bytes": (_seg({"data": _b64(torch.zeros(2, 64)), "dtype": "float32", "shape": [3, 64]}), "cannot hold shape"),
    "malformed base64": (_seg({"data": "*" * 344, "dtype": "float32", "shape": [1, 64]}), "malformed base64"),
    "oversized payload": (_seg({"data": "AAAA", "dtype": "float32", "shape": [1 << 22, 64]}), "size limit"),
    "too long for context": ({"input_embeds": wire.encode_tensor(torch.zeros(1100, 64)), "sampling_params": {"max_new_tokens": 1}}, "context length"),
    "unknown segment type": (body([{"type": "video"}]), "unknown type"),
    "text and segments": ({"text": "x", "input_segments": [text("y")]}, "cannot be combined"),
    "out of vocab ids": (body([{"type": "input_ids", "input_ids": [5, 100000]}]), "outside the vocabulary"),
}


def test_each_bad_input_gets_a_400_and_the_server_keeps_serving(llama_server):
    for name, (payload, message) in BAD.items():
        r = llama_server.generate(payload)
        assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:300]}"
        assert message in r.json()["message"], f"{name}: {r.json()['message']}"
    out = generate(llama_server, body([text("the fox"), span(GOOD)], 4))
    assert len(out["output_ids"]) == 4
    assert llama_server.alive()


def test_fields_stock_generate_ignores_are_ignored_with_spans_too(llama_server):
    """A gateway in front adds ``model``; stock /generate drops fields it does not know."""
    plain = generate(llama_server, body([text("the fox"), span(GOOD)], 4))
    extra = generate(llama_server, {**body([text("the fox"), span(GOOD)], 4), "model": "default", "no_such_field": 1})
    assert extra["output_ids"] == plain["output_ids"]
    stock = llama_server.generate({"text": "the fox", "model": "default", "no_such_field": 1, "sampling_params": {"max_new_tokens": 2}})
    assert stock.status_code == 200, stock.text


def test_a_huge_declared_shape_is_refused_before_decoding(llama_server):
    # the decoded-span budget (SGLANG_EMBEDS_MAX_BYTES, 256 MiB) is checked against the declared shape
    r = llama_server.generate(_seg({"data": "A" * 8, "dtype": "bfloat16", "shape": [1 << 26, 64]}))
    assert r.status_code == 400 and "size limit" in r.json()["message"]
    assert "SGLANG_EMBEDS_MAX_BYTES" in r.json()["message"], "a refusal names the setting that sizes it"


def test_malformed_json_still_gets_the_stock_error(llama_server):
    r = requests.post(llama_server.url + "/generate", data=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500
