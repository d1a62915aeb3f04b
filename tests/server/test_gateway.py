"""Span prompts behind SGLang's own gateway (smg 1.13.0, cache-aware policy, two plugin workers).

Every form is compared with the same request sent to a worker directly (greedy output ids), the
routing target of docs/scaling.md is measured, a handle a worker does not hold is resent inline,
and a stream of malformed span requests leaves both workers in rotation.
"""

from __future__ import annotations

import functools
import json

import openai
import pytest
import requests
import sglang as sgl
import torch
from sglang.lang.backend import runtime_endpoint

from helpers import GREEDY, body, seeded_rows, span, text
from sgl_embeds import sender as sender_module
from sgl_embeds_protocol import keys, wire
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_protocol.segments import Span, Text
from sgl_embeds_testing.server import Gateway


def _post(url: str, payload: dict, path: str = "/generate") -> requests.Response:
    data = json.dumps(payload)  # allows NaN / Infinity, as a careless client would send them
    return requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=120)


def _message(r: requests.Response) -> str:
    """The error message of a worker's body (``message``) or of the gateway's (``error.message``)."""
    try:
        payload = r.json()
    except ValueError:
        return r.text
    return payload.get("message") or (payload.get("error") or {}).get("message", "")


def _ok(url: str, payload: dict, path: str = "/generate") -> dict | list:
    r = _post(url, payload, path)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(out: dict | list) -> list:
    return [o["output_ids"] for o in out] if isinstance(out, list) else out["output_ids"]


def _store_count(server) -> int:
    return requests.get(server.url + "/sgl_embeds/info", timeout=30).json()["span_store"]["count"]


def test_generate_forms_through_the_gateway_equal_direct(gateway):
    direct = gateway.workers[0].url
    a, b = seeded_rows(1401, 12), seeded_rows(1402, 7)
    segments = [text("Look at"), span(a), text(" then")]
    hint = keys.routing_text([Text("Look at"), Span(a), Text(" then")])
    forms = {
        "segments": body(segments, 8),
        "segments + routing hint": body(segments, 8, text=hint),
        "segments as JSON lists": body([text("Look at"), span(a, "json"), text(" then")], 8),
        "batch of segment lists": body([segments, [span(b), text(" and")]], 6),
        "a bidirectional span": body([text("Look at"), {**span(a * 10), "attention": "bidirectional"}, text(" then")], 8),
        "full-prompt input_embeds": {"input_embeds": wire.encode_tensor(a), "sampling_params": {**GREEDY, "max_new_tokens": 8}},
        "full-prompt batch": {"input_embeds": [wire.encode_tensor(a), wire.encode_tensor(b)],
                              "sampling_params": {**GREEDY, "max_new_tokens": 6}},
    }
    for name, payload in forms.items():
        through, alone = _ok(gateway.url, payload), _ok(direct, payload)
        assert _ids(through) == _ids(alone), name
    # the block reaches the worker's extend step through the gateway: attended causally, the same
    # rows give another answer
    def first_logprob(attention: str) -> float:
        payload = body([text("Look at"), {**span(a * 10), "attention": attention}, text(" then")], 1, return_logprob=True)
        return _ok(gateway.url, payload)["meta_info"]["output_token_logprobs"][0][0]

    assert abs(first_logprob("bidirectional") - first_logprob("causal")) > 1e-3
    # the outputs depend on the span (not a degenerate model): another span, other ids
    assert _ids(_ok(gateway.url, body([text("Look at"), span(b), text(" then")], 8))) != _ids(_ok(direct, forms["segments"]))

    stream = requests.post(gateway.url + "/generate", json={**forms["segments"], "stream": True}, stream=True, timeout=120)
    assert stream.status_code == 200
    chunks = [json.loads(line[5:]) for line in stream.iter_lines(decode_unicode=True)
              if line and line.startswith("data:") and line != "data: [DONE]"]
    assert len(chunks) >= 2 and chunks[-1]["text"] == _ok(direct, forms["segments"])["text"]


