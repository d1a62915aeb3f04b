"""Shared fixtures: test models built once per run, one real SGLang server per configuration.

Servers are session-scoped and always stopped by their own pid; tests marked ``server`` use them.
The quick edit-test loop is ``pytest -m "not server"``.
"""

from __future__ import annotations

import pytest

from sgl_embeds.testing.models import tiny_model_dir
from sgl_embeds.testing.server import Server

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
    server = _serve(llama_dir, ["--enable-cache-report"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def qwen_server(qwen_dir):
    server = _serve(qwen_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def constrained_server(llama_dir):
    server = _serve(llama_dir, CONSTRAINED_ARGS)
    yield server
    server.stop()


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name.endswith("_server") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
