"""The server fixture fails fast, with the server's last log lines, instead of hanging."""

from __future__ import annotations

import socket
import time

import pytest

from sgl_embeds_testing.server import Server, ServerStartError

pytestmark = pytest.mark.server  # these start (failing) server processes


def test_missing_model_dir_fails_fast(tmp_path):
    with pytest.raises(ServerStartError, match="no config.json"):
        Server(tmp_path / "nope").start()


def test_port_in_use_fails_fast(llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port}"):
            Server(llama_dir, port=port).start()


def test_server_dying_during_startup_fails_fast_with_its_log(llama_dir):
    t0 = time.monotonic()
    server = Server(llama_dir, extra_args=["--context-length", "not-a-number"])
    with pytest.raises(ServerStartError) as err:
        server.start(timeout=120)
    assert "exited with code" in str(err.value) and "last" in str(err.value)
    assert "context" in str(err.value)  # the server's own complaint is in the tail shown
    assert time.monotonic() - t0 < 60 and not server.alive()
