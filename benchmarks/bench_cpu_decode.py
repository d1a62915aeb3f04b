"""Decode throughput on CPU: SGLang (with the CPU launch defaults) vs HF transformers ``generate``
on the same weights and thread count, at batch 1 and batch 8 (demo model, float32, greedy).

    python benchmarks/bench_cpu_decode.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import demo_dir, commit, machine, provenance, p50, post, save, server, table

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def sglang_tps(url: str, batch: int, tokens: int) -> float:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}
    post(url, {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 1}})  # prefix cached
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda _: post(url, body)[0], range(batch)))
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t0)


def hf_tps(model, tok, batch: int, tokens: int) -> float:
    ids = tok([PROMPT] * batch, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return batch * (out.shape[1] - ids["input_ids"].shape[1]) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = demo_dir()
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    with server(model_dir, True) as s:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for batch in (1, 8):
            sg, h = [], []
            for _ in range(args.repeats):  # alternate the two sides
                sg.append(sglang_tps(s.url, batch, args.tokens))
                h.append(hf_tps(hf, tok, batch, args.tokens))
            results[batch] = {"sglang": p50(sg), "hf": p50(h)}
    rows = [[b, r["sglang"], r["hf"], r["sglang"] / r["hf"]] for b, r in results.items()]
    text = f"{provenance()}; SmolLM2-135M-Instruct float32, {args.tokens} new tokens, {threads} threads\n" + table(
        "decode throughput on CPU (tok/s, median of alternating repeats)", ["batch", "SGLang", "HF generate", "SGLang / HF"], rows)
    save("cpu_decode", {"commit": commit(), "machine": machine(), "threads": threads, **{str(k): v for k, v in results.items()}}, text)


if __name__ == "__main__":
    main()
