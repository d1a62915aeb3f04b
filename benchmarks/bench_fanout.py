"""Fork fan-out: 8 branches after one span cost about one span of prefill, not eight.

sgl_embeds runs an ``@sgl.function`` that forks 8 branches after the span (fork commits the shared
prefix once, then the branches run concurrently, each computing only its own tokens). Stock SGLang
cannot cache ``input_embeds``, so each branch is a full-prompt request with the radix cache
disabled; its 8 requests are sent concurrently too (8 threads), so both sides send the same way.
Rounds alternate A/B (B/A), each with a fresh span and a flushed cache. "Prefill positions
computed" is read from each server's own counters (``sglang:prompt_tokens_total`` minus
``sglang:cached_tokens_total``), so it includes the fork's prefix commit.

    python benchmarks/bench_fanout.py [--rows 256] [--branches 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import time

import requests
import sglang as sgl
import torch

import sgl_embeds  # noqa: F401
from common import demo_dir, embedding_table, commit, machine, provenance, p50, post, save, server, table, tokenizer
from sgl_embeds.backend import EmbedsEndpoint


@sgl.function
def fan_out(s, span, branches):
    s += "Here is an image: " + sgl.embeds(span) + "\n"
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += f"Attribute {i} of the image is" + sgl.gen("v", max_tokens=4, temperature=0, ignore_eos=True)
    s["usage"] = [(f.get_meta_info("v")["prompt_tokens"], f.get_meta_info("v")["cached_tokens"]) for f in forks]


def computed(url: str) -> float:
    """Prefill positions the server has computed so far (its prompt tokens minus cached ones)."""
    text = requests.get(url + "/metrics", timeout=30).text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return total("sglang:prompt_tokens_total") - total("sglang:cached_tokens_total")


def run_ours(url: str, backend: EmbedsEndpoint, span: torch.Tensor, branches: int) -> tuple[float, float]:
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()
    before, t0 = computed(url), time.perf_counter()
    state = fan_out.run(span=span, branches=branches, backend=backend)
    state["usage"]  # waits for every branch
    return time.perf_counter() - t0, computed(url) - before


def run_stock(url: str, tok, table_: torch.Tensor, span: torch.Tensor, branches: int) -> tuple[float, float]:
    prefix = tok.encode("Here is an image: ", add_special_tokens=True)
    bodies = []
    for i in range(branches):
        tail = tok.encode(f"\nAttribute {i} of the image is", add_special_tokens=False)
        full = torch.cat([table_[prefix], span, table_[tail]]).bfloat16().float().tolist()
        bodies.append({"input_embeds": full, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
    before, t0 = computed(url), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(branches) as pool:
        list(pool.map(lambda b: post(url, b), bodies))
    return time.perf_counter() - t0, computed(url) - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    model = demo_dir()
    tok, table_ = tokenizer(model), embedding_table(model)
    gen = torch.Generator().manual_seed(1)
    metrics = ["--enable-metrics", "--enable-cache-report"]
    res = {"stock": {"t": [], "computed": []}, "ours": {"t": [], "computed": []}}
    with server(model, True, metrics, dtype="bfloat16") as ours, \
            server(model, False, ["--disable-radix-cache", *metrics], dtype="bfloat16") as stock:
        backend = EmbedsEndpoint(ours.url)
        for r in range(args.rounds):
            span = table_[torch.randint(0, table_.shape[0], (args.rows,), generator=gen)]
            sides = [("ours", lambda: run_ours(ours.url, backend, span, args.branches)),
                     ("stock", lambda: run_stock(stock.url, tok, table_, span, args.branches))]
            for name, run in sides if r % 2 == 0 else sides[::-1]:
                t, c = run()
                res[name]["t"].append(t)
                res[name]["computed"].append(c)
    st, ou = p50(res["stock"]["t"]), p50(res["ours"]["t"])
    sc, oc = p50(res["stock"]["computed"]), p50(res["ours"]["computed"])
    rows = [["wall time per fan-out (s), median", st, ou, st / ou],
            ["prefill positions computed per fan-out, median (incl. the fork's prefix commit)", sc, oc, sc / max(oc, 1)],
            ["span rows", args.rows, args.rows, "-"]]
    header = (f"{provenance()}\nSmolLM2-135M-Instruct bfloat16 both sides; both send their {args.branches} branch "
              "requests concurrently; caches flushed each round")
    text = header + table(f"{args.branches} branches after a {args.rows}-row span, {args.rounds} rounds A/B",
                          ["metric", "stock (no cache)", "sgl_embeds", "stock / ours"], rows)
    save("fanout", {"commit": commit(), "machine": machine(), "rounds": args.rounds, "results": res}, text)


if __name__ == "__main__":
    main()
