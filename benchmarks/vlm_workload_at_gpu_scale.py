"""The workload of ``bench_vlm_workload.py`` at a GPU scale, on paper (issue #35, item 1): what its
measured turns would cost a Qwen2.5-VL-7B served on one H200.

It reads ``results/vlm_workload.json`` (each arm's replayed turns and stages, see
``workload.turn_stages``) and, per setting and arm, takes a turn's means apart:

* **device work**, in FLOPs of the turn's own work: the tower on the items a tower ran on (the
  client cache's misses; stock's multimodal cache misses the same items) and the language model's
  prefill of each turn's uncached positions (``cached_tokens`` to ``prompt_tokens``), at the
  bench model's sizes and at Qwen2.5-VL-7B's, timed at an assumed GPU rate (an H200's dense bf16
  peak at ``MFU``). The FLOPs at the bench sizes over the measured seconds give this CPU's rate
  for each, a check that FLOPs track the measured per-row costs;
* **host work**, as measured here: making the request, its trip to the route, the tokenizer
  manager (stock's image processor runs there), the scheduler's request processing; ours' request
  and trip times 3.5 (the 7B's rows are 3.5 times wider; their fixed costs do not grow, so this
  over-counts).

The queue is left out: the estimate is a turn on an idle server. The server's requests/s bound is
one over its busy time a turn: prefill, stock's tower (ours runs on the client), and the turn's
decode steps at the HBM bandwidth a 7B's weights need, shared by the users. These are stated
assumptions, not measurements.

    python benchmarks/vlm_workload_at_gpu_scale.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common import RESULTS, save, table

GPU_FLOPS = 989e12  # H200 SXM, dense bf16 (NVIDIA's datasheet)
MFU = 0.4  # an assumed share of it that prefill and the tower reach
DECODE_STEP_S = 15.2e9 / 4.8e12  # a 7B's bf16 weights read once a step at H200's HBM bandwidth


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


def per_turn(setting: dict, arm: str, bench: Sizes) -> dict:
    """One arm of one setting, a turn's means: its measured stages, the FLOPs of its device work at
    both sizes, and the estimate at 7B on an H200."""
    a, inline = setting["arms"][arm], setting["arms"]["ours inline"]
    turns, stages = a["turns"], a["stages_s"]
    ours = arm != "stock raw image"
    # the items a tower ran on: the client's cache misses (stock's own cache misses the same items)
    towered = a if ours else inline
    misses = round(towered["tower_passes_per_item"] * len({json.dumps(t["item"], sort_keys=True)
                                                              for t in setting["plan"]}))
    rows_each = towered["client_tower_rows"] / misses if misses else 0.0
    flops = {}
    for name, sizes in (("bench", bench), ("7b", QWEN2_5_VL_7B)):
        flops[name] = {"tower": misses * sizes.tower_flops(rows_each) / turns,
                       "prefill": sum(sizes.lm_flops(x["cached_tokens"], x["prompt_tokens"])
                                      for x in a["answers"]) / turns}
    width = QWEN2_5_VL_7B.lm_hidden / bench.lm_hidden if ours else 1.0
    host = ((stages["client request, less the tower"] + stages["to the route"]) * width
            + stages["tokenize and return"] + stages["request process"])
    rate = GPU_FLOPS * MFU
    tower, prefill = flops["7b"]["tower"] / rate, flops["7b"]["prefill"] / rate
    decode = DECODE_STEP_S * (sum(x["output_tokens"] for x in a["answers"]) / turns - 1) / setting["users"]
    busy = prefill + decode + (0.0 if ours else tower)
    cpu_rates = {"prefill": flops["bench"]["prefill"] / stages["prefill forward"]} if ours else {}
    if ours and stages["client tower"]:
        cpu_rates["tower"] = flops["bench"]["tower"] / stages["client tower"]
    return {"flops": flops, "cpu_flops_per_s": cpu_rates, "host_s": host, "tower_s": tower, "prefill_s": prefill,
            "ttft_s": host + tower + prefill, "server_busy_s": busy, "requests_per_s_bound": 1 / busy,
            "measured_ttft_s": sum(a["ttft_s"]) / turns}


def main() -> None:
    results = json.loads((RESULTS / "vlm_workload.json").read_text())
    out, rows, bench = [], [], bench_sizes()
    for s in results["settings"]:
        est = {arm: per_turn(s, arm, bench) for arm, a in s["arms"].items() if "stages_s" in a}  # one server
        out.append({"users": s["users"], "reuse": s["reuse"], "arms": est})
        base = est["stock raw image"]
        for arm, e in est.items():
            ms = lambda v: f"{v * 1e3:.1f}"
            rows.append([s["users"], f"{s['reuse']:.0%}", arm, ms(e["measured_ttft_s"]), ms(e["host_s"]),
                         ms(e["tower_s"]), ms(e["prefill_s"]), ms(e["ttft_s"]),
                         f"{e['ttft_s'] / base['ttft_s']:.2f}x", f"{e['requests_per_s_bound']:.0f}",
                         f"{e['requests_per_s_bound'] / base['requests_per_s_bound']:.2f}x"])
    text = (f"From `results/vlm_workload.json` ({results['provenance']}).\n\nOn paper: Qwen2.5-VL-7B "
            f"on one H200 at {MFU:.0%} of {GPU_FLOPS / 1e12:.0f} TFLOP/s for the tower and prefill, a "
            f"decode step {DECODE_STEP_S * 1e3:.1f} ms shared by the users; host stages as measured on "
            "this CPU (ours' request and trip x3.5 for the 7B's wider rows); queue left out.\n")
    rates = [[s["users"], f"{s['reuse']:.0%}", arm, *(f"{e['cpu_flops_per_s'].get(k, 0) / 1e9:.0f}" for k in ("tower", "prefill"))]
             for s in out for arm, e in s["arms"].items() if e["cpu_flops_per_s"]]
    text += table("A turn's mean time to first token (ms) and the server's requests/s bound, estimated",
                  ["users", "reuse", "arm", "measured TTFT here (bench model, CPU)", "host", "tower (GPU)",
                   "prefill (GPU)", "TTFT estimate", "vs stock", "req/s bound", "vs stock"], rows)
    text += "\n" + table("This CPU's rate (GFLOP/s) for ours' device work: FLOPs at the bench sizes over the "
                         "measured client tower and prefill forward (under the workload's load)",
                         ["users", "reuse", "arm", "tower", "prefill"], rates)
    save("vlm_workload_gpu_scale", {"settings": out, "gpu_flops": GPU_FLOPS, "mfu": MFU,
                                    "decode_step_s": DECODE_STEP_S, "from": results["provenance"]}, text)
    print(text)


if __name__ == "__main__":
    main()
