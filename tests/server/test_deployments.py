"""Deployment shapes, on one keyed data-parallel server (``--api-key``, ``--dp-size 2`` on CPU)
and one bfloat16 server with tenants (``serve --tenants``), started together: the key covers
every new route, the plugin works in every scheduler, full-prompt embeds keep the cache on a
bfloat16 model, and tenants never share cache entries, handles or held rows, directly and
through smg."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from helpers import body, seeded_rows, span, text
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_protocol import wire
from sgl_embeds_protocol.segments import Span, Text
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.server import Gateway, Server, on_cpu, start_all, stop_all

pytestmark = pytest.mark.server
KEY = "test-secret-key"


AUTH = {"Authorization": f"Bearer {KEY}"}
# two tenants, and the key smg calls its workers with itself (discovery, health)
TENANTS = {"key-alice": "alice", "key-bob": "bob", "key-gateway": "gateway"}
ALICE, BOB = ({"Authorization": f"Bearer {key}"} for key in ("key-alice", "key-bob"))
# smg in front: it checks each client's key itself and passes it on (its own key only where a
# request has none: its calls to the workers)
GATEWAY_ARGS = ["--policy", "cache_aware", "--api-key", "key-gateway", "--tenant-api-key", "alice:key-alice",
                "--tenant-api-key", "bob:key-bob"]


@pytest.fixture(scope="module")
def deployments(llama_dir, servers, tmp_path_factory):
    servers.make_room(3)  # the data-parallel server runs a scheduler per rank
    # on CPU each data-parallel rank needs its own cores (one NUMA node here): one core each
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if on_cpu() else {}
    keyed_dp = Server(llama_dir, extra_args=["--api-key", KEY, "--dp-size", "2", "--load-balance-method", "round_robin"], env=env)
    table = tmp_path_factory.mktemp("tenants") / "tenants.json"
    table.write_text(json.dumps(TENANTS))
    bf16 = Server(llama_dir, via_serve=True, extra_args=["--dtype", "bfloat16", "--enable-cache-report",
                                                         "--tenants", str(table)])
    yield dict(zip(("keyed_dp", "bf16"), start_all([keyed_dp, bf16], timeout=400)))
    stop_all([keyed_dp, bf16])


def test_api_key_covers_span_generate_info_handles_and_openai_routes(deployments):
    keyed_server = deployments["keyed_dp"]
    rows = torch.randn(3, 64) * 0.05
    calls = [
        ("post", "/generate", body([text("a"), span(rows)], 2)),
        ("post", "/generate", {"input_embeds": wire.encode_tensor(rows), "sampling_params": {"max_new_tokens": 2}}),
        ("post", "/v1/completions", {"model": "default", "prompt": "", "max_tokens": 2, "input_embeds": wire.encode_tensor(rows)}),
        ("post", "/v1/chat/completions", {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "input_embeds", "input_embeds": wire.encode_tensor(rows)}]}]}),
        ("get", "/sgl_embeds/info", None),
        ("post", "/sgl_embeds/spans", {"embeds": wire.encode_tensor(rows)}),
        ("delete", "/sgl_embeds/spans/span-0", None),
    ]
    for method, path, payload in calls:
        url = keyed_server.url + path
        anonymous = getattr(requests, method)(url, json=payload, timeout=60)
        wrong = getattr(requests, method)(url, json=payload, headers={"Authorization": "Bearer nope"}, timeout=60)
        right = getattr(requests, method)(url, json=payload, headers=AUTH, timeout=60)
        assert anonymous.status_code == 401 and wrong.status_code == 401, (path, anonymous.status_code, wrong.status_code)
        assert right.status_code == (404 if method == "delete" else 200), (path, right.text[:300])
    # a malformed span is refused by auth first: no decoding work for anonymous clients
    bad = requests.post(keyed_server.url + "/generate", json={"input_embeds": {"data": "AAAA", "dtype": "int8", "shape": [1, 1]}}, timeout=30)
    assert bad.status_code == 401


def test_plugin_is_active_in_every_data_parallel_scheduler(deployments, llama_dir):
    dp_server = deployments["keyed_dp"]
    parts = ["the quick fox", seeded_rows(77, 9), " is"]
    from helpers import OUTPUT_LOGPROBS, reference_embeds, to_segments, with_other_spans

    outs = [requests.post(dp_server.url + "/generate", json=body(to_segments(parts), 8, **OUTPUT_LOGPROBS), headers=AUTH,
                          timeout=120).json() for _ in range(6)]
    ranks = {o["meta_info"].get("dp_rank") for o in outs}
    assert ranks == {0, 1}, ranks  # both schedulers served span prompts
    for o in outs:
        ref.assert_matches_hf(o, llama_dir, reference_embeds(llama_dir, parts), 8, f"dp rank {o['meta_info']['dp_rank']}: ",
                              other_span_embeds=reference_embeds(llama_dir, with_other_spans(parts)))
    for rank in (0, 1):  # and each one's radix cache matched the span on its repeats
        cached = [o["meta_info"]["cached_tokens"] for o in outs if o["meta_info"]["dp_rank"] == rank]
        assert max(cached[1:]) >= 9 + 3, (rank, cached)


def test_full_prompt_embeds_on_a_bfloat16_model_without_disabling_the_cache(deployments, llama_dir):
    bf16_server = deployments["bf16"]
    x = seeded_rows(8, 12)
    payload = {"input_embeds": wire.encode_tensor(x, "base64", "float32"), "sampling_params": {"temperature": 0, "max_new_tokens": 6},
               "return_logprob": True}
    first = requests.post(bf16_server.url + "/generate", json=payload, headers=ALICE, timeout=120).json()
    again = requests.post(bf16_server.url + "/generate", json=payload, headers=ALICE, timeout=120).json()
    assert len(first["output_ids"]) == 6 and again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 11
    # Against HF in bfloat16 too. Two bfloat16 stacks round differently (other kernels, other
    # accumulation order): a logit carries ~3 significant digits, so a top-2 gap under 0.05 is a
    # tie either side may break; that is the tolerance here, the rule otherwise the float32 one.
    ref.assert_matches_hf(first, llama_dir, x, 6, "bfloat16: ", other_span_embeds=seeded_rows(9, 12),
                          dtype=torch.bfloat16, near_tie=0.05)
    info = requests.get(bf16_server.url + "/sgl_embeds/info", headers=ALICE, timeout=30).json()
    assert info["dtype"] == "bfloat16"
    # a client sends float32 rows in the served bfloat16 unless told: half the bytes, the same answer
    endpoint = EmbedsEndpoint(bf16_server.url, api_key="key-alice")
    assert endpoint.writer.dtype_for(x) == "bfloat16"
    segments = [Text("Look at"), Span(x), Text(" then")]
    params = {"temperature": 0, "max_new_tokens": 6}
    as_served = endpoint.run(input_segments=segments, sampling_params=params)
    as_float32 = EmbedsEndpoint(bf16_server.url, wire_dtype="float32", api_key="key-alice").run(
        input_segments=segments, sampling_params=params)
    assert as_served["output_ids"] == as_float32["output_ids"]


def _cached(url: str, payload: dict, headers: dict) -> tuple[list[int], int, int]:
    """(output ids, cached tokens, prompt tokens) of ``payload`` sent to ``url`` with ``headers``."""
    r = requests.post(url + "/generate", json=payload, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return r.json()["output_ids"], meta["cached_tokens"], meta["prompt_tokens"]


def _rows_sent(server, headers: dict) -> int:
    info = requests.get(server.url + "/sgl_embeds/info", headers=headers, timeout=30).json()
    return info["rows_to_scheduler"]["rows_sent"]


def test_tenants_need_their_key_and_share_no_cache_entry_handle_or_held_rows(deployments):
    """Each route but the health probes wants a tenant's key (401 without, or with an unknown
    one); a span prompt (and a text prompt) one tenant sent is no cache hit for the other,
    who gets the same answer at full cost; a handle of one tenant is unknown to the other, who
    can neither use nor delete it; the rows the scheduler holds for one tenant cross again for
    the other."""
    server = deployments["bf16"]
    rows = seeded_rows(41, 12)
    for method, path, payload in [("post", "/generate", body([text("a"), span(rows)], 2)),
                                  ("post", "/generate", {"text": "the fox", "sampling_params": {"max_new_tokens": 1}}),
                                  ("get", "/v1/models", None), ("get", "/sgl_embeds/info", None),
                                  ("post", "/sgl_embeds/spans", {"embeds": wire.encode_tensor(rows)})]:
        for headers in ({}, {"Authorization": "Bearer key-carol"}, AUTH):
            r = getattr(requests, method)(server.url + path, json=payload, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers, r.status_code)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200

    assert requests.post(server.url + "/flush_cache", headers=ALICE, timeout=60).status_code == 200
    for i, payload in enumerate((body([text("Look at"), span(rows), text(" then")], 3),
                                 {"text": "the quick brown fox jumps over", "sampling_params": {"max_new_tokens": 3}})):
        ids = _cached(server.url, payload, ALICE)[0]
        _, hit, n = _cached(server.url, payload, ALICE)
        assert hit == n - 1, (hit, n)  # alice's repeat hits her own entry
        bob_ids, bob_hit, _ = _cached(server.url, payload, BOB)
        # not alice's entry: nothing on bob's first request, then at most the bos his own first
        # prompt began with; the same answer, computed as her first was
        assert bob_hit == (0 if i == 0 else 1) and (i > 0 or bob_ids == ids), (bob_hit, payload)
        assert _cached(server.url, payload, BOB)[1] == n - 1  # his own, once he sent it

    up = requests.post(server.url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(rows)}, headers=ALICE,
                       timeout=60)
    assert up.status_code == 200, up.text
    handle = up.json()["handle"]
    by_handle = body([text("Look at"), {"type": "embeds", "embeds": {"handle": handle}}], 2)
    refused = requests.post(server.url + "/generate", json=by_handle, headers=BOB, timeout=60)
    assert refused.status_code == 400 and refused.json()["type"] == "UnknownSpanHandle", refused.text
    assert requests.delete(server.url + f"/sgl_embeds/spans/{handle}", headers=BOB, timeout=60).status_code == 404
    assert requests.post(server.url + "/generate", json=by_handle, headers=ALICE, timeout=60).status_code == 200

    fresh = seeded_rows(43, 10)
    payload = body([text("Look at"), span(fresh)], 1)
    _cached(server.url, payload, ALICE)
    before = _rows_sent(server, BOB)
    _cached(server.url, payload, BOB)
    assert _rows_sent(server, BOB) - before == 10, "bob's rows cross: the scheduler holds them for alice only"


def test_tenants_stay_apart_behind_the_gateway_and_through_the_endpoint(deployments):
    """smg (``GATEWAY_ARGS``) passes each client's key on: through it a tenant's repeat hits and
    the other tenant's same prompt does not; ``EmbedsEndpoint(api_key=...)`` serves by handle as
    before."""
    server = deployments["bf16"]
    # no tenant's earlier prompts cached (bob's bos would be a 1-token hit of his own)
    assert requests.post(server.url + "/flush_cache", headers=ALICE, timeout=60).status_code == 200
    gateway = Gateway([server.url], args=GATEWAY_ARGS).start()
    try:
        rows = seeded_rows(47, 9)
        payload = body([text("Think of"), span(rows), text(" now")], 2)
        ids = _cached(gateway.url, payload, ALICE)[0]
        _, hit, n = _cached(gateway.url, payload, ALICE)
        assert hit == n - 1
        bob_ids, bob_hit, _ = _cached(gateway.url, payload, BOB)
        assert bob_hit == 0 and bob_ids == ids
        assert requests.post(gateway.url + "/generate", json=payload, timeout=60).status_code == 401
    finally:
        gateway.stop()
    endpoint = EmbedsEndpoint(server.url, api_key="key-bob")
    segments = [Text("Think of"), Span(rows), Text(" now")]
    answers = [endpoint.run(input_segments=segments, sampling_params={"temperature": 0, "max_new_tokens": 2})
               for _ in range(2)]
    assert answers[0]["output_ids"] == answers[1]["output_ids"]
    assert answers[1]["meta_info"]["cached_tokens"] == answers[1]["meta_info"]["prompt_tokens"] - 1
