"""Fork fan-out: 8 branches after one span cost about one span of prefill, not eight.

sgl_embeds runs an ``@sgl.function`` that forks 8 branches after the span (fork commits the shared
prefix once, then each branch computes only its own tokens). Stock SGLang cannot cache
``input_embeds``, so each branch is a full-prompt request with the radix cache disabled.

    python benchmarks/bench_fanout.py [--rows 256] [--branches 8]
"""

from __future__ import annotations

import argparse
import time

import sglang as sgl
import torch

import sgl_embeds  # noqa: F401
from common import demo_dir, embedding_table, machine, post, save, server, table, tokenizer
from sgl_embeds.backend import EmbedsEndpoint


@sgl.function
def fan_out(s, span, branches):
    s += "Here is an image: " + sgl.embeds(span) + "\n"
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += f"Attribute {i} of the image is" + sgl.gen("v", max_tokens=4, temperature=0, ignore_eos=True)
    s["usage"] = [(f.get_meta_info("v")["prompt_tokens"], f.get_meta_info("v")["cached_tokens"]) for f in forks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--branches", type=int, default=8)
    args = ap.parse_args()
    model = demo_dir()
    tok, table_ = tokenizer(model), embedding_table(model)
    span = table_[torch.randint(0, table_.shape[0], (args.rows,), generator=torch.Generator().manual_seed(1))]
    with server(model, True, dtype="bfloat16") as ours, server(model, False, ["--disable-radix-cache"], dtype="bfloat16") as stock:
        backend = EmbedsEndpoint(ours.url)
        t0 = time.perf_counter()
        state = fan_out.run(span=span, branches=args.branches, backend=backend)
        ours_t = time.perf_counter() - t0
        ours_computed = sum(p - c for p, c in state["usage"])
        prefix = tok.encode("Here is an image: ", add_special_tokens=True)
        t0, stock_computed = time.perf_counter(), 0
        for i in range(args.branches):
            tail = tok.encode(f"\nAttribute {i} of the image is", add_special_tokens=False)
            full = torch.cat([table_[prefix], span, table_[tail]]).bfloat16().float().tolist()
            out, _ = post(stock.url, {"input_embeds": full, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
            stock_computed += out["meta_info"]["prompt_tokens"] - out["meta_info"].get("cached_tokens", 0)
        stock_t = time.perf_counter() - t0
    rows = [["wall time (s)", stock_t, ours_t, stock_t / ours_t],
            ["prefill positions computed (branches)", stock_computed, ours_computed, stock_computed / max(ours_computed, 1)],
            ["span rows", args.rows, args.rows, "-"]]
    text = f"machine: {machine()}; bfloat16 both sides\n" + table(
        f"{args.branches} branches after a {args.rows}-row span (ours: the fork's prefix commit is one extra prefill of the span, not counted in the branches)",
        ["metric", "stock (no cache)", "sgl_embeds", "stock / ours"], rows)
    save("fanout", {"machine": machine(), "ours_s": ours_t, "stock_s": stock_t, "ours_computed": ours_computed,
                    "stock_computed": stock_computed, "usage": state["usage"]}, text)


if __name__ == "__main__":
    main()
