"""How long a 2880 x 4096 bfloat16 span's bytes (23.6 MB) take to reach a server, by transport.

Issue #35 item 5: the cached span sent inline as a binary body costs more over the same prefix as
token ids than the target allows, and the HTTP server's body read holds most of it. Here bare
servers do nothing but take the bytes and answer, so what is timed is the transport alone (no
SGLang, no model), one request at a time from this process, the sides interleaved round by round
(order rotated) so they share the machine's load:

* ``uvicorn, TCP, chunks joined``: an ASGI app under uvicorn (httptools) on 127.0.0.1 that joins
  the body's chunks (as the plugin read it before 86d1614);
* ``uvicorn, TCP, one buffer``: the same app reading with the plugin's own ``asgi.read_body``
  (a binary body of a declared length: one buffer, each chunk copied in as it comes);
* ``granian, TCP, one buffer``: the same under granian's embedded server (as SGLang's
  ``--enable-http2`` runs it: ASGI, HTTP/1.1 and h2c);
* ``uvicorn`` / ``granian, Unix socket, one buffer``: the same over a Unix domain socket;
* ``memfd over a Unix socket, sealed``: the client writes the bytes into a new memfd, seals it
  against writes and resizes, and passes the descriptor (SCM_RIGHTS); the server refuses one
  without those seals and maps it read-only. Nothing the server opens is named by the client,
  and the sealed bytes cannot change under a server that hashes them;
* ``uvicorn, TCP, 100-byte body``: what any request costs here (the side of a text-ids prefix).

Columns: the request as the client sees it (send to answer), the server's read (its first
receive to the whole body in hand; for the memfd, the descriptor's checks and its mapping) and
how many ASGI messages the body came in.

    python benchmarks/bench_body_transports.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import array
import fcntl
import http.client
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import commit, machine, provenance, save, table
from sgl_embeds_protocol import binary_body

SPAN_BYTES = 2880 * 4096 * 2
F_ADD_SEALS, F_GET_SEALS = 1033, 1034  # fcntl.h (Linux); Python 3.11's fcntl names neither
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 1, 2, 4, 8
SEALED = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE
MEMFD = "memfd over a Unix socket (SCM_RIGHTS), sealed"
SMALL = "uvicorn, TCP, 100-byte body"


async def _read_joined(scope: dict, receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _read_one_buffer(scope: dict, receive):
    from sgl_embeds_srt.http import asgi

    return (await asgi.read_body(scope, receive, 1 << 30))[0]


READERS = {"chunks joined": _read_joined, "one buffer": _read_one_buffer}


def _app(reader: str):
    read = READERS[reader]

    async def app(scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        messages = 0

        async def counted():
            nonlocal messages
            messages += 1
            return await receive()

        t0 = time.monotonic()
        body = await read(scope, counted)
        answer = json.dumps({"read_s": time.monotonic() - t0, "bytes": len(body),
                             "messages": messages}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


def _serve_http(server: str, reader: str, where: str) -> None:
    app = _app(reader)
    if server == "uvicorn":
        import uvicorn

        at = dict(uds=where) if where.startswith("/") else dict(host="127.0.0.1", port=int(where))
        return uvicorn.run(app, lifespan="off", log_level="warning", **at)
    import uvloop
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    at = dict(uds=Path(where)) if where.startswith("/") else dict(address="127.0.0.1", port=int(where))
    uvloop.run(Server(target=app, interface=Interfaces.ASGI, http=HTTPModes.auto,
                      log_level="error", **at).serve())


def _serve_memfd(path: str) -> None:
    """One descriptor per message: refused unless sealed against writes and resizes (so a memfd,
    the only kind that takes seals), then mapped read-only."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    while True:  # a connection at a time (the first: the check that it listens)
        conn, _ = listener.accept()
        with conn:
            while _take_memfd(conn):
                pass


def _take_memfd(conn: socket.socket) -> bool:
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    if not message:
        return False
    t0 = time.monotonic()
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    fd = fds[0]
    try:
        sealed = fcntl.fcntl(fd, F_GET_SEALS) & SEALED == SEALED
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if sealed else None
    finally:
        os.close(fd)
    answer = {"read_s": time.monotonic() - t0, "bytes": size, "sealed": sealed}
    conn.sendall(json.dumps(answer).encode())
    if mapped is not None:
        mapped.close()
    return True


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost")
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.socket_path)


