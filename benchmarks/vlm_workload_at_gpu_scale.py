"""The VLM workloads measured here, at a GPU scale, on paper (issue #35, item 1; redone for issue
#49, item 5): what their turns would cost a Qwen2.5-VL-7B served on one H200.

It reads the runs with **one user on an idle server**, so that no host stage carries another
request's contention: ``results/vlm_workload_one_user.json`` (``bench_vlm_workload.py``'s chat at
0/50/80% reuse) and ``results/vlm_wins_agent.json`` (``bench_vlm_wins.py``'s agent chat, 16 turns of
screenshots, 3 repeats). Per workload and arm it takes a turn's means apart:

* **device work**, in FLOPs of the turn's own work: the tower on the items a tower ran on (the
  client cache's misses; stock's own caches miss the same items) and the language model's prefill
  of each turn's uncached positions (``cached_tokens`` to ``prompt_tokens``), at the bench model's
  sizes and at Qwen2.5-VL-7B's, timed at an assumed GPU rate (an H200's dense bf16 peak at
  ``MFU``). The FLOPs at the bench sizes over the measured seconds give this CPU's rate for each,
  a check that FLOPs track the measured per-row costs;
* **host work**, as measured in that idle run: making the request, its trip to the route, the
  tokenizer manager (stock's image processor runs there), the scheduler's request processing.
  Ours' request and trip carry rows, 3.5 times wider at 7B: they are taken at both ends, x1 (all
  fixed costs) and x3.5 (all bytes), and a ratio to stock is a conclusion only where both ends
  fall on the same side of 1.

A turn's time to first token is its host stages, tower and prefill (no queue: one user). The
server's requests/s bound is one over its slowest stage a request, host stages included:

* the tokenizer manager's process: the HTTP route's receive and parse, tokenize and return, and
  the client's request making (ours by handle uploads a new image's rows in it, to a route of the
  same process; that share cannot be told apart, so the whole is counted, on both sides alike);
* the scheduler and the GPU: the request's processing, then the device's work, the tower included
  on both sides (ours runs on the client, but on the GPU the server holds). Decode is left out: at
  saturation a decode step serves the whole batch in about the time a 7B's weights take to read,
  so a request's share of it tends to nothing; both sides' bounds are upper bounds alike.

These are stated assumptions, not measurements; the script prints which stage bounds each arm.

    python benchmarks/vlm_workload_at_gpu_scale.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common import RESULTS, commit, save, table

GPU_FLOPS = 989e12  # H200 SXM, dense bf16 (NVIDIA's datasheet)
MFU = 0.4  # an assumed share of it that prefill and the tower reach


@dataclass(frozen=True)
class Sizes:
    """The sizes that set a Qwen2.5-VL's FLOPs."""

    lm_hidden: int
    lm_inter: int
    lm_layers: int
    lm_heads: int
    lm_kv_heads: int
    head_dim: int
    tower_hidden: int
    tower_inter: int
    tower_depth: int
    tower_full_layers: int  # the others attend within windows of ``window_patches`` patches
    window_patches: int
    patch_in: int  # channels x frames x patch side x patch side
    merge: int  # patches a row

    @classmethod
    def from_config(cls, config: dict) -> "Sizes":
        """From a Qwen2.5-VL ``config.json``'s fields."""
        text, vision = config["text_config"], config["vision_config"]
        window = vision["window_size"] // vision["patch_size"]
        return cls(text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"],
                   text["num_attention_heads"], text["num_key_value_heads"],
                   text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
                   vision["hidden_size"], vision["intermediate_size"], vision["depth"],
                   len(vision["fullatt_block_indexes"]), window * window,
                   vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2,
                   vision["spatial_merge_size"] ** 2)

    def lm_flops(self, first: int, last: int) -> float:
        """Prefill of positions ``first..last-1``: the weights, and attention to the prefix."""
        q, kv = self.lm_heads * self.head_dim, self.lm_kv_heads * self.head_dim
        weights = 2 * self.lm_layers * (2 * self.lm_hidden * q + 2 * self.lm_hidden * kv
                                        + 3 * self.lm_hidden * self.lm_inter)
        prefixes = (first + last + 1) * (last - first) / 2  # each position attends to its prefix
        return weights * (last - first) + 4 * self.lm_layers * q * prefixes

    def tower_flops(self, rows: float) -> float:
        """One image of ``rows`` rows: its patches through the blocks, then the merger."""
        h, patches = self.tower_hidden, rows * self.merge
        weights = 2 * self.patch_in * h + self.tower_depth * 2 * (4 * h * h + 3 * h * self.tower_inter)
        windowed = self.tower_depth - self.tower_full_layers
        attention = 4 * h * (windowed * self.window_patches + self.tower_full_layers * patches)
        merger = 2 * (self.merge * h) ** 2 + 2 * self.merge * h * self.lm_hidden
        return patches * (weights + attention) + rows * merger


