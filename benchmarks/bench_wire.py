"""The whole path of one span without model compute, at the sizes real VLMs send.

Two stand-in servers run SGLang's real HTTP app (``http_server.app``: FastAPI, its ``/generate``
route and request parsing) under uvicorn on 127.0.0.1: one with the plugin's middleware
installed (``sgl_embeds_srt.http.install``), one stock. In both, SGLang's tokenizer manager is a
stand-in whose ``generate_request`` notes when the request reaches it and answers at once, so
everything before SGLang's tokenizer manager is the real code and nothing after it runs (no
tokenizing, no scheduler, no model). The stand-in then times the request's trip to the scheduler
on its own: its rows (our ``PromptRows``; stock's ``input_embeds`` lists) pickled, sent over a
ZMQ ipc socket to a process that unpickles them and acks, as SGLang's default IPC does.

Per span (rows x hidden, wire dtype; the served model is float32), four sides, one request each
per round, rounds rotating the order, all posted with the same client (urllib):

* ``binary body, first send``: what ``EmbedsEndpoint`` does with a span it has not sent before
  (``SpanWriter`` with kept spans: values checked, routing hint, handle; then
  ``binary_body.encode_parts``, posted in parts as the endpoint posts them), new rows every round;
* ``binary body, sent again``: the same rows every round, inline again (as curl or another
  language would send them): the server knows their key, the scheduler holds their rows;
* ``JSON base64, first send``: the writer with base64 rows, an ``orjson`` body, new rows;
* ``stock JSON float lists``: ``{"input_embeds": rows.tolist()}`` to stock SGLang (float32
  values), an ``orjson`` body, new rows;
* ``floor: a bare uvicorn app reads the binary body``: the first send's body to an ASGI app under
  the same uvicorn that only reads it (its chunks, joined) and answers: what moving the bytes
  through HTTP in Python costs before any server path (its "server path from head" is the read).

Columns: client encode; the server path from the request head received (the app's first call:
the body's transfer included) and from the body received (our middleware has it whole) to the
request handed to the tokenizer manager (parse, checks, row keys, placeholders, the
``GenerateReqInput``); the IPC trip (the plugin's transport, then SGLang's pickle over ZMQ and the
scheduler's ``reconstruct``); the server's peak extra RSS up to the hand-off (``VmHWM`` reset
through ``/proc/<pid>/clear_refs`` before each request, minus ``VmRSS`` then: torch allocations
escape tracemalloc; measured on a twin server whose glibc returns freed buffers, ``StandIn``,
by the first requests of each side); and two floors, each timed in every round right after the
first send's encode, on its rows (the same moment, so the same load from the servers' leftover
work; rows the encode has just read, so if anything the floors gain from the cache): a warm copy
of the span's bytes into a buffer allocated and touched before (numpy, one thread), and the
client's floor (``client_floor_s``: the kept-span lookup and one BLAKE3 over the bytes at the
``blake3`` library's top speed, which any client naming spans by a collision-safe handle must
read). The multiples are of that warm copy; beside it, the same copy repeated back to back in
quiet with both buffers hot in the cache (its best case, about half as long here), and the
verdicts give the multiples of that one too. A second table breaks our server path down in this
process.

    python benchmarks/bench_wire.py [--sizes 576x4096:bfloat16,...] [--rounds 7] [--stock-rounds 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import torch
from blake3 import blake3

from common import commit, machine, provenance, save, table
from sgl_embeds.writer import HeldSpans, SpanWriter
from sgl_embeds_protocol import binary_body, keys, wire
from sgl_embeds_protocol.segments import Span

BARE = "floor: a bare uvicorn app reads the binary body"
HOT_COPY = "the same copy back to back, cache-hot (not a floor of the multiples)"
CLIENT_FLOOR = "floor: the client's two reads (xxh3 lookup + BLAKE3 at the library's top speed)"
SIDES = ["binary body, first send", "binary body, sent again", "JSON base64, first send",
         "stock JSON float lists", BARE]
SERVER_OF = {"stock JSON float lists": "stock", BARE: "bare"}  # the others: "plugin"
VOCAB = 32000
BODY_READ: dict[str, float] = {}  # stand-in server: when the middleware had the last body


def _status_kb(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


# ---- the stand-in server (a child process) ----

def _scheduler(address: str, ack_address: str) -> None:
    """Stands where SGLang's scheduler receives: unpickle each message, ack it."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(address)
    push.connect(ack_address)
    while True:
        ids, rows = pull.recv_pyobj()  # as SGLang's scheduler receives
        if hasattr(rows, "reconstruct"):  # as the scheduler does first (ours: held rows put back)
            rows.reconstruct(0)
        push.send(b"ack")