def test_openai_routes_through_the_gateway_equal_direct(gateway):
    """The official client, through the gateway and direct: completions with segments (the
    ``prompt`` carries the routing hint), chat with span parts and with a top-level span."""
    rows = seeded_rows(1411, 9)
    clients = [openai.OpenAI(base_url=url + "/v1", api_key="none") for url in (gateway.url, gateway.workers[0].url)]
    model = clients[1].models.list().data[0].id  # the gateway routes by the served model's name
    hint = keys.routing_text([Text("Describe "), Span(rows)])
    results = []
    for client in clients:
        completion = client.completions.create(
            model=model, prompt=hint, max_tokens=6, temperature=0,
            extra_body={"input_segments": [text("Describe "), span(rows)]})
        chat = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                         {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows)}]}])
        hinted = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                         {"type": "text", "text": keys.routing_text([Span(rows)])},
                                         {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows)}]}])
        whole = client.chat.completions.create(model=model, max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": hint}],
                                               extra_body={"input_embeds": wire.encode_tensor(rows)})
        results.append([(r.choices[0].text if hasattr(r.choices[0], "text") else r.choices[0].message.content,
                         r.usage.prompt_tokens) for r in (completion, chat, hinted, whole)])
    assert results[0] == results[1]
    same_prompt = _ok(gateway.workers[0].url, body([text("Describe "), span(rows)], 1))["meta_info"]["prompt_tokens"]
    assert results[0][0][1] == same_prompt  # the hint in prompt was not tokenized into the prompt
    assert results[0][2] == results[0][1]  # a hint part is dropped: the same prompt as without it
    assert results[0][3][1] == len(rows)  # the whole prompt is the span: the message text was only a hint
    other = clients[0].completions.create(model=model, prompt=keys.routing_text([Text("Describe "), Span(rows.flip(0))]),
                                          max_tokens=6, temperature=0,
                                          extra_body={"input_segments": [text("Describe "), span(rows.flip(0))]})
    assert other.choices[0].text != results[0][0][0], "through the gateway the span must change the answer"


@sgl.function
def describe_and_choose(s, rows):
    s += "Look: " + sgl.embeds(rows) + " It is"
    s += sgl.gen("what", max_tokens=6, temperature=0)
    s += " Verdict:" + sgl.select("verdict", choices=[" yes", " no", " maybe"])
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f" Part {i}:" + sgl.gen("part", max_tokens=4, temperature=0)
    s["parts"] = [branch["part"] for branch in branches]


def _program_outputs(backend, spans):
    states = describe_and_choose.run_batch([{"rows": r} for r in spans], backend=backend)
    single = describe_and_choose.run(rows=spans[0], backend=backend)
    out = [(st["what"], st["verdict"], st["parts"]) for st in [*states, single]]
    run = backend.run(input_segments=[Text("Look: "), Span(spans[0])], sampling_params={**GREEDY, "max_new_tokens": 6})
    whole = backend.run(input_embeds=spans[1], sampling_params={**GREEDY, "max_new_tokens": 6})
    return out, run["output_ids"], whole["output_ids"]


def test_programs_and_run_through_the_gateway_equal_direct(gateway):
    spans = [seeded_rows(1421 + i, 10) for i in range(3)]
    through = _program_outputs(EmbedsEndpoint(gateway.url, chat_template_name="chatml"), spans)
    alone = _program_outputs(EmbedsEndpoint(gateway.workers[0].url, chat_template_name="chatml"), spans)
    assert through == alone
    assert len({what for what, _, _ in through[0]}) >= 2  # the answers depend on the span


