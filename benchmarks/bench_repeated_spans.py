"""Repeated spans: many questions about one span, the ratio against stock SGLang split into causes.

Sides, all on the demo model in bfloat16 (stock SGLang's ``input_embeds`` path casts to bfloat16
and crashes a float32 server), all servers of the same build running side by side:

* ``stock JSON``: stock SGLang, full-prompt ``input_embeds`` as JSON lists; stock requires
  ``--disable-radix-cache`` for ``input_embeds``, so nothing is cached;
* ``ours JSON``: the plugin, the same full prompt as JSON lists (``input_embeds``): what the cache
  alone gives, on the same wire as stock;
* ``ours base64``: the plugin, the span as base64 bfloat16 inside ``input_segments`` (text as ids):
  adds the binary wire;
* ``ours base64, stock attention``: as above on a server with ``SGLANG_EMBEDS_CPU_ATTENTION=0``
  (SGLang's own torch-native extend attention instead of ours, which attends only the new queries).

Requests rotate over the sides question by question (the order shifts every question), so
machine noise hits all alike. Every question after the first is a sample: TTFT p50 and max.

    python benchmarks/bench_repeated_spans.py [--rows 256] [--questions 16] [--sweep 64,256,1024,2048] [--sweep-questions 9]
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import torch

from common import demo_dir, embedding_table, commit, machine, provenance, p50, post, save, server, table, tokenizer
from sgl_embeds_protocol import wire

PREFIX = "<|im_start|>user\nHere is an image: "
SIDES = ["stock JSON", "ours JSON", "ours base64", "ours base64, stock attention"]


def bodies(tok, table_, rows: torch.Tensor, n_questions: int) -> list[dict[str, dict]]:
    """Per question: the request body of each side (the same prompt on every side)."""
    pre = tok.encode(PREFIX, add_special_tokens=False)
    out = []
    for i in range(n_questions):
        q = tok.encode(f"\nQuestion {i}: what is shown in part {i} of it?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        full = torch.cat([table_[pre], rows, table_[q]]).bfloat16().float().tolist()
        segments = [{"type": "input_ids", "input_ids": pre}, {"type": "embeds", "embeds": wire.encode_tensor(rows, "base64", "bfloat16")},
                    {"type": "input_ids", "input_ids": q}]
        out.append({"stock JSON": {"input_embeds": full}, "ours JSON": {"input_embeds": full},
                    "ours base64": {"input_segments": segments}, "ours base64, stock attention": {"input_segments": segments}})
    return out


def run(urls: dict[str, str], items: list[dict[str, dict]], new_tokens: int) -> dict[str, list[dict]]:
    res = {side: [] for side in SIDES}
    for i, item in enumerate(items):
        for side in SIDES[i % len(SIDES):] + SIDES[:i % len(SIDES)]:
            b = {**item[side], "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
            out, dt = post(urls[side], b)
            meta = out["meta_info"]
            res[side].append({"t": dt, "prompt": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0)})
    return res


def summarize(rs: list[dict]) -> dict:
    later = [r["t"] for r in rs[1:]]
    return {"ttft_p50_later": p50(later), "ttft_max_later": max(later), "samples": len(later), "first": rs[0]["t"],
            "total": sum(r["t"] for r in rs), "computed": sum(r["prompt"] - r["cached"] for r in rs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--sweep", default="64,256,1024,2048")
    ap.add_argument("--sweep-questions", type=int, default=9)
    args = ap.parse_args()
    model = demo_dir()
    tok, table_ = tokenizer(model), embedding_table(model)
    g = torch.Generator().manual_seed(0)
    span = lambda n: table_[torch.randint(0, table_.shape[0], (n,), generator=g)]
    data = {"commit": commit(), "machine": machine()}
    with ExitStack() as stack:
        stock = stack.enter_context(server(model, False, ["--disable-radix-cache"], dtype="bfloat16"))
        ours = stack.enter_context(server(model, True, dtype="bfloat16"))
        ours_stock_attn = stack.enter_context(server(model, True, dtype="bfloat16", env={"SGLANG_EMBEDS_CPU_ATTENTION": "0"}))
        urls = {"stock JSON": stock.url, "ours JSON": ours.url, "ours base64": ours.url,
                "ours base64, stock attention": ours_stock_attn.url}
        main_res = {side: summarize(rs) for side, rs in run(urls, bodies(tok, table_, span(args.rows), args.questions), 1).items()}
        data["main"] = main_res
        base = main_res["stock JSON"]["ttft_p50_later"]
        rows_main = [[side, r["samples"], r["ttft_p50_later"], r["ttft_max_later"], r["first"], r["computed"], base / r["ttft_p50_later"]]
                     for side, r in main_res.items()]
        sweep_rows = []
        for n in [int(x) for x in args.sweep.split(",") if x]:
            res = {side: summarize(rs) for side, rs in run(urls, bodies(tok, table_, span(n), args.sweep_questions), 1).items()}
            data[f"sweep_{n}"] = res
            b = res["stock JSON"]["ttft_p50_later"]
            sweep_rows.append([n, res["stock JSON"]["samples"]] + [res[side]["ttft_p50_later"] for side in SIDES]
                              + [b / res["ours JSON"]["ttft_p50_later"], b / res["ours base64"]["ttft_p50_later"]])
    header = (f"{provenance()}\nSmolLM2-135M-Instruct bfloat16 on every side; 1 new token per question, so a "
              "request's time is its TTFT")
    text = header + table(f"{args.questions} questions about one {args.rows}-row span (samples: questions 2-{args.questions})",
                          ["side", "samples", "TTFT p50 (s)", "TTFT max (s)", "question 1 (s)", "prefill positions computed",
                           "stock JSON p50 / side p50"], rows_main)
    text += "\n" + table(f"span size sweep ({args.sweep_questions} questions each; TTFT p50 of questions 2-{args.sweep_questions})",
                          ["rows", "samples", *[f"{side} (s)" for side in SIDES], "stock JSON / ours JSON", "stock JSON / ours base64"],
                          sweep_rows)
    save("repeated_spans", data, text)
    plot(data)


def plot(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import RESULTS

    sweep = sorted((int(k.split("_")[1]), v) for k, v in data.items() if k.startswith("sweep_"))
    if not sweep:
        return
    xs = [n for n, _ in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    for side in SIDES:
        ax.plot(xs, [v[side]["ttft_p50_later"] for _, v in sweep], "o-", label=side)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("span rows")
    ax.set_ylabel("TTFT of repeat questions, p50 (s)")
    ax.legend()
    ax.set_title("Repeated spans on the demo model (CPU)")
    fig.tight_layout()
    fig.savefig(RESULTS / "repeated_spans.png", dpi=100)


if __name__ == "__main__":
    main()