# Qwen2.5-VL-7B-Instruct's config.json, the fields that set its FLOPs
QWEN2_5_VL_7B = Sizes.from_config({
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 3420, "depth": 32, "patch_size": 14,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "in_channels": 3,
                      "temporal_patch_size": 2, "spatial_merge_size": 2}})


def bench_sizes() -> Sizes:
    """The bench model's (``testing.qwen_vl.bench_qwen2_5_vl_dir``)."""
    from sgl_embeds_testing.qwen_vl import bench_qwen2_5_vl_dir

    return Sizes.from_config(json.loads((bench_qwen2_5_vl_dir() / "config.json").read_text()))


def _episodes(results: dict) -> list[tuple[str, str, list[dict]]]:
    """(workload, arm, episodes) of a results file of either bench, all repeats of an arm together."""
    found = []
    for s in results.get("settings", []):  # bench_vlm_workload.py
        for arm, a in s["arms"].items():
            found.append((f"chat, {s['turns'] if 'turns' in s else len(s['plan'])} turns, {s['reuse']:.0%} reuse",
                          arm, [a]))
    for name, w in results.get("workloads", {}).items():  # bench_vlm_wins.py
        for arm in w["arms"]:
            found.append((name, arm, [e for r in w["repeats"] for e in r["episodes"].get(arm, [])]))
    return found


def _passes(episode: dict) -> int:
    """The tower passes of an episode of ours: its client cache's misses."""
    items = {json.dumps(x["item"], sort_keys=True) for x in episode["answers"]}
    return round(episode["tower_passes_per_item"] * len(items))


def per_turn(episodes: list[dict], arm: str, bench: Sizes, image_rows: float, row_bytes: float) -> dict:
    """One arm's episodes, a turn's means: its measured stages, the FLOPs of its device work at
    both sizes, and the estimate at 7B on an H200. ``image_rows``: an image's rows in this
    workload (ours' client tower's, the same images through the same processor settings);
    ``row_bytes``: what ours' request and trip times are multiplied by (``ROW_BYTES``)."""
    turns = sum(e["turns"] for e in episodes)
    stage = lambda name: sum(e["stages_s"][name] * e["turns"] for e in episodes) / turns
    ours = arm.startswith("ours")
    # the items a tower ran on: ours' client cache misses; stock's own caches miss the same items,
    # as many as ours with the client's encoder cache on
    flops = {"bench": {"tower": 0.0, "prefill": 0.0}, "7b": {"tower": 0.0, "prefill": 0.0}}
    for e in episodes:
        passes = _passes(e) if ours else len({json.dumps(x["item"], sort_keys=True) for x in e["answers"]})
        for name, sizes in (("bench", bench), ("7b", QWEN2_5_VL_7B)):
            flops[name]["tower"] += passes * sizes.tower_flops(image_rows) / turns
            flops[name]["prefill"] += sum(sizes.lm_flops(x["cached_tokens"], x["prompt_tokens"])
                                          for x in e["answers"]) / turns
    width = row_bytes if ours else 1.0
    client = stage("client request, less the tower") * width
    route, tokenize, process = stage("to the route") * width, stage("tokenize and return"), stage("request process")
    rate = GPU_FLOPS * MFU
    tower, prefill = flops["7b"]["tower"] / rate, flops["7b"]["prefill"] / rate
    busy = {"tokenizer manager": client + route + tokenize, "scheduler and GPU": process + tower + prefill}
    bound_by = max(busy, key=busy.get)
    cpu_rates = {"prefill": flops["bench"]["prefill"] / stage("prefill forward")} if ours else {}
    if ours and stage("client tower"):
        cpu_rates["tower"] = flops["bench"]["tower"] / stage("client tower")
    return {"flops": flops, "cpu_flops_per_s": cpu_rates, "host_s": client + route + tokenize + process,
            "tower_s": tower, "prefill_s": prefill,
            "ttft_s": client + route + tokenize + process + tower + prefill, "busy_s": busy,
            "bound_by": bound_by, "requests_per_s_bound": 1 / busy[bound_by],
            "measured_ttft_s": sum(sum(e["ttft_s"]) for e in episodes) / turns, "episodes": len(episodes)}


SOURCES = ("vlm_workload_one_user", "vlm_wins_agent")  # one user, an idle server


