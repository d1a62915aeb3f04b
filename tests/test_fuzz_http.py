"""Hostile input over HTTP: random span fields on /generate and the OpenAI routes always get a
4xx with a message (or a 200 when they happen to be valid), never a 5xx or a dead scheduler."""

from __future__ import annotations

import json

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_fuzz_wire import payloads

ROUTES = {
    "/generate": lambda p: {"input_segments": [{"type": "text", "text": "a"}, {"type": "embeds", "embeds": p}], "sampling_params": {"max_new_tokens": 1}},
    "/generate#full": lambda p: {"input_embeds": p, "sampling_params": {"max_new_tokens": 1}},
    "/v1/completions": lambda p: {"model": "default", "prompt": "", "max_tokens": 1, "input_embeds": p},
    "/v1/chat/completions": lambda p: {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "input_embeds", "input_embeds": p}]}]},
}
SEEN: dict[int, int] = {}


def _post(server, route: str, body: dict) -> requests.Response:
    # Python's json writes NaN / Infinity as bare tokens (not JSON, but what a careless client sends)
    raw = json.dumps(body, allow_nan=True).encode()
    return requests.post(server.url + route.split("#")[0], data=raw, headers={"content-type": "application/json"}, timeout=60)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(sorted(ROUTES)), payload=payloads)
def test_random_span_fields_never_cause_a_server_error(llama_server, route, payload):
    r = _post(llama_server, route, ROUTES[route](payload))
    SEEN[r.status_code] = SEEN.get(r.status_code, 0) + 1
    assert r.status_code < 500, (route, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json().get("message") or r.json().get("error"), r.text[:300]


def test_the_server_still_serves_after_the_fuzzing(llama_server):
    assert sum(SEEN.values()) == 120, SEEN  # every example was sent (and answered)
    assert llama_server.alive()
    r = llama_server.generate({"input_embeds": [[0.01] * 64] * 3, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert requests.get(llama_server.url + "/health", timeout=10).status_code == 200
