"""The binary request body vs JSON + base64, and row keys v3 (BLAKE3) vs v1, without a server.

For one span at the sizes real VLMs send (LLaVA-NeXT 2880 x 4096, LLaVA-1.5 576 x 4096, the demo
model's 4096 x 576; bfloat16 unless a size says otherwise), in this process, medians:

* decode: request body bytes -> the span parsed and checked, the code the server runs
  (JSON: ``orjson.loads`` + ``parse.segments_from_wire``, base64 decoded and values checked;
  binary: ``binary_body.decode_body`` + the same parser, values checked);
* encode: the request (a tensor) -> body bytes, the client's side;
* keys: the rows' placeholder ids and the handle, v1 (a blake2b per row, SHA-256 of the bytes)
  vs v3 (``keys.row_digests``: a keyed BLAKE3 per row, a key per dtype (v2, one key for every
  dtype, ran at the same speed), all rows in one native call, and the
  same digests one blake3 call per row as where no compiler built it; the handle from the
  digests), and the routing hint alone (``keys.route_rows``: the start of each row digest, free
  where the handle's digests are at hand);
* the floor: a warm copy of the same bytes into a buffer allocated beforehand, and one BLAKE3
  call over all of them (the library's top speed, no row keys).

    python benchmarks/bench_binary_body.py [--sizes 2880x4096,576x4096,4096x576,2880x4096:float32]
        [--threads N]

``--threads``: torch's intra-op threads (default: torch's own). On a machine whose other cores are
busy, a parallel reduction (the values check) waits for a time slice: ``--threads 1`` then
measures the code rather than the neighbours.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import orjson
import torch
from blake3 import blake3

from common import commit, machine, p50, provenance, save, table
from sgl_embeds_protocol import binary_body, keys, wire
from sgl_embeds_srt.parse import segments_from_wire
from sgl_embeds_srt.placeholders import placeholder_ids

LIMIT = 1 << 34


def ms(fn, repeat: int = 9) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return p50(samples)


def v1_keys(rows: torch.Tensor) -> tuple[list[bytes], str]:
    """Row keys v1 as they were: a blake2b per row, and the handle a SHA-256 of all the bytes."""
    raw = rows.view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    ids = [hashlib.blake2b(r.tobytes(), digest_size=8, person=b"sgl_embeds").digest() for r in raw]
    handle = hashlib.sha256(f"{rows.dtype}{list(rows.shape)}".encode())
    handle.update(keys.raw_bytes(rows))
    return ids, handle.hexdigest()


def v3_keys(rows: torch.Tensor) -> tuple[list[int], str]:
    digests = keys.row_digests(rows)
    return placeholder_ids(rows, digests=digests), keys.content_key(rows, digests)


def measure(n: int, hidden: int, dtype: str) -> dict[str, float]:
    rows = torch.randn(n, hidden, generator=torch.Generator().manual_seed(0)).to(wire.DTYPES[dtype])
    request = lambda span: {"input_segments": [{"type": "text", "text": "Describe "},
                                               {"type": "embeds", "embeds": span}]}
    json_body = orjson.dumps(request(wire.encode_tensor(rows)))
    binary, _ = binary_body.encode_body(request(rows))
    raw = keys.raw_bytes(rows)
    source = np.frombuffer(raw, np.uint8)
    target = np.empty_like(source)
    return {
        "floor: warm copy of the bytes": ms(lambda: np.copyto(target, source)),
        "floor: one BLAKE3 over the bytes": ms(lambda: blake3(raw).digest()),
        "decode: JSON + base64": ms(lambda: segments_from_wire(
            orjson.loads(json_body)["input_segments"], LIMIT)),
        "decode: binary body": ms(lambda: segments_from_wire(
            binary_body.decode_body(binary, LIMIT)["input_segments"], LIMIT)),
        "encode: JSON + base64": ms(lambda: orjson.dumps(request(wire.encode_tensor(rows)))),
        "encode: binary body": ms(lambda: binary_body.encode_body(request(rows))),
        "keys v1: blake2b per row + SHA-256": ms(lambda: v1_keys(rows)),
        "keys v3: BLAKE3 per row, handle from digests (native)": ms(lambda: v3_keys(rows)),
        "keys v3: the same digests, one blake3 call per row": ms(
            lambda: keys.row_digests_by_row(raw, raw.nbytes // n, keys.row_blake3_key(rows.dtype))),
        "keys v3: handle alone (client)": ms(lambda: keys.content_key(rows)),
        "routing hint alone (row digests' starts)": ms(lambda: keys.route_rows(rows)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2880x4096,576x4096,4096x576,2880x4096:float32")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data: dict = {"commit": commit(), "machine": machine(), "torch_threads": torch.get_num_threads()}
    out = []
    for size in args.sizes.split(","):
        shape, _, dtype = size.partition(":")
        n, hidden = (int(v) for v in shape.split("x"))
        dtype = dtype or "bfloat16"
        nbytes = n * hidden * wire.DTYPES[dtype].itemsize
        results = measure(n, hidden, dtype)
        data[f"{n}x{hidden}/{dtype}"] = results
        for stage, t in results.items():
            out.append([f"{n}x{hidden} {dtype}", nbytes / 1e6, stage, t, nbytes / t / 1e6])
    title = f"one span, in process, {torch.get_num_threads()} torch threads (medians of 9)"
    text = f"{provenance()}\n" + table(title,
                                       ["span", "MB", "stage", "ms", "GB/s of span bytes"], out)
    save("binary_body", data, text)


if __name__ == "__main__":
    main()