class StandInTokenizerManager:
    """What the HTTP app and the plugin read of SGLang's tokenizer manager, for one model shape;
    ``generate_request`` hands back the timings of the request instead of generating."""

    def __init__(self, hidden: int, address: str, ack_address: str) -> None:
        import zmq
        from transformers import LlamaConfig

        self.model_config = type("ModelConfig", (), {"hidden_size": hidden, "dtype": torch.float32,
                                                      "vocab_size": VOCAB, "hf_config": LlamaConfig(hidden_size=hidden)})()
        self.context_len, self.tokenizer, self.is_generation = 1 << 20, None, True
        self.gracefully_exit = False
        ctx = zmq.Context()
        self.push, self.acks = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.acks.bind(ack_address)
        self.push.connect(address)
        from sgl_embeds_srt import transport  # the plugin's transport around SGLang's (a no-op on CPU)

        class StockTransport:
            def prepare_for_dispatch(self, objs):
                return []

            def cancel_for_dispatch(self, prepared):
                pass

        self.transport = transport.RowsTransport(StockTransport(), True, 1 << 30)
        transport._TRANSPORTS.append(self.transport)

    async def generate_request(self, obj, request=None):
        handed = time.monotonic()
        peak_kb = _status_kb("self", "VmHWM")
        t0 = time.perf_counter()
        if obj.positional_embed_overrides is not None:  # ours: the plugin's transport, as in SGLang's
            sent = SimpleNamespace(positional_embed_overrides=obj.positional_embed_overrides)
            self.transport.prepare_for_dispatch([sent])
            rows = sent.positional_embed_overrides
        else:
            rows = obj.input_embeds
        self.push.send_pyobj((obj.input_ids, rows))  # as SGLang's tokenizer manager sends
        self.acks.recv()
        ipc = time.perf_counter() - t0
        body_read = BODY_READ.pop("last", request.scope["bench_t0"])  # one request at a time
        yield {"text": "", "meta_info": {"server_s": handed - request.scope["bench_t0"],
                                         "from_body_s": handed - body_read, "ipc_s": ipc, "peak_kb": peak_kb}}


async def _bare_app(scope, receive, send) -> None:
    """Reads the body as a Python ASGI server must (its chunks, joined) and answers at once: the
    floor of any server path under uvicorn."""
    if scope["type"] != "http":
        return
    t0, chunks, more = time.monotonic(), [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    meta = {"server_s": time.monotonic() - t0, "from_body_s": 0.0, "ipc_s": 0.0, "peak_kb": 0, "bytes": len(body)}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": orjson.dumps({"meta_info": meta})})


def _serve(port: int, hidden: int, kind: str, address: str, ready) -> None:
    import uvicorn

    if kind == "bare":
        ready.set()
        return uvicorn.run(_bare_app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    from sglang.srt.entrypoints import http_server

    if kind == "plugin":
        from sgl_embeds_srt import http as plugin_http
        from sgl_embeds_srt.http import asgi, middleware

        plugin_http.install(http_server.app)
        read_body = asgi.read_body

        async def timed_read_body(scope, receive, limit):  # when our middleware has the whole body
            out = await read_body(scope, receive, limit)
            BODY_READ["last"] = time.monotonic()
            return out

        middleware.asgi.read_body = timed_read_body
    tm = StandInTokenizerManager(hidden, address, address + "_ack")
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=None,
                                                          scheduler_info={}))
    app = http_server.app

    async def clocked(scope, receive, send):  # the request head is in: the server path starts
        scope["bench_t0"] = time.monotonic()
        await app(scope, receive, send)

    ready.set()
    uvicorn.run(clocked, host="127.0.0.1", port=port, lifespan="off", log_level="warning")