def _wait_listening(where: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        family = socket.AF_UNIX if where.startswith("/") else socket.AF_INET
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            probe.connect(where if where.startswith("/") else ("127.0.0.1", int(where)))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            probe.close()


def _post(where: str, body: bytes) -> tuple[float, float, int]:
    """(request s, server's read s, the body's ASGI messages), a new connection per request, as
    urllib posts."""
    conn = _UnixConnection(where) if where.startswith("/") else http.client.HTTPConnection("127.0.0.1", int(where))
    t0 = time.perf_counter()
    conn.request("POST", "/generate", body=body,
                 headers={"Content-Type": binary_body.CONTENT_TYPE, "Content-Length": str(len(body))})
    answer = json.loads(conn.getresponse().read())
    took = time.perf_counter() - t0
    conn.close()
    assert answer["bytes"] == len(body)
    return took, answer["read_s"], answer["messages"]


def _post_memfd(conn: socket.socket, rows: np.ndarray) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    fd = os.memfd_create("span", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        written, data = 0, memoryview(rows)
        while written < rows.nbytes:  # write(2): faster here than a copy into a new mapping
            written += os.write(fd, data[written:])
        fcntl.fcntl(fd, F_ADD_SEALS, SEALED)
        conn.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        os.close(fd)
    answer = json.loads(conn.recv(4096))
    assert answer["sealed"] and answer["bytes"] == rows.nbytes
    return time.perf_counter() - t0, answer["read_s"], 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="sgl_embeds_transports_")
    http_sides = {  # side: (server, reader, port or socket path)
        "uvicorn, TCP, chunks joined": ("uvicorn", "chunks joined", "18731"),
        "uvicorn, TCP, one buffer": ("uvicorn", "one buffer", "18732"),
        "granian, TCP, one buffer": ("granian", "one buffer", "18733"),
        "uvicorn, Unix socket, one buffer": ("uvicorn", "one buffer", f"{folder}/uvicorn.sock"),
        "granian, Unix socket, one buffer": ("granian", "one buffer", f"{folder}/granian.sock"),
    }
    spawn = mp.get_context("spawn")
    children = [spawn.Process(target=_serve_http, args=v, daemon=True) for v in http_sides.values()]
    children.append(spawn.Process(target=_serve_memfd, args=(f"{folder}/memfd.sock",), daemon=True))
    for child in children:
        child.start()
    for where in [w for _, _, w in http_sides.values()] + [f"{folder}/memfd.sock"]:
        _wait_listening(where)
    memfd_conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    memfd_conn.connect(f"{folder}/memfd.sock")
    rows = np.frombuffer(os.urandom(SPAN_BYTES), np.uint8)
    body, small = rows.tobytes(), b"x" * 100
    sides = [*http_sides, MEMFD, SMALL]
    post = {**{side: (lambda w=where: _post(w, body)) for side, (_, _, where) in http_sides.items()},
            MEMFD: lambda: _post_memfd(memfd_conn, rows), SMALL: lambda: _post("18731", small)}
    load_start = os.getloadavg()
    times: dict[str, list[tuple[float, float, int]]] = {side: [] for side in sides}
    for r in range(args.rounds + 2):  # the first two rounds warm up
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            took = post[side]()
            if r >= 2:
                times[side].append(took)
    load_end = os.getloadavg()
    for child in children:
        child.terminate()
    out_rows = []
    for side, got in times.items():
        request_s, read_s, messages = zip(*got)
        request_ms, read_ms = [t * 1000 for t in request_s], [t * 1000 for t in read_s]
        out_rows.append([side, statistics.median(request_ms), min(request_ms),
                         statistics.median(read_ms), min(read_ms), statistics.median(messages)])
    text = (f"{provenance()}\nbare servers (no SGLang), one request at a time over a new connection, "
            f"{args.rounds} interleaved rounds, a body of {SPAN_BYTES} bytes (2880 x 4096 bfloat16); "
            f"load average (1, 5, 15 min) at the start {load_start}, at the end {load_end}")
    text += table("A span's bytes to a bare server, by transport (ms)",
                  ["side", "request p50", "request min", "server's read p50", "server's read min",
                   "messages (p50)"],
                  out_rows)
    save("body_transports", {"commit": commit(), "machine": machine(), "rounds": args.rounds,
                             "load_start": load_start, "load_end": load_end,
                             "times_s": times}, text)


if __name__ == "__main__":
    main()