def test_a_handle_a_worker_does_not_hold_is_resent_inline_once(gateway, monkeypatch):
    first, second = gateway.workers
    rows = seeded_rows(1431, 16)
    handle = keys.content_key(rows)
    refused = _post(second.url, body([text("see"), {"type": "embeds", "embeds": {"handle": handle}}], 4))
    assert refused.status_code == 400
    assert refused.json()["type"] == "UnknownSpanHandle" and refused.json()["param"] == handle

    sent: list[dict] = []
    real = sender_module.http_request

    def recording(url, json=None, **kwargs):
        sent.append(json)
        return real(url, json=json, **kwargs)

    monkeypatch.setattr(sender_module, "http_request", recording)  # run()
    # programs: the stock RuntimeEndpoint calls post through our hook, here around the recorder
    monkeypatch.setattr(runtime_endpoint, "http_request", functools.partial(sender_module.post_stock_body, recording))
    ep = EmbedsEndpoint(first.url, send_binary=False)  # run() posts JSON, through http_request
    prompt = [Text("see"), Span(rows)]

    def run() -> list[int]:
        return ep.run(input_segments=prompt, sampling_params={**GREEDY, "max_new_tokens": 6})["output_ids"]

    def span_of(b: dict) -> dict:
        return b["input_segments"][1]["embeds"]

    expected = run()
    assert sent[-1]["keep_spans"] is True and "data" in span_of(sent[-1])  # first time: rows inline, kept
    assert run() == expected and span_of(sent[-1]) == {"handle": handle} and "keep_spans" not in sent[-1]
    before = _store_count(second)
    ep.base_url = second.url  # as if the gateway had sent the next request to the other worker
    n = len(sent)
    assert run() == expected
    assert [span_of(b) == {"handle": handle} for b in sent[n:]] == [True, False]  # by handle, refused, then inline
    assert sent[-1]["keep_spans"] is True and _store_count(second) == before + 1
    n = len(sent)
    assert run() == expected and len(sent) == n + 1 and span_of(sent[-1]) == {"handle": handle}

    # a program too: its gen is resent inline when the handle has gone (deleted here)
    assert requests.delete(second.url + f"/sgl_embeds/spans/{handle}", timeout=30).status_code == 200
    n = len(sent)
    state = describe_and_choose.run(rows=rows, backend=ep)
    alone = describe_and_choose.run(rows=rows, backend=EmbedsEndpoint(first.url, span_handles=False))
    assert (state["what"], state["verdict"], state["parts"]) == (alone["what"], alone["verdict"], alone["parts"])
    singles = [b for b in sent[n:] if b and isinstance(b.get("input_segments", [None])[0], dict)]
    assert [span_of(b) == {"handle": handle} for b in singles[:2]] == [True, False]  # refused, then inline


def test_run_through_the_gateway_falls_back_to_json_once_and_equals_direct(gateway, monkeypatch):
    """smg reads /generate bodies as JSON, so it refuses a binary body that a worker takes: the
    endpoint sends that request once more as JSON and JSON from then on; the answers are the
    worker's own to the binary body."""
    rows = seeded_rows(1481, 12)
    prompt = [Text("Look at"), Span(rows), Text(" then")]
    params = {**GREEDY, "max_new_tokens": 8}
    # no handles: each run() is one post, two where its binary body is refused (a handle could be
    # refused too, by a worker that does not hold it)
    through = EmbedsEndpoint(gateway.url, span_handles=False)
    direct = EmbedsEndpoint(gateway.workers[0].url, span_handles=False)
    assert through.sends_binary and direct.sends_binary  # the gateway forwards the advertisement

    sent: list[tuple[str, str]] = []  # (url, body form) of each post
    binary_post, json_post = sender_module._post_bytes, sender_module.http_request

    def recording_binary(url, *args, **kwargs):
        sent.append((url, "binary"))
        return binary_post(url, *args, **kwargs)

    def recording_json(url, **kwargs):
        sent.append((url, "json"))
        return json_post(url, **kwargs)

    monkeypatch.setattr(sender_module, "_post_bytes", recording_binary)
    monkeypatch.setattr(sender_module, "http_request", recording_json)
    alone = direct.run(input_segments=prompt, sampling_params=params)
    first = through.run(input_segments=prompt, sampling_params=params)
    again = through.run(input_segments=prompt, sampling_params=params)
    assert first["output_ids"] == again["output_ids"] == alone["output_ids"]
    assert direct.sends_binary and not through.sends_binary
    worker, smg = gateway.workers[0].url + "/generate", gateway.url + "/generate"
    assert sent == [(worker, "binary"), (smg, "binary"), (smg, "json"), (smg, "json")]


def test_cache_aware_routing_sends_a_repeated_span_to_its_worker(gateway):
    """8 distinct 40-row spans, asked about 3 times each in interleaved order: the repeats hit the
    worker that holds their span (the span-blind gateway gets about half, docs/scaling.md)."""
    # A gateway of its own: smg sends a miss to the worker whose prefix tree is smallest, so the
    # shared gateway's history from earlier tests could send all 8 new spans to one worker.
    fresh = Gateway(gateway.worker_urls).start()
    try:
        _repeats_hit_their_worker(fresh, gateway.workers)
    finally:
        fresh.stop()


