"""No tax on text: text-only throughput with the plugin loaded vs stock SGLang, same flags.

Rounds alternate between the two servers (A/B/B/A...) so machine noise hits both alike. Each
round sends the same set of text prompts with a fixed concurrency and ``ignore_eos``.

    python benchmarks/bench_text_tax.py [--rounds 6] [--requests 16] [--concurrency 8] [--tokens 32]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from common import demo_dir, commit, machine, provenance, p50, post, save, server, table


def round_trip(url: str, n: int, conc: int, tokens: int) -> tuple[float, int]:
    bodies = [{"text": f"Write a short note number {i} about the sea.", "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}
              for i in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as pool:
        outs = list(pool.map(lambda b: post(url, b)[0], bodies))
    dt = time.perf_counter() - t0
    return dt, sum(o["meta_info"]["completion_tokens"] for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    model = demo_dir()
    tput = {"plugin": [], "stock": []}
    with server(model, True) as ours, server(model, False) as stock:
        for url in (ours.url, stock.url):  # warm both
            round_trip(url, 2, 2, 4)
        for r in range(args.rounds):
            order = [("plugin", ours.url), ("stock", stock.url)]
            for side, url in order if r % 2 == 0 else order[::-1]:
                dt, toks = round_trip(url, args.requests, args.concurrency, args.tokens)
                tput[side].append(toks / dt)
    a, b = p50(tput["plugin"]), p50(tput["stock"])
    text = f"{provenance()}; float32, {args.requests} requests x {args.tokens} tokens, concurrency {args.concurrency}\n" + table(
        f"text-only throughput, median of {args.rounds} alternating rounds",
        ["side", "tok/s p50", "min", "max"],
        [["stock SGLang", b, min(tput["stock"]), max(tput["stock"])], ["with sgl_embeds plugin", a, min(tput["plugin"]), max(tput["plugin"])],
         ["ratio plugin / stock", a / b, "-", "-"]])
    save("text_tax", {"commit": commit(), "machine": machine(), **tput, "ratio": a / b}, text)


if __name__ == "__main__":
    main()
