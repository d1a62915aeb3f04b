"""Repeated spans: many questions about one span, sgl_embeds (radix cache on) vs stock SGLang
``input_embeds`` (which requires ``--disable-radix-cache``), on the demo model, same build.

Both servers run side by side and requests alternate between them (A/B, order flipped every
question) so machine noise hits both alike. Both run bfloat16: stock SGLang's ``input_embeds``
path casts to bfloat16 and crashes a float32 server.

    python benchmarks/bench_repeated_spans.py [--rows 256] [--questions 16] [--sweep 64,256,1024,2048]
"""

from __future__ import annotations

import argparse

import torch

from common import demo_dir, embedding_table, machine, p50, pct, post, save, server, table, tokenizer
from sgl_embeds import wire

PREFIX = "<|im_start|>user\nHere is an image: "


def prompts(tok, table_, rows: torch.Tensor, n_questions: int):
    pre = tok.encode(PREFIX, add_special_tokens=False)
    out = []
    for i in range(n_questions):
        q = tok.encode(f"\nQuestion {i}: what is shown in part {i} of it?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        ours = [{"type": "input_ids", "input_ids": pre}, {"type": "embeds", "embeds": wire.encode_tensor(rows, "base64", "bfloat16")},
                {"type": "input_ids", "input_ids": q}]
        full = torch.cat([table_[pre], rows, table_[q]]).bfloat16().float()
        out.append((ours, full.tolist(), len(pre) + rows.shape[0] + len(q)))
    return out, len(pre) + rows.shape[0]


def run_pass(ours_url, stock_url, items, new_tokens):
    res = {"ours": [], "stock": []}
    for i, (ours, stock, n) in enumerate(items):
        order = [("ours", ours_url, {"input_segments": ours}), ("stock", stock_url, {"input_embeds": stock})]
        for side, url, body in order if i % 2 == 0 else order[::-1]:
            body = {**body, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
            out, dt = post(url, body)
            meta = out["meta_info"]
            res[side].append({"t": dt, "prompt": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0)})
    return res


def summarize(res, side):
    rs = res[side]
    later = [r["t"] for r in rs[1:]]
    computed = sum(r["prompt"] - r["cached"] for r in rs)
    return {"ttft_p50_later": p50(later), "ttft_p99_later": pct(later, 0.99), "first": rs[0]["t"],
            "total": sum(r["t"] for r in rs), "computed": computed, "prompt": sum(r["prompt"] for r in rs),
            "hit_rate": sum(r["cached"] for r in rs) / sum(r["prompt"] for r in rs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--sweep", default="64,256,1024,2048")
    ap.add_argument("--sweep-questions", type=int, default=4)
    args = ap.parse_args()
    model = demo_dir()
    tok, table_ = tokenizer(model), embedding_table(model)
    g = torch.Generator().manual_seed(0)
    span = lambda n: table_[torch.randint(0, table_.shape[0], (n,), generator=g)]
    data, text = {"machine": machine()}, f"machine: {machine()}; demo model SmolLM2-135M-Instruct, bfloat16 both sides"
    with server(model, True, dtype="bfloat16") as ours, server(model, False, ["--disable-radix-cache"], dtype="bfloat16") as stock:
        # decode step time, for the bound on total time
        _, t1 = post(ours.url, {"text": "hello", "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}})
        _, t33 = post(ours.url, {"text": "hello", "sampling_params": {"max_new_tokens": 33, "ignore_eos": True}})
        step = (t33 - t1) / 32
        rows_main = []
        for new_tokens in (1, 16):
            items, shared = prompts(tok, table_, span(args.rows), args.questions)
            res = run_pass(ours.url, stock.url, items, new_tokens)
            a, b = summarize(res, "ours"), summarize(res, "stock")
            unique = shared + sum(n - shared for _, _, n in items)  # the shared part once, each question's own
            data[f"main_{new_tokens}"] = {"ours": a, "stock": b, "unique_positions": unique}
            if new_tokens == 1:
                rows_main += [["TTFT p50, questions 2-N (s)", b["ttft_p50_later"], a["ttft_p50_later"], b["ttft_p50_later"] / a["ttft_p50_later"]],
                              ["TTFT p99, questions 2-N (s)", b["ttft_p99_later"], a["ttft_p99_later"], b["ttft_p99_later"] / a["ttft_p99_later"]],
                              ["TTFT, question 1 (s)", b["first"], a["first"], b["first"] / a["first"]],
                              ["total time, 1 new token (s)", b["total"], a["total"], b["total"] / a["total"]],
                              ["prefill positions computed", b["computed"], a["computed"], b["computed"] / a["computed"]],
                              ["unique positions in the workload", unique, unique, 1.0],
                              ["cache hit rate", b["hit_rate"], a["hit_rate"], "-"]]
            else:
                bound = args.questions * 15 * step
                rows_main += [["total time, 16 new tokens (s)", b["total"], a["total"], b["total"] / a["total"]],
                              ["decode-time bound (N x 15 steps) (s)", bound, bound, "-"]]
        text += "\n" + table(f"{args.questions} questions about one {args.rows}-row span (decode step {step * 1000:.1f} ms)",
                             ["metric", "stock (no cache)", "sgl_embeds", "stock / ours"], rows_main)
        sweep_rows = []
        for n in [int(x) for x in args.sweep.split(",") if x]:
            res = run_pass(ours.url, stock.url, prompts(tok, table_, span(n), args.sweep_questions)[0], 1)
            a, b = summarize(res, "ours"), summarize(res, "stock")
            data[f"sweep_{n}"] = {"ours": a, "stock": b}
            sweep_rows.append([n, b["ttft_p50_later"], a["ttft_p50_later"], b["ttft_p50_later"] / a["ttft_p50_later"], b["computed"], a["computed"]])
        text += "\n" + table(f"span size sweep ({args.sweep_questions} questions each, TTFT of questions 2-N)",
                             ["rows", "stock p50 (s)", "ours p50 (s)", "speedup", "stock computed", "ours computed"], sweep_rows)
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
    ax.plot(xs, [v["stock"]["ttft_p50_later"] for _, v in sweep], "o-", label="stock input_embeds (no cache)")
    ax.plot(xs, [v["ours"]["ttft_p50_later"] for _, v in sweep], "o-", label="sgl_embeds (cache on)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("span rows")
    ax.set_ylabel("TTFT of repeat questions, p50 (s)")
    ax.legend()
    ax.set_title("Repeated spans on the demo model (CPU)")
    fig.tight_layout()
    fig.savefig(RESULTS / "repeated_spans.png", dpi=100)


if __name__ == "__main__":
    main()
