"""A closed-loop multi-turn VLM chat workload: stock SGLang serving a Qwen2.5-VL natively vs ours
(issue #35).

The workload and its arms are ``workload``'s: N users, each a chat of
``--turns`` turns, every turn an image item (an image of a shared pool, or a box or a mask of
one) and a question, a chosen share of turns reusing an item seen before (Zipf over the items
seen); planned from a seed and recorded, so every arm replays the same turns. Arms, on the
random-weight ``testing.qwen_vl.bench_qwen2_5_vl_dir`` (LM 1024 x 8 layers, tower 512 x 8
blocks, float32; a 448x448 image is 256 rows):

* ``stock raw image``: a server of the same SGLang build with the plugin off, raw PNGs in
  ``image_data`` (its processor, its tower, its multimodal cache);
* ``ours inline``: a server with the plugin, the tower on the client through one
  ``EncoderCache`` for all users, every item's rows inline;
* ``ours by handle``: the same server, spans written as ``EmbedsEndpoint`` writes them (inline
  once with ``keep_spans``, then by handle);
* ``stock raw image, smg x2`` and ``ours by handle, smg x2`` (issue #35 (d)): the same clients,
  sending to SGLang's model gateway, smg, with its cache-aware policy, in front of two workers:
  the arm's one-server server and one more like it (4 servers in all, ~4 GB each). A span by
  handle that the gateway sends to the worker that does not hold it is refused and that turn is
  sent again inline (``resent`` in the JSON). ``--no-smg``: without these two arms (2 servers).

Every server runs from the start, each warmed up with one turn of each client that uses it; for
each setting (users x reuse) the arms run one after the other, their order rotated from one
setting to the next, each after its workers' prefix caches were flushed (``workload.route``; an
smg arm behind a gateway started for it, its prefix tree empty), with a fresh client cache; each
setting has its own images (stock's multimodal cache is not flushed by ``/flush_cache``). For the
same reason the smg arms replay the setting's turns with other images of the pool (the same
users, turns, regions, questions and sizes; other pixels): the stock smg arm's first worker is
the one-server stock arm's server. Peak server RSS counts every worker of the arm and its gateway;
each arm's prompt tokens by worker (SGLang's metrics) show how the gateway spread its turns.

On a CPU machine the workers share its cores: with a thread per core each (the default), two
workers busy at once run twice as many threads as there are cores and slow each other down
(measured: ~2.5x); ``--worker-threads`` gives each server fewer. Stock's raw-image chats reach
the gateway as text with one pad per image, so its cache-aware policy sends a setting's turns to
one worker (24 episodes of 24 measured); ours carry a hint of their rows and were spread over
both in 17 of the 24.

    python benchmarks/bench_vlm_workload.py [--users 2,4] [--turns 3] [--reuse 0,0.5,0.8]
        [--image-side 448] [--answer-tokens 8] [--seed 0] [--no-smg] [--worker-threads N]
        [--name vlm_workload]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from transformers import AutoTokenizer

from common import RESULTS, make_server, pct, provenance, save, table
from sgl_embeds_testing.qwen_vl import bench_qwen2_5_vl_dir
from sgl_embeds_testing.server import start_all, stop_all
from workload import (
    ARMS, SMG_ARMS, Arm, ArmClient, Turn, plan_record, plan_turns, prompt_tokens_taken, route, run_episode,
    server_stage_totals, turn_stages,
)
from sgl_embeds.vlm import QwenVLEncoder

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report", "--enable-metrics"]
STOCK = ARMS[0]
STOCK_SMG = SMG_ARMS[0].name
# the smg arms' images: the setting's own (image = its seed * 100_000 + k), shifted by this
SMG_IMAGE_OFFSET = 50_000


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def other_images(plan: list[Turn]) -> list[Turn]:
    """``plan`` with every item's image shifted to another of the pool (``SMG_IMAGE_OFFSET``)."""
    return [replace(t, item=replace(t.item, image=t.item.image + SMG_IMAGE_OFFSET)) for t in plan]


