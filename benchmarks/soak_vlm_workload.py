"""The VLM chat workload of ``bench_vlm_workload.py`` for a fixed time on one server of ours, to
find errors and unbounded growth (issue #35, item 4): memory after warm-up must stay flat and no
turn may fail.

One server with the plugin serves the random-weight ``testing.qwen_vl.bench_qwen2_5_vl_dir``.
Episodes of ``--users`` concurrent multi-turn chats follow each other until ``--minutes`` have
passed, each with a new plan (new images, so every cache keeps filling), alternating the two arms
of ours: spans inline and spans by handle. Each arm keeps one client for the whole run (its
``EncoderCache`` and its held spans live as long as a real client's), and the users are the same
threads for the whole run (a client process does not start new threads for every chat). After each episode it
records the server's resident memory (its scheduler and detokenizer included), the client's, the
server's span store and the rows it holds for the scheduler (``/sgl_embeds/info``), and the
client caches' sizes. Errors are counted per episode, not raised.

Every store on the way is bounded: the server's span store and the rows it holds for the scheduler
(``SGLANG_EMBEDS_HANDLE_BYTES``, each), the client's ``EncoderCache`` (``max_bytes``), SGLang's KV
pool. Memory is flat only once they are full, so ``--server-cache-mib`` and
``--client-cache-mib`` set budgets small enough to fill during the warm-up (the defaults, 1 GiB
and 256 MiB, take longer than ten minutes of this workload to fill).

    python benchmarks/soak_vlm_workload.py [--minutes 10] [--users 4] [--turns 3] [--reuse 0.5]
        [--image-side 448] [--warmup-minutes 2] [--server-cache-mib 64] [--client-cache-mib 32]
        [--name vlm_soak] [--reanalyze]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import requests
from transformers import AutoTokenizer

from common import RESULTS, make_server, provenance, save, table
from sgl_embeds_testing.qwen_vl import bench_qwen2_5_vl_dir
from sgl_embeds.vision import EncoderCache
from workload import ARMS, ArmClient, plan_turns, pool_image, process_rss, rss, run_episode
from sgl_embeds.vlm import QwenVLEncoder

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report"]
OURS = [arm for arm in ARMS if arm != "stock raw image"]


def slope_mib_per_min(samples: list[dict], value) -> float:
    """The least-squares slope of ``value(sample)`` (bytes) over the samples' times, MiB a minute."""
    t = np.array([s["t_s"] / 60 for s in samples])
    y = np.array([value(s) / 2**20 for s in samples])
    return float(np.polyfit(t, y, 1)[0])


def sample(url: str, server_pid: int, clients: dict[str, ArmClient], t0: float) -> dict:
    """Memory and cache sizes now."""
    info = requests.get(url + "/sgl_embeds/info", timeout=30).json()
    return {
        "t_s": time.perf_counter() - t0,
        "server_rss": rss([server_pid]),
        "server_processes_rss": process_rss(server_pid),
        "client_rss": rss([psutil.Process().pid], children=False),
        "span_store": info["span_store"], "rows_to_scheduler": info["rows_to_scheduler"],
        "encoder_cache": {arm: c.cache.stats() for arm, c in clients.items()},
        "held_spans": {arm: c.writer.held.sizes()[0] for arm, c in clients.items() if c.writer.held is not None},
    }