def _repeats_hit_their_worker(gateway: Gateway, workers: list) -> None:
    ep = EmbedsEndpoint(gateway.url)
    spans = [seeded_rows(1441 + i, 40) for i in range(8)]
    stored = [_store_count(w) for w in workers]
    cached = []
    for question in range(3):
        for rows in spans:
            out = ep.run(input_segments=[Text("Look:"), Span(rows), Text(f" question {question}")],
                         sampling_params={**GREEDY, "max_new_tokens": 1})
            if question:
                cached.append(out["meta_info"]["cached_tokens"])
    hits = sum(c >= 40 for c in cached) / len(cached)  # a miss caches only the shared text before the span
    print(f"repeat requests whose cached_tokens cover the span: {hits:.2%} ({cached})")
    assert hits == 1, cached  # each of the 16 repeats on the worker that holds its span
    # every span was held by a worker; which worker smg sends a miss to is smg's choice, not ours
    # to assert (it sent all 8 to one in a full run on another machine, issue #48)
    spread = [_store_count(w) - s for w, s in zip(workers, stored)]
    assert sum(spread) >= 8, spread


BAD_SPANS = [
    ("wrong hidden size", lambda i: body([span(torch.zeros(2, 32))], 2)),
    ("NaN", lambda i: body([text("a"), {"type": "embeds", "embeds": [[float("nan")] * 64]}], 2)),
    ("infinite", lambda i: body([span(torch.full((1, 64), float("inf")))], 2)),
    ("ragged rows", lambda i: body([{"type": "embeds", "embeds": [[0.0] * 64, [0.0] * 63]}], 2)),
    ("bad dtype", lambda i: body([{"type": "embeds", "embeds": {"data": "AAAA", "dtype": "int8", "shape": [1, 4]}}], 2)),
    ("truncated base64", lambda i: body([{"type": "embeds", "embeds": {**wire.encode_tensor(torch.zeros(2, 64)), "data": "AAAA"}}], 2)),
    ("huge declared shape", lambda i: body([{"type": "embeds", "embeds": {"data": "", "dtype": "float32", "shape": [1 << 20, 1 << 16]}}], 2)),
    ("unknown segment type", lambda i: body([{"type": "image", "url": "x"}], 2)),
    ("unknown handle", lambda i: body([{"type": "embeds", "embeds": {"handle": f"span-{i:064x}"}}], 2)),
    ("text that is not a routing hint", lambda i: body([span(torch.zeros(1, 64))], 2, text="hello")),
    ("keep_spans not a bool", lambda i: body([span(torch.zeros(1, 64))], 2, keep_spans="yes")),
    ("out-of-vocabulary id", lambda i: body([{"type": "input_ids", "input_ids": [1, 10**9]}, span(torch.zeros(1, 64))], 2)),
]


def test_malformed_span_requests_never_take_a_worker_out_of_rotation(gateway):
    statuses = []
    for i in range(100):
        name, make = BAD_SPANS[i % len(BAD_SPANS)]
        r = _post(gateway.url, make(i))
        assert 400 <= r.status_code < 500 and _message(r), (name, r.status_code, r.text[:200])
        statuses.append(r.status_code)
    assert len(statuses) == 100
    assert sorted(gateway.healthy_workers()) == sorted(w.url for w in gateway.workers)
    stored = [_store_count(w) for w in gateway.workers]
    for i in range(20):
        rows = seeded_rows(1461 + i, 8)  # distinct spans first: nothing for the gateway to pin on
        payload = body([span(rows), text(f" valid {i}")], 2, keep_spans=True,
                       text=keys.routing_text([Span(rows), Text(f" valid {i}")]))
        _ok(gateway.url, payload)
    spread = [_store_count(w) - s for w, s in zip(gateway.workers, stored)]
    assert sum(spread) == 20 and min(spread) >= 1, spread  # both workers still take new requests
    assert sorted(gateway.healthy_workers()) == sorted(w.url for w in gateway.workers)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_the_workers_refusal_reaches_the_client_through_the_gateway(gateway, path):
    if path == "/generate":
        payload = body([span(torch.zeros(2, 32))], 2)
    else:
        model = requests.get(gateway.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        payload = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "input_embeds", "input_embeds": wire.encode_tensor(torch.zeros(2, 32))}]}]}
    through, alone = _post(gateway.url, payload, path), _post(gateway.workers[0].url, payload, path)
    assert through.status_code == alone.status_code == 400
    assert "hidden size 32" in through.json()["message"] and through.json()["message"] == alone.json()["message"]