class StandIn:
    """A stand-in server (and its scheduler stand-in). ``for_memory``: glibc's mmap threshold is
    fixed, so freed buffers go back to the system and each request's peak shows (glibc otherwise
    keeps them after the first request, and a later peak stays under the RSS measured before
    it); it also makes every large allocation fault its pages in, so times are taken on servers
    without it."""

    def __init__(self, port: int, hidden: int, kind: str, for_memory: bool) -> None:
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        if for_memory:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)
        else:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        spawn = mp.get_context("spawn")
        address = f"ipc:///tmp/sgl_embeds_bench_wire_{os.getpid()}_{port}"
        self.scheduler = spawn.Process(target=_scheduler, args=(address, address + "_ack"), daemon=True)
        self.scheduler.start()
        ready = spawn.Event()
        self.process = spawn.Process(target=_serve, args=(port, hidden, kind, address, ready), daemon=True)
        self.process.start()
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        ready.wait(120)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if not self.process.is_alive():
                break
            try:
                urllib.request.urlopen(self.url + "/bench_wire_ping", timeout=2)
                return
            except Exception as e:  # noqa: BLE001 - not up yet (any status answers: up)
                if getattr(e, "code", None):
                    return
                time.sleep(0.1)
        raise RuntimeError("the stand-in server did not start")

    def post(self, body: bytes | list, content_type: str) -> tuple[dict, float, float]:
        """The response's timings, the whole request's seconds, and the server's peak extra KB.
        ``body``: bytes, or parts sent one after another (``binary_body.encode_parts``)."""
        os.sched_yield()
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        rss_kb = _status_kb(self.process.pid, "VmRSS")
        t0 = time.perf_counter()
        size = sum(memoryview(p).nbytes for p in body) if isinstance(body, list) else len(body)
        headers = {"Content-Type": content_type, "Content-Length": str(size)}
        request = urllib.request.Request(self.url + "/generate", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=600) as res:
            meta = orjson.loads(res.read())["meta_info"]
        return meta, time.perf_counter() - t0, meta["peak_kb"] - rss_kb

    def stop(self) -> None:
        for p in (self.process, self.scheduler):
            p.kill()
            p.join()


# ---- the client's encodings ----

def encode_ours(rows: torch.Tensor, binary: bool) -> tuple[bytes | list, str]:
    """A first send by EmbedsEndpoint: the writer with kept spans (values checked, routing hint,
    handle), then the body (binary: in parts, as the endpoint posts it, the rows not copied)."""
    writer = SpanWriter(rows.shape[1], "base64", wire.DTYPE_NAMES[rows.dtype], held=HeldSpans())
    fields = writer.fields("input_segments", [[Span(rows)]], False, raw_rows=binary)
    body = {**fields, "sampling_params": {"max_new_tokens": 1}}
    if binary:
        return binary_body.encode_parts(body), binary_body.CONTENT_TYPE
    return orjson.dumps(body), "application/json"


def encode_stock(rows: torch.Tensor) -> tuple[bytes, str]:
    body = {"input_embeds": rows.float().tolist(), "sampling_params": {"max_new_tokens": 1}}
    return orjson.dumps(body), "application/json"


def median_ms(fn, repeat: int = 7) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def client_floor_s(rows: torch.Tensor) -> float:
    """What a client that names spans by a collision-safe handle must read, at best: the kept-span
    lookup (xxh3 of all the bytes, ``HeldSpans.wire_hash``) and one BLAKE3 over them at the ``blake3``
    library's top speed (all threads), with no values check and no per-row digests."""
    raw = keys.raw_bytes(rows)
    t0 = time.perf_counter()
    HeldSpans.wire_hash(rows)
    blake3(raw, max_threads=blake3.AUTO).digest()
    return time.perf_counter() - t0


def back_to_back_copy_ms(rows: torch.Tensor) -> float:
    """The same copy repeated back to back in quiet, both buffers hot in the cache: its best case."""
    src = np.frombuffer(keys.raw_bytes(rows), dtype=np.uint8)
    dst = np.ones_like(src)
    return median_ms(lambda: np.copyto(dst, src), 15)


