"""Wire formats: JSON float lists vs base64 float32 / float16 / bfloat16.

For spans of 256 to 8192 rows at hidden sizes 576 to 4096: bytes on the wire, client encode
time (tensor -> request body bytes), server decode + validate time (body bytes -> checked tensor,
the same code the server runs), and end-to-end latency of one span prompt (1 new token) through a
server on the demo model (hidden 576).

    python benchmarks/bench_wire.py [--rows 256,1024,8192] [--hidden 576,4096] [--no-e2e]
"""

from __future__ import annotations

import argparse
import time

import orjson
import torch

from common import demo_dir, commit, machine, provenance, post, save, server, table
from sgl_embeds_srt import wire
from sgl_embeds_srt.parse import segments_from_wire

FORMATS = [("json", None), ("base64", "float32"), ("base64", "float16"), ("base64", "bfloat16")]


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(rows: int, hidden: int, fmt: str, dtype: str | None) -> dict:
    x = torch.randn(rows, hidden)
    repeat = 1 if fmt == "json" and rows * hidden > 4_000_000 else 3
    body = lambda: orjson.dumps({"input_segments": [{"type": "embeds", "embeds": wire.encode_tensor(x, fmt, dtype)}]})
    encode = best_of(body, repeat)
    raw = body()
    decode = best_of(lambda: [wire.check_tensor(s.tensor, hidden) for s in segments_from_wire(orjson.loads(raw)["input_segments"], 1 << 34)], repeat)
    return {"bytes": len(raw), "encode_s": encode, "decode_s": decode, "raw": raw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,1024,8192")
    ap.add_argument("--hidden", default="576,4096")
    ap.add_argument("--no-e2e", action="store_true")
    args = ap.parse_args()
    data, rows_out = {"commit": commit(), "machine": machine()}, []
    for hidden in [int(h) for h in args.hidden.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            results = {f"{f}/{d or 'f32'}": measure(rows, hidden, f, d) for f, d in FORMATS}
            base = results["json/f32"]
            for name, r in results.items():
                rows_out.append([rows, hidden, name, r["bytes"] / 1e6, r["encode_s"] * 1e3, r["decode_s"] * 1e3, base["decode_s"] / r["decode_s"]])
                data[f"{rows}x{hidden}/{name}"] = {k: v for k, v in r.items() if k != "raw"}
    text = f"{provenance()}\n" + table("wire formats (best of 3; one run for JSON above 4M values)",
                                               ["rows", "hidden", "format", "MB", "encode ms", "decode+validate ms", "decode speedup vs JSON"], rows_out)
    if not args.no_e2e:
        e2e_rows = []
        with server(demo_dir(), True) as s:
            for rows in [int(r) for r in args.rows.split(",") if int(r) < 8000]:  # the demo model's context is 8192
                x = torch.randn(rows, 576) * 0.02
                for f, d in FORMATS:
                    body = {"input_segments": [{"type": "text", "text": "Describe"}, {"type": "embeds", "embeds": wire.encode_tensor(x, f, d)}],
                            "sampling_params": {"max_new_tokens": 1}}
                    post(s.url, {**body, "sampling_params": {"max_new_tokens": 1}})  # warm: prefix cached, the same for every format
                    t = min(post(s.url, body)[1] for _ in range(2))
                    e2e_rows.append([rows, f"{f}/{d or 'f32'}", t * 1e3])
                    data[f"e2e/{rows}/{f}/{d or 'f32'}"] = t
        text += "\n" + table("end to end, one cached span prompt, 1 new token (demo model, hidden 576)", ["rows", "format", "latency ms"], e2e_rows)
    save("wire", data, text)


if __name__ == "__main__":
    main()