def run(args: argparse.Namespace) -> dict:
    model_dir = bench_qwen2_5_vl_dir()
    encoder = QwenVLEncoder(model_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = make_server(model_dir, plugin=True, extra=MM_ARGS,
                         env={"SGLANG_EMBEDS_HANDLE_BYTES": str(args.server_cache_mib << 20)}).start()
    clients = {arm: ArmClient(arm, server.url, encoder, tokenizer, args.image_side, args.answer_tokens,
                              cache=EncoderCache(args.client_cache_mib << 20))
               for arm in OURS}
    episodes, samples = [], []
    users_pool = ThreadPoolExecutor(args.users)  # the users' threads live as long as the run
    try:
        t0 = time.perf_counter()
        samples.append(sample(server.url, server.proc.pid, clients, t0))
        i = 0
        while time.perf_counter() - t0 < args.minutes * 60:
            arm = OURS[i % len(OURS)]
            plan = plan_turns(args.users, args.turns, args.reuse, seed=10_000 + i, image_side=args.image_side)
            try:
                out = run_episode(clients[arm], plan, users_pool=users_pool)
                episodes.append({"arm": arm, "turns": out["turns"], "errors": 0, "resent": out["resent"],
                                 "requests_per_s": out["requests_per_s"]})
            except Exception as e:  # noqa: BLE001 - counted: the soak's first verdict
                episodes.append({"arm": arm, "turns": 0, "errors": 1, "error": repr(e)[:500]})
            clients[arm].forget_prepared()  # the harness's own pixels, not a client's memory
            pool_image.cache_clear()  # likewise its images (an LRU of 512: ~300 MiB at 448x448)
            samples.append(sample(server.url, server.proc.pid, clients, t0))
            print(f"{samples[-1]['t_s']:6.0f} s  episode {i} {arm}: {episodes[-1]}  server RSS "
                  f"{samples[-1]['server_rss'] / 2**20:.0f} MiB", flush=True)
            i += 1
    finally:
        users_pool.shutdown()
        server.stop()
    return {"episodes": episodes, "samples": samples}


def verdict(results: dict, warmup_s: float) -> dict:
    """Growth after warm-up: the last sample's memory against the first sample after warm-up, and
    the least-squares slope over all samples after it (a trend the sample-to-sample noise hides)."""
    after = [s for s in results["samples"] if s["t_s"] >= warmup_s]
    if len(after) < 2:
        raise SystemExit(f"fewer than two samples after the {warmup_s:.0f} s warm-up: run longer")
    first, last = after[0], after[-1]
    growth = {k: (last[k] - first[k]) / first[k] for k in ("server_rss", "client_rss")}
    return {"turns": sum(e["turns"] for e in results["episodes"]),
            "errors": sum(e["errors"] for e in results["episodes"]),
            "episodes": len(results["episodes"]), "warmup_s": warmup_s,
            "after_warmup": {k: (first[k], max(s[k] for s in after), last[k]) for k in ("server_rss", "client_rss")},
            "growth": growth,
            "slope_mib_per_min": {
                **{k: slope_mib_per_min(after, lambda s, k=k: s[k]) for k in ("server_rss", "client_rss")},
                **{name: slope_mib_per_min(after, lambda s, n=name: s["server_processes_rss"].get(n, 0))
                   for name in last["server_processes_rss"]}}}


def report(results: dict, v: dict, args: argparse.Namespace, measured: str) -> str:
    mib = lambda b: f"{b / 2**20:.0f}"
    slope = v["slope_mib_per_min"]
    rows = [[name, *(mib(x) for x in v["after_warmup"][key]), f"{v['growth'][key]:+.1%}", f"{slope[key]:+.1f}"]
            for name, key in (("server (all its processes)", "server_rss"), ("client", "client_rss"))]
    rows += [[f"server: {name}", "", "", "", "", f"{slope[name]:+.1f}"]
             for name in results["samples"][-1]["server_processes_rss"]]
    last = results["samples"][-1]
    text = f"Measured: {measured}\n"
    text += (f"\n{args.minutes} minutes, {args.users} concurrent users, {args.turns} turns each, "
             f"reuse {args.reuse:.0%}, {args.image_side}x{args.image_side} images, arms {' / '.join(OURS)} "
             f"alternating, server span budgets {args.server_cache_mib} MiB, client encoder caches "
             f"{args.client_cache_mib} MiB: {v['episodes']} episodes, {v['turns']} turns, **{v['errors']} errors**.\n")
    text += table(f"Resident memory after a {v['warmup_s']:.0f} s warm-up (MiB)",
                  ["process", "first after warm-up", "peak after warm-up", "last", "last vs first",
                   "slope after warm-up (MiB / min)"], rows)
    text += (f"\nAt the end: span store {last['span_store']}, rows held for the scheduler "
             f"{last['rows_to_scheduler']}, encoder caches {last['encoder_cache']}, "
             f"held spans {last['held_spans']}.\n")
    return text


def plot(results: dict, warmup_s: float, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in results["samples"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(t, [s["server_rss"] / 2**20 for s in results["samples"]], marker=".", label="server (all its processes)")
    ax.plot(t, [s["client_rss"] / 2**20 for s in results["samples"]], marker=".", label="client")
    ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.suptitle("Soak: the VLM chat workload on one server of ours")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--warmup-minutes", type=float, default=2)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reuse", type=float, default=0.5)
    ap.add_argument("--image-side", type=int, default=448)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--server-cache-mib", type=int, default=64, help="SGLANG_EMBEDS_HANDLE_BYTES, in MiB")
    ap.add_argument("--client-cache-mib", type=int, default=32, help="each client's EncoderCache, in MiB")
    ap.add_argument("--name", default="vlm_soak", help="results file name under benchmarks/results/")
    ap.add_argument("--reanalyze", action="store_true",
                    help="no run: the verdict of the saved run (--name) with this --warmup-minutes")
    args = ap.parse_args()
    if args.reanalyze:
        saved = json.loads((RESULTS / f"{args.name}.json").read_text())
        results = {"episodes": saved["episodes"], "samples": saved["samples"]}
        measured = f"{saved['provenance']}; reanalyzed with --warmup-minutes {args.warmup_minutes:g}"
    else:
        results, measured = run(args), provenance()
    v = verdict(results, args.warmup_minutes * 60)
    text = report(results, v, args, measured)
    save(args.name, {**results, "verdict": v, "provenance": measured}, text)
    plot(results, args.warmup_minutes * 60, args.name)
    print(text)
    raise SystemExit(1 if v["errors"] else 0)


if __name__ == "__main__":
    main()