def run(args: argparse.Namespace) -> dict:
    model_dir = bench_qwen2_5_vl_dir()
    encoder = QwenVLEncoder(model_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    arms = [Arm(client) for client in ARMS] + ([] if args.no_smg else list(SMG_ARMS))
    count = max(arm.workers for arm in arms)
    threads = {} if args.worker_threads is None else {"OMP_NUM_THREADS": str(args.worker_threads),
                                                       "MKL_NUM_THREADS": str(args.worker_threads)}
    stock = [make_server(model_dir, plugin=False, extra=MM_ARGS, env=threads) for _ in range(count)]
    ours = [make_server(model_dir, plugin=True, extra=MM_ARGS, env=threads) for _ in range(count)]
    servers_of = {STOCK: stock, "ours inline": ours, "ours by handle": ours}  # by client
    start_all([*stock, *ours])
    settings = [(int(u), r) for u in args.users.split(",") for r in floats(args.reuse)]
    results: dict = {"arms": [arm.name for arm in arms], "settings": []}
    try:
        warm = plan_turns(1, 1, 0.0, seed=args.seed * 1000, image_side=args.image_side)
        for client in ARMS:  # unrecorded: each client's first requests, on each of its servers
            for s in servers_of[client]:
                run_episode(ArmClient(client, s.url, encoder, tokenizer, args.image_side, 2), warm)
        for i, (users, reuse) in enumerate(settings):
            plan = plan_turns(users, args.turns, reuse, seed=args.seed * 1000 + i + 1,
                              image_side=args.image_side)
            smg_plan = other_images(plan)
            order = arms[i % len(arms):] + arms[:i % len(arms)]
            out = {"users": users, "reuse": reuse, "order": [arm.name for arm in order],
                   "plan": plan_record(plan), "smg_plan": plan_record(smg_plan), "arms": {}}
            for arm in order:
                workers = servers_of[arm.client][:arm.workers]
                worker_urls = [w.url for w in workers]
                with route(worker_urls, [w.proc.pid for w in workers]) as to:
                    client = ArmClient(arm.client, to.url, encoder, tokenizer, args.image_side,
                                       args.answer_tokens)
                    # behind smg the gateway's health probes are requests too: no stages
                    before = server_stage_totals([to.url]) if arm.workers == 1 else None
                    tokens_before = prompt_tokens_taken(worker_urls)
                    episode = run_episode(client, plan if arm.workers == 1 else smg_plan, to.pids)
                    if before is not None:
                        episode["stages_s"] = turn_stages(episode, before, server_stage_totals([to.url]))
                    episode["worker_prompt_tokens"] = [
                        a - b for a, b in zip(prompt_tokens_taken(worker_urls), tokens_before)]
                out["arms"][arm.name] = {**episode, "workers": arm.workers}
                print(f"users {users} reuse {reuse:.0%} {arm.name}: "
                      f"{episode['requests_per_s']:.2f} req/s, {episode['resent']} resent", flush=True)
            results["settings"].append(out)
    finally:
        stop_all([*stock, *ours])
    return results


def report(results: dict, args: argparse.Namespace) -> str:
    ms = lambda v, q: pct(v, q) * 1e3
    rows, ratios = [], []
    ratio = lambda a, b: f"{a / b:.2f}x"
    for s in results["settings"]:
        base, smg_base = s["arms"][STOCK], s["arms"].get(STOCK_SMG)
        for arm in results["arms"]:
            a = s["arms"][arm]
            passes = "-" if a["tower_passes_per_item"] is None else f"{a['tower_passes_per_item']:.2f}"
            rows.append([s["users"], f"{s['reuse']:.0%}", arm, f"{a['requests_per_s']:.2f}",
                         f"{ms(a['ttft_s'], .5):.0f} / {ms(a['ttft_s'], .9):.0f} / {ms(a['ttft_s'], .99):.0f}",
                         f"{ms(a['e2e_s'], .5):.0f}", passes, f"{a['client_tower_s']:.1f}",
                         f"{a['hit_rate']:.1%} ({a['ideal_hit_rate_prefilled']:.1%} - {a['ideal_hit_rate']:.1%})",
                         f"{a['server_rss_peak'] / 2**20:.0f} / {a['client_rss_peak'] / 2**20:.0f}",
                         f"{a['request_bytes'] / a['turns'] / 1e6:.2f}"])
            if arm != STOCK:
                vs_smg = ([ratio(a["requests_per_s"], smg_base["requests_per_s"]),
                           ratio(pct(a["ttft_s"], .5), pct(smg_base["ttft_s"], .5))]
                          if a["workers"] > 1 and arm != STOCK_SMG else ["-", "-"])
                ratios.append([s["users"], f"{s['reuse']:.0%}", arm,
                               ratio(a["requests_per_s"], base["requests_per_s"]),
                               ratio(pct(a["ttft_s"], .5), pct(base["ttft_s"], .5)), *vs_smg,
                               f"{(a['hit_rate'] - a['ideal_hit_rate_prefilled']) * 100:+.1f}", a["resent"],
                               worker_shares(a)])
    stage_names = list(results["settings"][0]["arms"][STOCK]["stages_s"])
    stages = [[s["users"], f"{s['reuse']:.0%}", arm,
               *(f"{s['arms'][arm]['stages_s'][k] * 1e3:.0f}" for k in stage_names),
               f"{sum(s['arms'][arm]['ttft_s']) / len(s['arms'][arm]['ttft_s']) * 1e3:.0f}"]
              for s in results["settings"] for arm in ARMS]
    text = f"Measured: {provenance()}\n"
    text += (f"Every server's threads: {args.worker_threads or 'one per core'} "
             f"(`--worker-threads`; this machine has {os.cpu_count()} cores).\n")
    text += table(f"{args.turns} turns per user, {args.answer_tokens} new tokens a turn, "
                  f"{args.image_side}x{args.image_side} images; TTFT and end-to-end from the turn's "
                  "start (the client's tower included); smg x2: two workers behind smg (cache-aware), "
                  "peak RSS server counts both and the gateway",
                  ["users", "reuse", "arm", "req/s", "TTFT p50 / p90 / p99 (ms)", "e2e p50 (ms)",
                   "tower passes / item", "client tower s", "prefix hit (ideal: prefilled - sent)",
                   "peak RSS server / client (MiB)", "request MB / turn"], rows)
    text += "\n" + table(
        "Each arm vs stock raw image in the same setting: its requests/s / stock's and its TTFT p50 / "
        "stock's, stock on one server (the same turns; for an smg arm, the same turns with other "
        "images) and, for ours by handle behind smg, stock's smg x2 arm (the same turns, the same "
        "images); prefix hit rate minus the ideal of prefixes prefilled by then (points); turns resent inline (a handle the "
        "worker did not hold)",
        ["users", "reuse", "arm", "req/s / stock's (one server)", "TTFT p50 / stock's (one server)",
         f"req/s / {STOCK_SMG}", f"TTFT p50 / {STOCK_SMG}", "hit - ideal (points)", "resent",
         "prompt tokens by worker"], ratios)
    text += "\n" + table("Where the time to first token goes, one server: ms a turn, means over the episode's "
                         "turns; the server's stages from its metrics (see workload.turn_stages)",
                         ["users", "reuse", "arm", *stage_names, "TTFT mean"], stages)
    return text


def worker_shares(arm: dict) -> str:
    """How an episode's prompt tokens fell on its workers, e.g. "100% / 0%" (smg's routing);
    "-" for one server."""
    tokens = arm.get("worker_prompt_tokens", [])
    if len(tokens) < 2:
        return "-"
    return " / ".join(f"{t / sum(tokens):.0%}" for t in tokens)


def plot(results: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = sorted({s["users"] for s in results["settings"]})
    fig, axes = plt.subplots(1, len(users), figsize=(6 * len(users), 4.5), squeeze=False)
    for ax, u in zip(axes[0], users):
        settings = [s for s in results["settings"] if s["users"] == u]
        reuse = [s["reuse"] * 100 for s in settings]
        for color, arm in zip(("C3", "C0", "C2", "C1", "C4"), results["arms"]):
            for q, style in ((0.5, "-"), (0.9, "--"), (0.99, ":")):
                ax.plot(reuse, [pct(s["arms"][arm]["ttft_s"], q) * 1e3 for s in settings], style,
                        color=color, marker="o", label=f"{arm} p{round(q * 100)}")
        ax.set_title(f"{u} concurrent users")
        ax.set_xlabel("turns reusing an image seen before (%)")
        ax.set_ylabel("TTFT (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Multi-turn VLM chat, random-weight Qwen2.5-VL on CPU")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


def target_verdicts(results: dict) -> str:
    """Issue #35's targets, each with its verdict; where ours misses one on requests/s or TTFT,
    where ours' turn spends its time (its largest stages, measured) beside stock's same stages."""
    mean = lambda v: sum(v) / len(v)
    lines = []
    for s in results["settings"]:
        base = s["arms"][STOCK]
        for arm in ARMS[1:]:
            a, where = s["arms"][arm], f"{s['users']} users, {s['reuse']:.0%} reuse, {arm}"
            checks = [("prefix hit within 2 points of the ideal (of prefixes prefilled when sent)",
                       a["hit_rate"] >= a["ideal_hit_rate_prefilled"] - 0.02,
                       f"{(a['hit_rate'] - a['ideal_hit_rate_prefilled']) * 100:+.1f} points; "
                       f"{(a['hit_rate'] - a['ideal_hit_rate']) * 100:+.1f} from the ideal of prefixes sent"),
                      ("tower passes per distinct item <= 1.05", a["tower_passes_per_item"] <= 1.05,
                       f"{a['tower_passes_per_item']:.2f}")]
            rps = a["requests_per_s"] / base["requests_per_s"]
            ttft = pct(a["ttft_s"], .5) / pct(base["ttft_s"], .5)
            if s["reuse"] >= 0.8:
                checks += [(">= 2x stock's requests/s", rps >= 2, f"{rps:.2f}x"),
                           ("<= 0.5x stock's TTFT p50", ttft <= 0.5, f"{ttft:.2f}x")]
            if s["reuse"] == 0:
                checks.append((">= 0.95x stock's requests/s, the client's tower counted", rps >= 0.95, f"{rps:.2f}x"))
            for name, met, value in checks:
                line = f"- {where}: {name}: **{'met' if met else 'missed'}** ({value})"
                if not met and "stock's" in name:
                    top = sorted(a["stages_s"].items(), key=lambda kv: -kv[1])[:3]
                    line += ("; ours' turn: TTFT mean {:.0f} ms, of it {}; then {:.0f} ms to the last token. "
                             "Stock's: TTFT mean {:.0f} ms, {}; then {:.0f} ms").format(
                        mean(a["ttft_s"]) * 1e3, ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in top),
                        (mean(a["e2e_s"]) - mean(a["ttft_s"])) * 1e3, mean(base["ttft_s"]) * 1e3,
                        ", ".join(f"{k} {base['stages_s'][k] * 1e3:.0f} ms" for k, _ in top),
                        (mean(base["e2e_s"]) - mean(base["ttft_s"])) * 1e3)
                lines.append(line)
    return "\n### Targets (issue #35)\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", default="2,4", help="concurrencies, comma-separated")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reuse", default="0,0.5,0.8", help="shares of turns reusing an item seen before")
    ap.add_argument("--image-side", type=int, default=448)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-smg", action="store_true", help="without the two arms behind smg")
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="each server's torch threads (default: one per core). Two workers behind "
                         "smg that are busy at once share this machine's cores: at one per core each "
                         "they run twice as many threads as cores")
    ap.add_argument("--name", default="vlm_workload", help="results: benchmarks/results/NAME.{md,json,png}")
    args = ap.parse_args()
    results = run(args)
    text = report(results, args) + target_verdicts(results)
    save(args.name, {**results, "provenance": provenance()}, text)
    plot(results, args.name)


if __name__ == "__main__":
    main()
