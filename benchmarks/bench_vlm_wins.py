"""Where sgl_embeds wins, measured fairly (issue #49): three VLM workloads, each replayed alike by
every arm, against stock SGLang with its caches on and against stock's ``input_embeds``.

Workloads (``workload``'s plans, drawn from a seed, recorded with the results):

* ``agent`` (a): an agent's chat, one user, ``--agent-turns`` turns, each a new screenshot-sized
  image (``--screen``, e.g. 1280x800: its PNG is what stock receives and decodes; the processor
  resizes it to the model's largest image, 256 rows here), every earlier image kept in the chat;
* ``shared`` (b): shared-image Q&A: one-turn chats, each from its own user, a common system prompt,
  then an image of a pool of ``--pool`` drawn by a Zipf law over the pool, then a question; sent
  open loop at each of ``--rates`` (Poisson arrivals) and all at once (the saturation);
* ``chat`` (c): today's multi-turn chat (``plan_turns``) with ``--chat-users`` x ``--chat-turns``
  turns at ``--chat-reuse``, enough turns that its new items are many.

Arms (an arm is a client and the server it talks to; every server the same SGLang build and the
same random-weight Qwen2.5-VL, ``bench_qwen2_5_vl_dir``, float32):

* ``stock``: raw images (PNG in ``image_data``), SGLang's defaults;
* ``stock tuned``: the same client, a server with its processor-output cache and a larger tower
  output cache (``TUNED_ARGS`` / ``TUNED_ENV``; the run reports both stock arms, so that the
  tuning is seen to help stock or not);
* ``stock tuned, one request a prefill``: ``stock tuned`` with ``--prefill-max-requests 1`` (in
  (b) only): on CPU stock's vision attention builds a dense mask over all the images of a prefill
  batch, so a batch of new images costs quadratically; one request a prefill keeps its tower
  linear in the images, as ours is (issue #49: the same tower cost on both sides);
* ``stock input_embeds``: the whole prompt's rows (text rows from the embedding table, images from
  the client's tower through its encoder cache) as JSON lists, on a server with its radix cache
  off (stock refuses ``input_embeds`` otherwise);
* ``ours inline`` / ``ours by handle``: sgl_embeds' spans (rows inline each turn, or inline once
  and then by handle);
* ablations: ``ours, encoder cache only`` (ours inline to a server with its radix cache off) and
  ``ours, prefix cache only`` (ours inline with no client encoder cache: every item's tower pass
  again on every turn).

Every arm's turn starts its clock before its client's tower, so the client's tower is inside its
TTFT and its requests/s; the client runs on the same cores as the servers. Each workload runs
``--repeats`` times, its arms' order rotated from one repeat to the next; each episode starts with
its server's prefix cache flushed, and each repeat has its own images (stock's image caches are
not flushed by ``/flush_cache``). The tables give the median over the repeats and the spread
(min - max).

    python benchmarks/bench_vlm_wins.py [--workloads agent,shared,chat] [--repeats 3]
        [--agent-turns 16] [--screen 1280x800] [--pool 128] [--shared-requests 60]
        [--rates 1,2,4] [--chat-users 8] [--chat-turns 6] [--chat-reuse 0.8] [--name vlm_wins]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from transformers import AutoTokenizer

from common import RESULTS, embedding_table, make_server, pct, provenance, save, table
from sgl_embeds.serve import build_once
from sgl_embeds_testing.qwen_vl import bench_qwen2_5_vl_dir
from sgl_embeds_testing.server import start_all, stop_all
from workload import (
    ARMS, HASHED_IMAGE, INPUT_EMBEDS, RAW_IMAGE_CLIENTS, NO_ENCODER_CACHE, ArmClient, plan_agent_chat, plan_record, plan_shared_qa,
    plan_turns, route, run_episode, run_open_loop, server_stage_totals, turn_stages,
)
from sgl_embeds.vlm import QwenVLEncoder

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report", "--enable-metrics"]
TEXT_ARGS = ["--enable-cache-report", "--enable-metrics"]
RADIX_OFF = ["--disable-radix-cache"]
# stock's own caches for repeated images, on and sized for the workloads: the processor's outputs
# (off by default for Qwen-VL), keyed by each file's hash, which the client sends and the server
# trusts (a held image is then neither read nor decoded), and the tower's outputs (100 MB by
# default: 100 images of 256 x 1024 float32)
TUNED_ARGS = ["--mm-preprocess-cache-size-mb", "2048", "--trust-mm-content-hashes"]
TUNED_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "2048"}
ONE_REQUEST_A_PREFILL = ["--prefill-max-requests", "1"]
SYSTEM_PROMPT = ("You are a careful visual assistant. Answer questions about the image the user "
                 "shows in one short sentence, naming colours and positions precisely.")


@dataclass(frozen=True)
class ServerKind:
    """A server configuration: the plugin on or off, its flags and environment, its dtype, and
    whether it serves the VLM's language model alone (``text_model_dir``: stock ``input_embeds``
    is ignored by SGLang's Qwen2.5-VL class, which embeds its fake ids instead)."""

    plugin: bool
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    dtype: str = "float32"
    text_only: bool = False


