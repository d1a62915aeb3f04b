"""Tenants without a server: the key table read and checked, a request's key to its tenant, and
what a tenant's requests are keyed by (handles, held rows, cache entries, a gateway's routing);
``serve --tenants FILE``. The served behaviour: tests/server/test_tenants.py."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_embeds import serve
from sgl_embeds_protocol import keys
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.segments import Span
from sgl_embeds_srt import tenants
from sgl_embeds_srt.handles import SpanStore, UnknownSpanHandle
from sgl_embeds_testing.models import tiny_model_dir

TABLE = {"key-a": "alice", "key-b": "bob", "key-b2": "bob"}


def _table_file(tmp_path, table) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(table))
    return str(path)


def test_the_table_is_read_and_checked(tmp_path):
    assert tenants.read_table(_table_file(tmp_path, TABLE)) == TABLE
    for bad, why in [([], "non-empty JSON object"), ({}, "non-empty JSON object"),
                     ({"k": ""}, "non-empty tenant"), ({"k": "a/b"}, "without '/'"), ({"k": 3}, "non-empty tenant")]:
        with pytest.raises(ValueError, match=why):
            tenants.read_table(_table_file(tmp_path, bad))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        tenants.read_table(tmp_path / "broken.json")


def test_a_requests_key_names_its_tenant_and_nothing_else_does():
    assert tenants.tenant_of(b"Bearer key-a", TABLE) == "alice"
    assert tenants.tenant_of("bearer key-b2", TABLE) == "bob"
    for header in (None, b"", b"Bearer", b"Bearer ", b"Basic key-a", b"Bearer key-a ", b"Bearer KEY-A", b"Bearer key-c"):
        assert tenants.tenant_of(header, TABLE) is None, header
    assert tenants.is_open("/health") and tenants.is_open("/health_generate") and tenants.is_open("/metrics")
    assert not tenants.is_open("/generate") and not tenants.is_open("/sgl_embeds/info")


def test_a_tenants_keys_and_cache_entries_are_its_own():
    assert tenants.current() is None and tenants.scoped("h") == "h" and tenants.extra_key("x") == "x"
    with tenants.acting_for("alice"):
        alice = tenants.extra_key(None)
        assert tenants.scoped("h") == "alice/h" and alice.startswith("tenant:")
        assert tenants.extra_key("x") == alice + "|x"  # the client's own extra_key kept after it
        assert tenants.extra_key(["x", None, ""]) == [alice + "|x", alice, alice]
        assert tenants.extra_key([3]) == [3]  # not a string: SGLang refuses it, as without tenants
    with tenants.acting_for("bob"):
        assert tenants.extra_key(None) != alice and tenants.scoped("h") == "bob/h"
    assert tenants.current() is None


def test_a_tenant_cannot_name_use_or_delete_anothers_handle_nor_evict_it():
    span_bytes = 64 * 4 + keys.ROW_DIGEST_BYTES
    store = SpanStore(budget=4 * span_bytes, shares=2)  # two tenants: two spans each
    assert store.budget == 2 * span_bytes
    rows = torch.randn(1, 64)
    with tenants.acting_for("alice"):
        handle = store.put(Span(rows)).content_key
    with tenants.acting_for("bob"):
        with pytest.raises(UnknownSpanHandle):  # "unknown", as a handle never uploaded: no oracle
            store.get(handle)
        assert not store.delete(handle)
        for i in range(3):  # bob fills his share
            store.put(Span(torch.full((1, 64), float(i))))
        assert store.stats()["count"] == 2
        assert store.put(Span(rows.clone())).content_key == handle  # his own copy, same name
        assert store.delete(handle)
    with tenants.acting_for("alice"):
        assert torch.equal(store.get(handle).rows, rows) and store.stats()["count"] == 1
    with pytest.raises(UnknownSpanHandle):  # no tenant: a space of its own too
        store.get(handle)


def test_a_gateway_routes_each_keys_prompts_apart():
    text = keys.routing_text([Span(torch.ones(2, 8))])
    a, b = keys.keyed_routing_text(text, "key-a"), keys.keyed_routing_text(text, "key-b")
    assert a != b and a.endswith(text) and keys.is_routing_text(a)
    assert keys.keyed_routing_text(a, "key-a") == a  # once
    assert "key-a" not in a


def test_serve_takes_a_tenants_file_and_refuses_it_beside_an_api_key(tmp_path):
    path = _table_file(tmp_path, TABLE)
    launch = serve.plan(tiny_model_dir("llama"), ["--tenants", path, "--port", "1"], progress=False)
    assert launch.env[tenants.TENANTS_ENV] == path and launch.args[-3:] == ["--port", "1", "--skip-server-warmup"]
    assert "--tenants" not in launch.args
    assert serve.plan(tiny_model_dir("llama"), [f"--tenants={path}"], progress=False).env[tenants.TENANTS_ENV] == path
    with pytest.raises(serve.ServeError, match="drop --api-key"):
        serve.plan(tiny_model_dir("llama"), ["--tenants", path, "--api-key", "k"], progress=False)
    with pytest.raises(serve.ServeError, match="a JSON file of API key -> tenant"):
        serve.plan(tiny_model_dir("llama"), ["--tenants", str(tmp_path / "absent.json")], progress=False)


@pytest.mark.parametrize("binary", [False, True])
def test_an_endpoint_with_a_key_leads_its_routing_hint_with_the_keys_digest(binary):
    from fake_server import FakePluginServer
    from sgl_embeds.backend import EmbedsEndpoint

    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    hints = {}
    with FakePluginServer(8) as server:
        for api_key in ("key-a", "key-b", None):
            EmbedsEndpoint(server.url, api_key=api_key, send_binary=binary).run(
                input_segments=[seg.Text("look"), seg.Span(rows)])
            hints[api_key] = server.posts[-1][1]["text"]
    assert keys.is_routing_text(hints[None]) and not hints[None].startswith("[key ")
    assert hints["key-a"] == keys.keyed_routing_text(hints[None], "key-a") != hints["key-b"]
