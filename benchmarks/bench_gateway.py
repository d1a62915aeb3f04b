"""Two workers behind SGLang's gateway (smg): cache-aware routing that sees spans vs round-robin.

Both sides are the same two plugin workers (demo model, float32) and the same client
(``EmbedsEndpoint`` with ``span_handles=False``: base64 rows inline every time, the routing hint in
``text``); only the gateway's ``--policy`` differs: ``cache_aware`` or ``round_robin``. (With
handles, a round-robin request that reaches the worker without the span is refused and resent,
and with two workers the resend lands on the other one, which holds it: every repeat then hits,
at the price of a second round trip, and the comparison would measure that instead of routing.) Per side and round:
16 fresh 256-row spans (rows of the model's own embedding table), 4 questions about each, asked
in interleaved order (every span's first question, then every span's second one, ..., each pass
in a shuffled order, the same shuffles for both sides: with a fixed order round-robin would send
each span back to the same worker by accident), one new token each,
so a request's time is its time to first token. Before each side runs, both workers' caches are
flushed and the client is new. Sides alternate A/B, B/A over the rounds. Reported over questions
2-4 of every span: the share whose ``cached_tokens`` cover the span, and TTFT p50, mean and p90.

    python benchmarks/bench_gateway.py [--rounds 2] [--rows 256]
"""

from __future__ import annotations

import argparse
import time
from statistics import mean

import requests
import torch

import sgl_embeds  # noqa: F401
from common import commit, demo_dir, embedding_table, machine, p50, pct, provenance, save, table
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_protocol.segments import Span, Text
from sgl_embeds_testing.server import Gateway, Server, start_all

SPANS, QUESTIONS = 16, 4
POLICIES = {"cache-aware, sees spans": "cache_aware", "round-robin": "round_robin"}


def run_side(gateway: Gateway, workers: list[Server], spans: list[torch.Tensor], orders: list[list[int]]) -> dict:
    for w in workers:
        requests.post(w.url + "/flush_cache", timeout=60).raise_for_status()
    client = EmbedsEndpoint(gateway.url, span_handles=False)
    hits, ttft = [], []
    for q in range(QUESTIONS):
        for rows in (spans[i] for i in orders[q]):
            t0 = time.perf_counter()
            out = client.run(input_segments=[Text("Look at this:"), Span(rows), Text(f" Question {q}: what is it?")],
                             sampling_params={"temperature": 0, "max_new_tokens": 1})
            dt = time.perf_counter() - t0
            if q:
                hits.append(out["meta_info"]["cached_tokens"] >= len(rows))
                ttft.append(dt)
    return {"hits": hits, "ttft": ttft}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    table_rows = embedding_table(demo_dir())
    gen = torch.Generator().manual_seed(0)
    workers = start_all([Server(demo_dir()) for _ in range(2)])
    gateways = {}
    try:
        for name, policy in POLICIES.items():
            gateways[name] = Gateway([w.url for w in workers], ["--policy", policy]).start()
        results = {name: {"hits": [], "ttft": []} for name in POLICIES}
        order = list(POLICIES)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                spans = [table_rows[torch.randint(len(table_rows), (args.rows,), generator=gen)] for _ in range(SPANS)]
                orders = [torch.randperm(SPANS, generator=torch.Generator().manual_seed(r * 10 + q)).tolist()
                          for q in range(QUESTIONS)]
                side = run_side(gateways[name], workers, spans, orders)
                for k in side:
                    results[name][k].extend(side[k])
    finally:
        for g in gateways.values():
            g.stop()
        for w in workers:
            w.stop()
    a, b = (results[name] for name in POLICIES)
    rows = [
        ["repeat questions hitting the span's cache", f"{sum(a['hits'])}/{len(a['hits'])}", f"{sum(b['hits'])}/{len(b['hits'])}", "-"],
        ["TTFT p50, questions 2-4 (s)", p50(a["ttft"]), p50(b["ttft"]), p50(b["ttft"]) / p50(a["ttft"])],
        ["TTFT mean, questions 2-4 (s)", mean(a["ttft"]), mean(b["ttft"]), mean(b["ttft"]) / mean(a["ttft"])],
        ["TTFT p90, questions 2-4 (s)", pct(a["ttft"], 0.9), pct(b["ttft"], 0.9), pct(b["ttft"], 0.9) / pct(a["ttft"], 0.9)],
    ]
    header = (f"{provenance()}\nsmg 1.13.0 in front of 2 workers (SmolLM2-135M-Instruct float32, plugin); client "
              f"EmbedsEndpoint(span_handles=False) on both sides; {SPANS} spans x {QUESTIONS} questions per side and round, caches flushed "
              "between sides; ratio = round-robin / cache-aware")
    names = list(POLICIES)
    text = header + table(f"{SPANS} spans of {args.rows} rows x {QUESTIONS} questions, 2 workers behind smg",
                          ["metric", names[0], names[1], "ratio"], rows)
    save("gateway", {"commit": commit(), "machine": machine(), "rounds": args.rounds, "rows": args.rows,
                     "results": results}, text)


if __name__ == "__main__":
    main()