# stock casts ``input_embeds`` to bfloat16 before the first layer, whatever the model's dtype
# (``ModelRunner``), so a float32 server fails on them: that pair runs in bfloat16, ours beside it
SERVERS = {
    "stock": ServerKind(False),
    "stock tuned": ServerKind(False, tuple(TUNED_ARGS), tuple(TUNED_ENV.items())),
    "stock tuned, one request a prefill": ServerKind(False, tuple(TUNED_ARGS + ONE_REQUEST_A_PREFILL),
                                                     tuple(TUNED_ENV.items())),
    "ours": ServerKind(True),
    "ours radix off": ServerKind(True, tuple(RADIX_OFF)),
    "stock input_embeds, bf16": ServerKind(False, tuple(RADIX_OFF), dtype="bfloat16", text_only=True),
    "ours, bf16": ServerKind(True, dtype="bfloat16"),
}


@dataclass(frozen=True)
class Arm:
    """An arm: its name, its client (one of ``workload.CLIENTS``) and its server (``SERVERS``)."""

    name: str
    client: str
    server: str


STOCK, STOCK_TUNED, STOCK_EMBEDS = "stock", "stock tuned", "stock input_embeds (bf16)"
STOCK_SERIAL = "stock tuned, one request a prefill"
INLINE, BY_HANDLE, BY_HANDLE_BF16 = "ours inline", "ours by handle", "ours by handle (bf16)"
ENCODER_ONLY, PREFIX_ONLY = "ours, encoder cache only", "ours, prefix cache only"
ALL_ARMS = {arm.name: arm for arm in (
    Arm(STOCK, ARMS[0], "stock"), Arm(STOCK_TUNED, HASHED_IMAGE, "stock tuned"),
    Arm(INLINE, ARMS[1], "ours"), Arm(BY_HANDLE, ARMS[2], "ours"),
    Arm(ENCODER_ONLY, ARMS[1], "ours radix off"), Arm(PREFIX_ONLY, NO_ENCODER_CACHE, "ours"),
    Arm(STOCK_EMBEDS, INPUT_EMBEDS, "stock input_embeds, bf16"), Arm(BY_HANDLE_BF16, ARMS[2], "ours, bf16"),
    Arm(STOCK_SERIAL, HASHED_IMAGE, STOCK_SERIAL))}
# each workload's arms: the agent's chat sends a growing prompt of images every turn, which as JSON
# rows (stock ``input_embeds``) would be tens of MB a turn at its end; that pair is measured in (c)
WORKLOAD_ARMS = {
    "agent": (STOCK, STOCK_TUNED, INLINE, BY_HANDLE, PREFIX_ONLY),
    "shared": (STOCK, STOCK_TUNED, STOCK_SERIAL, INLINE, BY_HANDLE),
    "chat": tuple(a for a in ALL_ARMS if a != STOCK_SERIAL),
}
WORKLOADS = tuple(WORKLOAD_ARMS)


def arm_names(value: str) -> list[str]:
    """Arm names from a comma-separated list, where a name may hold a comma itself ("ours,
    encoder cache only"): at each place the longest run of pieces that names an arm."""
    pieces, names = value.split(","), []
    while pieces:
        for n in range(len(pieces), 0, -1):
            name = ",".join(pieces[:n]).strip()
            if name in ALL_ARMS:
                break
        else:
            raise argparse.ArgumentTypeError(f"no arm is named by the start of {','.join(pieces)!r}; of {list(ALL_ARMS)}")
        names.append(name)
        pieces = pieces[n:]
    return names