def warm_copy_s(rows: torch.Tensor, dst: np.ndarray) -> float:
    """A copy of the rows' bytes into ``dst``, a buffer allocated and touched before."""
    src = np.frombuffer(keys.raw_bytes(rows), dtype=np.uint8)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def breakdown(rows: torch.Tensor) -> dict[str, float]:
    """Our server path's stages for a binary body, in this process (ms, medians of 7)."""
    from sgl_embeds_srt.handles import SpanStore, budget_bytes
    from sgl_embeds_srt.placeholders import placeholder_ids
    from sgl_embeds_srt.prompts import ModelSpec, make_generate_req

    spec = ModelSpec(rows.shape[1], torch.float32, VOCAB, 1 << 20, None)
    body = b"".join(encode_ours(rows, binary=True)[0])  # as the server has it, joined
    payload = binary_body.decode_body(body, 1 << 40)
    span = payload["input_segments"][0]["embeds"]
    digests = keys.row_digests(span)
    return {
        "decode_body (frame checks, a view of the body)": median_ms(lambda: binary_body.decode_body(body, 1 << 40)),
        "row keys and values check of the rows as sent (keys.finite_row_digests, one native pass)":
            median_ms(lambda: keys.finite_row_digests(span)),
        "content key from the row keys (keys.content_key)": median_ms(lambda: keys.content_key(span, digests)),
        "placeholder ids from the row keys": median_ms(lambda: placeholder_ids(span, digests=digests)),
        "(not on this path) the cast to float32 that SGLang's model runner makes of the rows it runs":
            median_ms(lambda: span.float()),
        "all: make_generate_req (parse, checks, keys, placeholders, span kept)": median_ms(
            lambda: make_generate_req(payload, spec, SpanStore(budget_bytes()), True)),
    }


