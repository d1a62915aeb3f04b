"""Shared fixtures: test models built once per run, one real SGLang server per configuration.

Servers are session-scoped and always stopped by their own pid; tests marked ``server`` use them.
The quick edit-test loop is ``pytest -m "not server"``.
"""

from __future__ import annotations

import pytest

from sgl_embeds.testing.models import demo_model_dir, tiny_llava_dir, tiny_model_dir
from sgl_embeds.testing.reference import at_most_one_forgiven_near_tie_per_test  # noqa: F401 (autouse)
from sgl_embeds.testing.server import Gateway, Server, free_port, start_all

# A small chunk and KV pool: spans get split across chunks, and decode runs out of KV and retracts.
CONSTRAINED_ARGS = ["--chunked-prefill-size", "16", "--max-total-tokens", "256", "--max-running-requests", "8",
                    "--schedule-conservativeness", "0.01",
                    "--page-size", "1"]


@pytest.fixture(scope="session")
def llama_dir():
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def qwen_dir():
    return tiny_model_dir("qwen2")


def _serve(model_dir, extra=()):
    server = Server(model_dir, extra_args=list(extra))
    server.start()
    return server


@pytest.fixture(scope="session")
def llama_server(llama_dir):
    # JSON-schema decoding without free whitespace: a random-weight model otherwise fills any
    # allowed whitespace until max_new_tokens (tests/test_compat_constrained.py)
    server = _serve(llama_dir, ["--enable-cache-report", "--constrained-json-disable-any-whitespace"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen_server(qwen_dir):
    """Also publishes metrics and radix-cache events (ZMQ on loopback, ``kv_events_port``):
    tests/test_compat_metrics.py reads them."""
    port = free_port()
    events = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:%d", "bind": true, "topic": "kv"}' % port
    server = _serve(qwen_dir, ["--enable-metrics", "--enable-cache-report", "--kv-events-config", events])
    server.kv_events_port = port
    yield server
    server.stop()


@pytest.fixture(scope="session")
def constrained_server(llama_dir):
    server = _serve(llama_dir, CONSTRAINED_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_server():
    """The demo model (SmolLM2-135M-Instruct, float32): for tutorials whose answers must be right."""
    server = _serve(demo_model_dir())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gateway(llama_dir):
    """SGLang's gateway (smg, cache-aware policy) in front of two fresh plugin workers: the
    gateway's ``url`` and its ``workers`` (``Server`` objects), all three stopped by pid."""
    workers = start_all([Server(llama_dir, extra_args=["--enable-cache-report"]) for _ in range(2)])
    gw = Gateway([w.url for w in workers])
    try:
        gw.start()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    gw.workers = workers
    yield gw
    gw.stop()
    for w in workers:
        w.stop()


def _split_llava(arch, tmp_path_factory):
    from sgl_embeds.vlm import split

    src = tiny_llava_dir(arch)
    dst = tmp_path_factory.mktemp(f"llava-{arch}-split")
    split(src, dst, log=lambda message: None)
    return src, dst


@pytest.fixture(scope="session")
def llava_llama(tmp_path_factory):
    """(checkpoint dir, split dir) of the tiny LLaVA with the Llama language model."""
    return _split_llava("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def llava_qwen(tmp_path_factory):
    return _split_llava("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def llava_llama_server(llava_llama):
    server = _serve(llava_llama[1] / "llm", ["--enable-cache-report"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llava_qwen_server(llava_qwen):
    server = _serve(llava_qwen[1] / "llm", ["--enable-cache-report"])
    yield server
    server.stop()




def pytest_collection_modifyitems(items):
    for item in items:
        if any(name.endswith("_server") or name == "gateway" for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