def text_model_dir(vlm_dir: Path) -> Path:
    """The language model of the Qwen2.5-VL at ``vlm_dir`` as a ``Qwen2ForCausalLM`` checkpoint
    (its weights, tokenizer and text settings), made once next to it."""

    def build(tmp: Path) -> None:
        config = json.loads((vlm_dir / "config.json").read_text())
        text = {**config, **config.get("text_config", {}), "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2"}
        for key in ("text_config", "vision_config", "image_token_id", "video_token_id",
                    "vision_start_token_id", "vision_end_token_id", "vision_token_id"):
            text.pop(key, None)
        # M-RoPE's sections left out: a text model has one position axis
        text["rope_parameters"] = {k: v for k, v in text["rope_parameters"].items() if k != "mrope_section"}
        (tmp / "config.json").write_text(json.dumps(text, indent=2))
        weights = load_file(str(next(vlm_dir.glob("*.safetensors"))))
        save_file({k: v for k, v in weights.items() if not k.startswith("visual.")},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in vlm_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
                shutil.copy(f, tmp / f.name)

    return build_once(vlm_dir.with_name(vlm_dir.name + "-text"), build)


def make_servers(kinds: set[str], vlm_dir: Path) -> dict:
    """A started server of each configuration in ``kinds``."""
    servers = {}
    for kind in kinds:
        k = SERVERS[kind]
        model = text_model_dir(vlm_dir) if k.text_only else vlm_dir
        servers[kind] = make_server(model, k.plugin, [*(TEXT_ARGS if k.text_only else MM_ARGS), *k.args],
                                    k.dtype, dict(k.env))
    start_all(list(servers.values()))
    return servers


def plans(workload: str, repeat: int, args: argparse.Namespace) -> list:
    """The plans one repeat of ``workload`` replays: one, or (``shared``) one a rate, each with its
    own images (stock's caches outlive a flush)."""
    seed = args.seed * 1000 + 100 * WORKLOADS.index(workload) + 10 * repeat
    if workload == "agent":
        return [plan_agent_chat(args.agent_turns, seed)]
    if workload == "chat":
        return [plan_turns(args.chat_users, args.chat_turns, args.chat_reuse, seed, args.image_side)]
    return [plan_shared_qa(args.shared_requests, args.pool, seed + k, args.zipf)
            for k in range(len(args.rates) + 1)]


def run(args: argparse.Namespace, vlm_dir: Path | None = None, servers: dict | None = None) -> dict:
    """Every workload of ``args`` replayed by its arms (module docstring). ``servers``: started
    servers by configuration (``SERVERS``' keys) to use instead of starting them, the arms of a
    configuration not given left out; ``vlm_dir``: the model they serve."""
    vlm_dir = vlm_dir or bench_qwen2_5_vl_dir()
    encoder = QwenVLEncoder(vlm_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    embed_tokens = embedding_table(vlm_dir)
    own = servers is None
    if own:
        servers = make_servers({ALL_ARMS[a].server for w in args.workloads for a in WORKLOAD_ARMS[w]
                                if a not in args.skip_arms}, vlm_dir)
    arms = {w: [ALL_ARMS[a] for a in WORKLOAD_ARMS[w] if ALL_ARMS[a].server in servers and a not in args.skip_arms]
            for w in args.workloads}
    size = {"agent": args.screen, "shared": args.image_side, "chat": args.image_side}
    system = {"shared": SYSTEM_PROMPT}

    def client(arm: Arm, url: str, workload: str, answer_tokens: int) -> ArmClient:
        return ArmClient(arm.client, url, encoder, tokenizer, size[workload], answer_tokens, system.get(workload),
                         embed_tokens if arm.client == INPUT_EMBEDS else None)

    results: dict = {"workloads": {}}
    try:
        for workload in args.workloads:
            for arm in arms[workload]:  # unrecorded: each client's first requests on its server
                warm = plan_turns(1, 1, 0.0, seed=args.seed * 1000 + 999, image_side=args.image_side)
                run_episode(client(arm, servers[arm.server].url, workload, 2), warm)
            repeats = []
            for r in range(args.repeats):
                order = arms[workload][r % len(arms[workload]):] + arms[workload][:r % len(arms[workload])]
                episodes = {}
                for arm in order:
                    s = servers[arm.server]
                    episodes[arm.name] = [episode(client(arm, s.url, workload, args.answer_tokens), s, plan,
                                                  workload == "shared", rate, args.seed + r)
                                          for plan, rate in zip(plans(workload, r, args), rates(workload, args))]
                    print(f"{workload} repeat {r} {arm.name}: "
                          + ", ".join(f"{e['requests_per_s']:.2f} req/s" for e in episodes[arm.name]), flush=True)
                repeats.append({"order": [a.name for a in order], "episodes": episodes,
                                "plans": [plan_record(p) for p in plans(workload, r, args)]})
            results["workloads"][workload] = {"arms": [a.name for a in arms[workload]], "repeats": repeats}
    finally:
        if own:
            stop_all(list(servers.values()))
    return results


def rates(workload: str, args: argparse.Namespace) -> list:
    """The arrival rates of a workload's plans: the shared Q&A's ``--rates`` then all at once
    (None); the chats are closed loop (None)."""
    return [*args.rates, None] if workload == "shared" else [None]


def episode(client: ArmClient, server, plan: list, open_loop: bool, rate: float | None, seed: int) -> dict:
    """One episode of ``plan`` on ``server`` with its prefix cache flushed, closed loop or open
    loop at ``rate``; with its TTFT's stages on that server."""
    with route([server.url], [server.proc.pid]) as to:
        before = server_stage_totals([to.url])
        if open_loop:
            out = run_open_loop(client, plan, rate, seed, to.pids)
        else:
            out = run_episode(client, plan, to.pids)
        out["stages_s"] = turn_stages(out, before, server_stage_totals([to.url]))
    return out


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """The median of ``values`` (one a repeat) and their range: "median (min - max)"."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f} - {max(v):.{digits}f})"


def per_repeat(results: dict, workload: str, arm: str, measure, plan: int = 0) -> list[float]:
    """``measure(episode)`` of ``arm``'s episode of plan ``plan`` in each repeat of ``workload``."""
    return [measure(r["episodes"][arm][plan]) for r in results["workloads"][workload]["repeats"]]


def late_ttft(episode: dict, first_turn: int) -> list[float]:
    """The TTFTs of the turns from ``first_turn`` (0-based) on."""
    return [t for t, a in zip(episode["ttft_s"], episode["answers"]) if a["index"] >= first_turn]


def turn_bytes(episode: dict, index: int) -> float:
    return next(a["request_bytes"] for a in episode["answers"] if a["index"] == index)


def hit_gap(episode: dict) -> float:
    """The prefix hit rate less the ideal of prefixes prefilled when each request was posted, in
    points (a cache of unbounded size; ``workload.ideal_hit_rate``)."""
    return (episode["hit_rate"] - episode["ideal_hit_rate_prefilled"]) * 100


def report(results: dict, args: argparse.Namespace, measured: str | None = None) -> str:
    ms = 1e3
    text = f"Measured: {measured or provenance()}\n"
    text += (f"{args.repeats} repeats, each cell the median over them (min - max); every turn "
             f"{args.answer_tokens} new tokens; TTFT from the turn's start, its client's tower included.\n")
    work = results["workloads"]
    if "agent" in work:
        late = args.late_turn
        rows = [[arm, spread(per_repeat(results, "agent", arm, lambda e: pct(late_ttft(e, late - 1), .5)), ms),
                 spread(per_repeat(results, "agent", arm, lambda e: pct(e["ttft_s"], .5)), ms),
                 spread(per_repeat(results, "agent", arm, lambda e: turn_bytes(e, 1)), 1e-6, 3),
                 spread(per_repeat(results, "agent", arm, lambda e: turn_bytes(e, args.agent_turns - 1)), 1e-6, 3),
                 spread(per_repeat(results, "agent", arm, lambda e: e["client_tower_s"] / e["turns"]), ms),
                 spread(per_repeat(results, "agent", arm, hit_gap), 1.0, 1)]
                for arm in work["agent"]["arms"]]
        text += table(f"(a) Agent chat: 1 user, {args.agent_turns} turns, a new {args.screen[0]}x{args.screen[1]} "
                      "screenshot each turn, every earlier one kept",
                      ["arm", f"TTFT p50, turns >= {late} (ms)", "TTFT p50, all turns (ms)", "request MB, turn 2",
                       f"request MB, turn {args.agent_turns}", "client tower ms / turn", "hit - ideal (points)"], rows)
        text += stage_table(results, "agent")
        if BY_HANDLE in work["agent"]["arms"]:
            apart = [[arm, spread(late_ttft_less_tower(results, arm, late), ms)] for arm in work["agent"]["arms"]
                     if arm != PREFIX_ONLY]  # its tower runs on every earlier image too
            text += table(f"(a) the tower counted apart on both sides: TTFT p50 of turns >= {late} less a turn's "
                          "tower (see late_ttft_less_tower)", ["arm", "TTFT p50 less the tower (ms)"], apart)
    if "shared" in work:
        rows = []
        for arm in work["shared"]["arms"]:
            for k, rate in enumerate(rates("shared", args)):
                rows.append([arm, "all at once" if rate is None else f"{rate:g}",
                             spread(per_repeat(results, "shared", arm, lambda e: e["requests_per_s"], k), 1.0, 2),
                             spread(per_repeat(results, "shared", arm, lambda e: pct(e["ttft_s"], .5), k), ms),
                             spread(per_repeat(results, "shared", arm, lambda e: pct(e["ttft_s"], .9), k), ms),
                             spread(per_repeat(results, "shared", arm, lambda e: e["hit_rate"] * 100, k), 1.0, 1),
                             spread(per_repeat(results, "shared", arm, hit_gap, k), 1.0, 1)])
        text += table(f"(b) Shared-image Q&A: {args.shared_requests} one-turn chats a rate, a system prompt, an image "
                      f"of a pool of {args.pool} (Zipf s={args.zipf}), a question; Poisson arrivals at each rate, "
                      "then all at once", ["arm", "offered req/s", "achieved req/s", "TTFT p50 (ms)", "TTFT p90 (ms)",
                                           "prefix hit %", "hit - ideal (points)"], rows)
    if "chat" in work:
        rows = [[arm, spread(per_repeat(results, "chat", arm, lambda e: e["requests_per_s"]), 1.0, 2),
                 spread(per_repeat(results, "chat", arm, lambda e: pct(e["ttft_s"], .5)), ms),
                 spread(per_repeat(results, "chat", arm, lambda e: e["request_bytes"] / e["turns"]), 1e-6, 3),
                 spread(per_repeat(results, "chat", arm, lambda e: e["tower_passes_per_item"] or 0.0), 1.0, 2),
                 spread(per_repeat(results, "chat", arm, hit_gap), 1.0, 1)]
                for arm in work["chat"]["arms"]]
        text += table(f"(c) Multi-turn chat: {args.chat_users} users x {args.chat_turns} turns, "
                      f"{args.chat_reuse:.0%} of turns reusing an item seen before",
                      ["arm", "req/s", "TTFT p50 (ms)", "request MB / turn", "client tower passes / item",
                       "hit - ideal (points)"], rows)
        text += stage_table(results, "chat")
    return text


def turn_tower(episode: dict, index: int) -> float:
    """The client's tower time in turn ``index`` of a one-user chat (recorded a turn; in results
    from before that, the episode's mean: one new image a turn)."""
    answer = next(a for a in episode["answers"] if a["index"] == index)
    return answer.get("tower_s", episode["client_tower_s"] / episode["turns"])


def late_ttft_less_tower(results: dict, arm: str, late: int) -> list[float]:
    """(a)'s TTFT p50 over the turns from ``late`` less a turn's tower, one value a repeat. Ours'
    tower is the client's, timed. Stock's runs inside its prefill forward, with its image
    processing: it is taken as stock's first-turn TTFT less ours by handle's first turn without
    its client's tower (the same prompt, nothing cached, one image on both sides), and it is the
    same on every turn (one new image a turn)."""
    out = []
    for repeat in results["workloads"]["agent"]["repeats"]:
        e = repeat["episodes"][arm][0]
        ttft = late_ttft(e, late - 1)
        if ALL_ARMS[arm].client in RAW_IMAGE_CLIENTS:
            ours = repeat["episodes"][BY_HANDLE][0]
            tower = e["ttft_s"][0] - (ours["ttft_s"][0] - turn_tower(ours, 0))
            out.append(pct([t - tower for t in ttft], .5))
        else:
            out.append(pct([t - turn_tower(e, a["index"]) for t, a in zip(e["ttft_s"], e["answers"])
                            if a["index"] >= late - 1], .5))
    return out


def stage_table(results: dict, workload: str) -> str:
    """Where each arm's mean TTFT went (``workload.turn_stages``), medians over the repeats."""
    arms = results["workloads"][workload]["arms"]
    names = list(per_repeat(results, workload, arms[0], lambda e: e["stages_s"])[0])
    rows = [[arm, *(spread(per_repeat(results, workload, arm, lambda e, k=k: e["stages_s"][k]), 1e3) for k in names)]
            for arm in arms]
    text = table(f"{workload}: where a turn's time to first token goes, ms a turn (stock's tower runs inside "
                 "its prefill forward; ours' in the client tower)", ["arm", *names], rows)
    return text


def largest_stages(results: dict, workload: str, arm: str, plan: int = 0) -> str:
    """The three largest stages of ``arm``'s mean TTFT (medians over the repeats), as text."""
    stages = per_repeat(results, workload, arm, lambda e: e["stages_s"], plan)
    medians = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in sorted(medians.items(), key=lambda kv: -kv[1])[:3])


def verdicts(results: dict, args: argparse.Namespace) -> str:
    """Issue #49's targets, each with its verdict from the medians over the repeats; a missed one
    names the stages that hold ours' turn."""
    med = lambda workload, arm, measure, plan=0: statistics.median(per_repeat(results, workload, arm, measure, plan))
    lines = []

    def verdict(name: str, met: bool, value: str, workload: str, arm: str, plan: int = 0) -> None:
        line = f"- {name}: **{'met' if met else 'missed'}** ({value})"
        if not met:
            line += f"; where ours' turn goes: {largest_stages(results, workload, arm, plan)}"
        lines.append(line)

    work = results["workloads"]
    has = lambda workload, *names: workload in work and set(names) <= set(work[workload]["arms"])
    if has("agent", BY_HANDLE, STOCK_TUNED):
        p50 = lambda e: pct(late_ttft(e, args.late_turn - 1), .5)
        ratio = med("agent", BY_HANDLE, p50) / med("agent", STOCK_TUNED, p50)
        verdict(f"(a) agent chat, turns >= {args.late_turn}: ours by handle's TTFT p50 <= 0.5x tuned stock's",
                ratio <= 0.5, f"{ratio:.2f}x", "agent", BY_HANDLE)
        apart = statistics.median(late_ttft_less_tower(results, BY_HANDLE, args.late_turn)) / statistics.median(
            late_ttft_less_tower(results, STOCK_TUNED, args.late_turn))
        lines.append(f"  - with the tower counted apart on both sides (late_ttft_less_tower): {apart:.2f}x")
        growth = med("agent", BY_HANDLE, lambda e: turn_bytes(e, args.agent_turns - 1)) / med(
            "agent", BY_HANDLE, lambda e: turn_bytes(e, 1))
        verdict(f"(a) ours by handle's request bytes flat in the turn count (turn {args.agent_turns} <= 1.25x turn 2)",
                growth <= 1.25, f"{growth:.2f}x", "agent", BY_HANDLE)
    if has("shared", BY_HANDLE) and (has("shared", STOCK_TUNED) or has("shared", STOCK_SERIAL)):
        saturation = len(args.rates)
        gaps = [med("shared", BY_HANDLE, hit_gap, k) for k in range(saturation + 1)]
        verdict("(b) shared Q&A: ours by handle's prefix hit rate equal to the ideal (within 1 point, every rate)",
                min(gaps) >= -1.0, ", ".join(f"{g:+.1f}" for g in gaps), "shared", BY_HANDLE, saturation)
        rps = lambda e: e["requests_per_s"]
        # tuned stock at its best of the settings run (one request a prefill keeps its CPU tower linear)
        tuned = max((a for a in (STOCK_TUNED, STOCK_SERIAL) if has("shared", a)),
                    key=lambda a: med("shared", a, rps, saturation))
        ratio = med("shared", BY_HANDLE, rps, saturation) / med("shared", tuned, rps, saturation)
        verdict(f"(b) shared Q&A at saturation: ours by handle's requests/s >= 1.3x tuned stock's ({tuned})",
                ratio >= 1.3, f"{ratio:.2f}x", "shared", BY_HANDLE, saturation)
        lines.append(f"  - where the turns go at saturation: {tuned}: {largest_stages(results, 'shared', tuned, saturation)}; "
                     f"ours by handle's {largest_stages(results, 'shared', BY_HANDLE, saturation)}")
    if has("chat", BY_HANDLE_BF16, STOCK_EMBEDS):
        rps = lambda e: e["requests_per_s"]
        ratio = med("chat", BY_HANDLE_BF16, rps) / med("chat", STOCK_EMBEDS, rps)
        verdict(f"(c) chat at {args.chat_reuse:.0%} reuse: ours by handle's requests/s >= 5x stock input_embeds' "
                "(both bfloat16)", ratio >= 5, f"{ratio:.2f}x", "chat", BY_HANDLE_BF16)
    return "\n### Targets (issue #49)\n" + "\n".join(lines) + "\n"


def plot(results: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = results["workloads"]
    panels = [w for w in ("agent", "shared") if w in work]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], panels):
        for arm in work[workload]["arms"]:
            color = f"C{list(ALL_ARMS).index(arm)}"  # an arm's colour in every panel and file
            if workload == "agent":
                ttft = per_repeat(results, "agent", arm, lambda e: e["ttft_s"])
                ax.plot(range(1, args.agent_turns + 1), [statistics.median(t[i] for t in ttft) * 1e3
                                                         for i in range(args.agent_turns)],
                        marker="o", color=color, label=arm)
            else:
                points = [(statistics.median(per_repeat(results, "shared", arm, lambda e: e["requests_per_s"], k)),
                           statistics.median(per_repeat(results, "shared", arm, lambda e: pct(e["ttft_s"], .5), k)) * 1e3)
                          for k in range(len(args.rates) + 1)]
                ax.plot(*zip(*points), marker="o", color=color, label=arm)
        if workload == "agent":
            ax.set(title="(a) agent chat: TTFT by turn (median of repeats)", xlabel="turn", ylabel="TTFT (ms)")
        else:
            ax.set(title="(b) shared-image Q&A: throughput vs TTFT p50", xlabel="achieved requests/s",
                   ylabel="TTFT p50 (ms)", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle("sgl_embeds vs stock SGLang, random-weight Qwen2.5-VL on CPU")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda v: v.split(","))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agent-turns", type=int, default=16)
    ap.add_argument("--late-turn", type=int, default=12, help="(a)'s target is on the turns from this one (1-based)")
    ap.add_argument("--screen", default=(1280, 800), type=lambda v: tuple(int(x) for x in v.split("x")))
    ap.add_argument("--image-side", type=int, default=448, help="(b) and (c)'s images, square")
    ap.add_argument("--pool", type=int, default=128)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--shared-requests", type=int, default=60)
    ap.add_argument("--rates", default=[1.0, 2.0, 4.0], type=lambda v: [float(x) for x in v.split(",")])
    ap.add_argument("--chat-users", type=int, default=8)
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument("--chat-reuse", type=float, default=0.8)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="vlm_wins", help="results: benchmarks/results/NAME.{md,json,png}")
    ap.add_argument("--skip-arms", default=[], type=arm_names,
                    help="arms left out, comma-separated (their names as in the tables)")
    ap.add_argument("--report-only", action="store_true", help="the tables again from results/NAME.json")
    args = ap.parse_args(argv)
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; of {WORKLOADS}")
    return args


def main() -> None:
    args = parse_args()
    if args.report_only:  # the tables and plot again from the saved results (their own provenance)
        saved = json.loads((RESULTS / f"{args.name}.json").read_text())
        args = argparse.Namespace(**{**vars(args), **saved["args"], "report_only": True})
        text = report(saved, args, saved["provenance"]) + verdicts(saved, args)
        save(args.name, saved, text)
        plot(saved, args)
        return
    results = run(args)
    text = report(results, args) + verdicts(results, args)
    save(args.name, {**results, "provenance": provenance(), "args": vars(args)}, text)
    plot(results, args)


if __name__ == "__main__":
    main()
