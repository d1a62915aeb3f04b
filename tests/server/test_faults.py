"""Faults: a server restart in the middle of a workload gives clients clear, retryable errors
(connection refused / reset), never a silently wrong answer; after the restart all is correct."""

from __future__ import annotations

import threading
import time

import requests

from helpers import body, seeded_rows, span, text


def test_restart_mid_workload(llama_server):
    """The pool's Llama server, stopped and started again on its port while four clients send
    requests (the pool then keeps it as it is: running, same port)."""
    server, port = llama_server, llama_server.port
    parts = [text("the fox"), span(seeded_rows(5, 5)), text(" is")]
    want = requests.post(server.url + "/generate", json=body(parts, 6), timeout=60).json()["output_ids"]
    results, stop = [], threading.Event()

    def worker():
        while not stop.is_set():
            try:
                r = requests.post(f"http://127.0.0.1:{port}/generate", json=body(parts, 6), timeout=30)
                results.append(("ok", r.status_code, r.json().get("output_ids") if r.status_code == 200 else r.text))
            except requests.ConnectionError as e:  # the retryable kind
                results.append(("conn", None, type(e).__name__))
                time.sleep(0.2)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        # a grace of 5 s, then a kill, as an orchestrator restarts a server: with clients still
        # sending, SGLang keeps draining for the whole 30 s the pool gives a server it stops
        server.stop(drain=5)
        time.sleep(1)
        server.start()
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert server.port == port and server.alive()
    assert any(kind == "conn" for kind, _, _ in results), "the restart was not observed"
    served = [(code, out) for kind, code, out in results if kind == "ok"]
    assert served and all(code in (200, 503) for code, _ in served), [c for c, _ in served if c != 200]
    assert all(out == want for code, out in served if code == 200), "a wrong answer was served"
    after = requests.post(server.url + "/generate", json=body(parts, 6), timeout=60).json()["output_ids"]
    assert after == want