def row_bytes_ends(bench: Sizes) -> tuple[float, float]:
    """Ours' request and trip at 7B over the measured: all fixed costs (x1), all bytes (the width)."""
    return 1.0, QWEN2_5_VL_7B.lm_hidden / bench.lm_hidden


def verdict(low: float, high: float) -> str:
    """A ratio to stock's known only as a range: which side of 1 it is on, if both ends agree."""
    if high < 1:
        return "below stock's"
    if low > 1:
        return "above stock's"
    return "not determined"


def _ratio(ends: list[float]) -> str:
    return f"{ends[0]:.2f}x" if round(ends[0], 2) == round(ends[1], 2) else f"{ends[0]:.2f} - {ends[1]:.2f}x"


def main() -> None:
    out, rows, rates, bench, provenances = [], [], [], bench_sizes(), []
    for source in SOURCES:
        results = json.loads((RESULTS / f"{source}.json").read_text())
        provenances.append(f"`results/{source}.json` ({results['provenance']})")
        by_workload: dict[str, dict[str, list[dict]]] = {}
        for workload, arm, episodes in _episodes(results):
            by_workload.setdefault(workload, {})[arm] = episodes
        for workload, arms in by_workload.items():
            handle = arms["ours by handle"]
            image_rows = sum(e["client_tower_rows"] for e in handle) / sum(_passes(e) for e in handle)
            ends = {x: {arm: per_turn(episodes, arm, bench, image_rows, x) for arm, episodes in arms.items()}
                    for x in row_bytes_ends(bench)}
            out.append({"source": source, "workload": workload, "row_bytes": {str(x): e for x, e in ends.items()}})
            base_arm = "stock tuned" if "stock tuned" in arms else "stock raw image"
            for arm in arms:
                lo, hi = (ends[x][arm] for x in row_bytes_ends(bench))
                base = ends[1.0][base_arm]
                span = lambda key, scale=1e3, f=".0f": (f"{lo[key] * scale:{f}}" if lo[key] == hi[key]
                                                       else f"{lo[key] * scale:{f}} - {hi[key] * scale:{f}}")
                ttft = sorted((lo["ttft_s"] / base["ttft_s"], hi["ttft_s"] / base["ttft_s"]))
                rate = sorted((lo["requests_per_s_bound"] / base["requests_per_s_bound"],
                               hi["requests_per_s_bound"] / base["requests_per_s_bound"]))
                bound_by = lo["bound_by"] if lo["bound_by"] == hi["bound_by"] else f"{lo['bound_by']} / {hi['bound_by']}"
                rows.append([workload, arm, f"{lo['measured_ttft_s'] * 1e3:.0f}", span("host_s"),
                             f"{lo['tower_s'] * 1e3:.1f}", f"{lo['prefill_s'] * 1e3:.1f}", span("ttft_s"),
                             _ratio(ttft), verdict(*ttft) if arm != base_arm else "-",
                             span("requests_per_s_bound", 1), bound_by, _ratio(rate),
                             verdict(*rate) if arm != base_arm else "-"])
                if lo["cpu_flops_per_s"]:
                    rates.append([workload, arm, *(f"{lo['cpu_flops_per_s'].get(k, 0) / 1e9:.0f}"
                                                  for k in ("tower", "prefill"))])
    text = (f"Estimated at commit {commit()} by `python benchmarks/vlm_workload_at_gpu_scale.py`, from "
            + "; ".join(provenances) + ".\n\nOn paper: Qwen2.5-VL-7B on one H200 at "
            f"{MFU:.0%} of {GPU_FLOPS / 1e12:.0f} TFLOP/s for the tower and prefill, decode "
            "left out of the bound (batched); host stages as measured in each idle one-user run (ours' "
            "request and trip x1 - x3.5 for the 7B's 3.5 times wider rows); 'vs stock' is against stock tuned where the "
            "run has it, else stock with its defaults.\n")
    text += table("A turn's mean time to first token (ms) and the server's requests/s bound, estimated "
                  "(ours' host at x1 - x3.5)",
                  ["workload", "arm", "measured TTFT here (bench model, CPU)", "host", "tower (GPU)",
                   "prefill (GPU)", "TTFT estimate", "vs stock", "TTFT", "req/s bound", "bound by",
                   "vs stock", "req/s"], rows)
    text += "\n" + table("This CPU's rate (GFLOP/s) for ours' device work: FLOPs at the bench sizes over the "
                         "measured client tower and prefill forward (idle, one user)",
                         ["workload", "arm", "tower", "prefill"], rates)
    save("vlm_workload_gpu_scale", {"workloads": out, "gpu_flops": GPU_FLOPS, "mfu": MFU,
                                    "from": provenances}, text)
    print(text)


if __name__ == "__main__":
    main()
