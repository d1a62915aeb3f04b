"""``benchmarks/bench_vlm_wins.py`` (issue #49) in a small setting on the tiny Qwen2.5-VL: every
arm replays the same turns of every workload (the agent's chat, the shared-image Q&A open loop and
all at once, the multi-turn chat), over two repeats; the tuned stock server runs with its caches
on, as the bench starts it (the pool's ``qwen_vl_stock_tuned``); the report and the targets come
out of the results.

Left out here (a launch each): the arms on a server with its radix cache off, the bfloat16 pair
(``stock input_embeds``, which needs the language model served alone) and stock tuned with one
request a prefill; and, for time, the default stock arm (the tuned arm's raw images without their
hashes)."""

from __future__ import annotations

from dataclasses import asdict

import psutil
import pytest
import requests

import bench_vlm_wins as bench
from workload import HASHED_IMAGE


def test_the_tuned_stock_server_runs_with_its_caches_on(qwen_vl_stock_tuned_server):
    tuned_stock = qwen_vl_stock_tuned_server
    info = requests.get(tuned_stock.url + "/server_info", timeout=30).json()
    assert info["mm_preprocess_cache_size_mb"] == 2048 and info["trust_mm_content_hashes"] is True, info
    log = tuned_stock.log_path.read_text(errors="replace")
    cache_line = next((line for line in log.splitlines() if "Multimodal preprocess cache enabled" in line), "")
    assert "trusted" in cache_line, log[-3000:]
    # the tower-output cache's size is read from the environment in the scheduler
    processes = [psutil.Process(tuned_stock.proc.pid), *psutil.Process(tuned_stock.proc.pid).children(recursive=True)]
    assert any(p.environ().get("SGLANG_VLM_CACHE_SIZE_MB") == "2048" for p in processes)
    assert bench.ALL_ARMS[bench.STOCK_TUNED].client == HASHED_IMAGE  # it sends the hashes the server trusts


def test_every_arm_replays_the_same_turns(qwen_vl_stock_tuned_server, qwen_vl_server, qwen_vl_dir):
    args = bench.parse_args(["--repeats", "2", "--agent-turns", "2", "--late-turn", "2", "--screen", "320x200",
                             "--pool", "3", "--shared-requests", "4", "--rates", "16", "--chat-users", "2",
                             "--chat-turns", "2", "--chat-reuse", "0.5", "--answer-tokens", "2"])
    # the default stock arm is the tuned one's client without hashes: left out here, for time
    servers = {"stock tuned": qwen_vl_stock_tuned_server, "ours": qwen_vl_server}
    results = bench.run(args, qwen_vl_dir, servers)
    for workload, run in results["workloads"].items():
        expected_arms = [a for a in bench.WORKLOAD_ARMS[workload] if bench.ALL_ARMS[a].server in servers]
        assert run["arms"] == expected_arms and len(expected_arms) >= 3, workload
        assert len(run["repeats"]) == 2
        orders = [r["order"] for r in run["repeats"]]
        assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]), orders  # rotated
        for r, repeat in enumerate(run["repeats"]):
            plans = bench.plans(workload, r, args)
            assert repeat["plans"] == [[asdict(t) for t in plan] for plan in plans]  # a seed, one plan
            for k, plan in enumerate(plans):
                turns = sorted((t.user, t.index, asdict(t.item)) for t in plan)
                first_prompts = None
                for arm in expected_arms:
                    episode = repeat["episodes"][arm][k]
                    answered = sorted((a["user"], a["index"], a["item"]) for a in episode["answers"])
                    assert answered == turns, (workload, arm)
                    assert all(a["output_tokens"] == 2 for a in episode["answers"]), (workload, arm)
                    assert episode["hit_rate"] <= episode["ideal_hit_rate"] + 1e-9, (workload, arm)
                    # a first turn's prompt is the same tokens and rows on every arm
                    prompts = {(a["user"], a["index"]): a["prompt_tokens"] for a in episode["answers"] if a["index"] == 0}
                    assert first_prompts in (None, prompts), (workload, arm, first_prompts, prompts)
                    first_prompts = prompts
    shared = results["workloads"]["shared"]["repeats"][0]["episodes"][bench.BY_HANDLE]
    assert [e["offered_per_s"] for e in shared] == [16.0, None]
    text = bench.report(results, args) + bench.verdicts(results, args)
    for title in ("(a) Agent chat", "(b) Shared-image Q&A", "(c) Multi-turn chat"):
        assert title in text
    assert "(a) agent chat, turns >= 2" in text and "(b) shared Q&A at saturation" in text
    assert "(c) chat" not in text.split("### Targets")[1]  # its pair was not run


def test_arms_to_skip_are_read_whole_though_their_names_hold_commas():
    args = bench.parse_args(["--skip-arms", "stock,ours, encoder cache only,stock tuned, one request a prefill"])
    assert args.skip_arms == ["stock", bench.ENCODER_ONLY, bench.STOCK_SERIAL]
    with pytest.raises(SystemExit):
        bench.parse_args(["--skip-arms", "stock,encoder cache only"])