def parse_sizes(text: str) -> list[tuple[int, int, torch.dtype]]:
    out = []
    for item in text.split(","):
        shape, _, dtype = item.partition(":")
        n, hidden = (int(v) for v in shape.split("x"))
        out.append((n, hidden, wire.DTYPES[dtype or "bfloat16"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="576x4096:bfloat16,2880x4096:bfloat16,2880x4096:float32,4096x576:bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stock-rounds", type=int, default=2, help="rounds of the stock side (JSON float lists are slow)")
    ap.add_argument("--port", type=int, default=23417)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out, stage_rows, data = [], [], {"commit": commit(), "machine": machine(), "sizes": {}}
    verdicts = []
    servers: dict[tuple[int, str, bool], StandIn] = {}  # (hidden, kind, for memory)
    try:
        for n, hidden, dtype in parse_sizes(args.sizes):
            for kind in ("plugin", "stock", "bare"):
                for for_memory in (False, True) if kind != "bare" else (False,):
                    if (hidden, kind, for_memory) not in servers:
                        servers[(hidden, kind, for_memory)] = StandIn(args.port + len(servers), hidden, kind, for_memory)
            rows = (torch.randn(n, hidden) * 0.02).to(dtype)
            label = f"{n}x{hidden} {wire.DTYPE_NAMES[dtype]}"
            mb = rows.numel() * rows.element_size() / 1e6
            copy_dst = np.ones(rows.numel() * rows.element_size(), np.uint8)
            hot_copy = back_to_back_copy_ms(rows)
            floors: dict[str, list[float]] = {"copy": [], "client": []}
            fresh = lambda: (torch.randn(n, hidden) * 0.02).to(dtype)  # noqa: E731 - a span never sent
            encoders = {"binary body, first send": lambda x: encode_ours(x, True),
                        "binary body, sent again": lambda x: encode_ours(x, True),
                        "JSON base64, first send": lambda x: encode_ours(x, False),
                        "stock JSON float lists": encode_stock,
                        BARE: lambda x: encode_ours(x, True)}
            for for_memory in (False, True):  # "sent again" is sent before
                servers[(hidden, "plugin", for_memory)].post(*encode_ours(rows, True))
            samples = {s: {k: [] for k in ("encode", "server", "from_body", "ipc", "total", "peak")} for s in SIDES}
            for r in range(args.rounds):
                for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                    if side.startswith("stock") and r >= args.stock_rounds:
                        continue
                    x = rows if side.endswith("sent again") else fresh()
                    t0 = time.perf_counter()
                    body, content_type = encoders[side](x)
                    samples[side]["encode"].append(time.perf_counter() - t0)
                    if side == "binary body, first send":  # the floors: the same rows, the same moment
                        floors["copy"].append(warm_copy_s(x, copy_dst))
                        floors["client"].append(client_floor_s(x))
                    kind = SERVER_OF.get(side, "plugin")
                    meta, total, _ = servers[(hidden, kind, False)].post(body, content_type)
                    samples[side]["server"].append(meta["server_s"])
                    samples[side]["from_body"].append(meta["from_body_s"])
                    samples[side]["ipc"].append(meta["ipc_s"])
                    samples[side]["total"].append(total)
                    if r < (1 if kind == "stock" else 2) and kind != "bare":  # the peak: on the twin server
                        _, _, peak_kb = servers[(hidden, kind, True)].post(body, content_type)
                        samples[side]["peak"].append(peak_kb / 1e3)
                    del body
            floor, client_floor = (statistics.median(floors[k]) * 1e3 for k in ("copy", "client"))
            med = {s: {k: statistics.median(v) for k, v in samples[s].items() if v} for s in SIDES if samples[s]["total"]}
            for s in med:
                m = med[s]
                ours = SERVER_OF.get(s, "plugin") == "plugin"
                from_body = m["from_body"] * 1e3 if ours else ""
                if s == BARE:  # the client's side is ours; the server's is the floor
                    rows_out.append([label, mb, s, "", "", m["server"] * 1e3, "", "", "", m["total"] * 1e3, "", ""])
                    continue
                rows_out.append([label, mb, s, m["encode"] * 1e3, m["encode"] * 1e3 / floor, m["server"] * 1e3,
                                 from_body, from_body and from_body / floor, m["ipc"] * 1e3, m["total"] * 1e3,
                                 m["peak"], m["peak"] / mb])
            rows_out.append([label, mb, "floor: warm copy of the bytes", floor, 1.0, "", "", "", "", "", "", ""])
            rows_out.append([label, mb, HOT_COPY, hot_copy, hot_copy / floor, "", "", "", "", "", "", ""])
            rows_out.append([label, mb, CLIENT_FLOOR, client_floor, client_floor / floor, "", "", "", "", "", "", ""])
            stages = breakdown(rows)
            stage_rows += [[label, k, v, v / floor] for k, v in stages.items()]
            data["sizes"][label] = {"mb": mb, "warm_copy_ms": floor, "back_to_back_copy_ms": hot_copy,
                                   "client_floor_ms": client_floor,
                                   "floor_samples": floors, "samples": samples, "stages_ms": stages}
            if (n, hidden, dtype) == (2880, 4096, torch.bfloat16):
                for side in ("binary body, first send", "binary body, sent again"):
                    ms = med[side]["from_body"] * 1e3
                    verdicts.append(f"- server path from body received to the tokenizer manager, {side}, {label}: "
                                    f"{ms / floor:.1f}x the warm copy (target <= 8x): {'met' if ms <= 8 * floor else 'not met'}; "
                                    f"{ms / hot_copy:.1f}x the back-to-back copy")
                ms = med["binary body, first send"]["encode"] * 1e3
                verdicts.append(f"- client side (EmbedsEndpoint's writer and the body, a first send), {label}: "
                                f"{ms / floor:.1f}x the warm copy (target <= 4x): {'met' if ms <= 4 * floor else 'not met'}; "
                                f"{ms / hot_copy:.1f}x the back-to-back copy; "
                                f"its floor (the lookup and one BLAKE3 at the library's top speed): "
                                f"{client_floor / floor:.1f}x")
    finally:
        for s in servers.values():
            s.stop()
    head = (f"{provenance()}\nstand-in servers: SGLang's HTTP app (plugin installed / stock) under uvicorn, "
            f"a stand-in tokenizer manager (no model); served dtype float32; medians of {args.rounds} rounds "
            f"(stock: {args.stock_rounds}), sides alternating; one request at a time over urllib\n")
    text = head + table("one span's whole path without model compute",
                        ["span", "MB", "side", "client encode ms", "x warm copy", "server path from head ms",
                         "from body received ms", "x warm copy", "IPC trip ms", "request ms",
                         "server peak extra MB", "x span bytes"], rows_out)
    text += "\n" + table("our server path for a binary body, by stage (in this process, ms, medians of 7)",
                         ["span", "stage", "ms", "x warm copy"], stage_rows)
    if verdicts:
        text += "\n### Targets (issue #24)\n" + "\n".join(verdicts) + "\n"
    save("wire", data, text)


if __name__ == "__main__":
    sys.exit(main())
