"""The VLM chat workload of ``benchmarks/bench_vlm_workload.py`` on the tiny Qwen2.5-VL server
with a working tower: every arm replays the same turns and answers every one of them, and the
token count the ideal hit rate is computed from is the server's own prompt length; the stages a
turn's time to first token is split into are each counted once a turn and none is negative."""

from __future__ import annotations

from dataclasses import asdict

import requests
from transformers import AutoTokenizer

from sgl_embeds.testing.workload import ARMS, ArmClient, plan_turns, run_episode, server_stage_totals, turn_stages
from sgl_embeds.vlm import QwenVLEncoder


def test_every_arm_answers_every_turn_of_one_plan(qwen_vl_server, qwen_vl_dir):
    plan = plan_turns(2, 2, 0.5, seed=1, image_side=224)
    encoder = QwenVLEncoder(qwen_vl_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(qwen_vl_dir)
    expected = sorted((t.user, t.index, asdict(t.item)) for t in plan)
    for arm in ARMS:
        requests.post(qwen_vl_server.url + "/flush_cache", timeout=60).raise_for_status()
        client = ArmClient(arm, qwen_vl_server.url, encoder, tokenizer, 224, answer_tokens=2)
        before = server_stage_totals([qwen_vl_server.url])
        out = run_episode(client, plan, [qwen_vl_server.proc.pid])
        # one sample a turn in each of the server's stages (else a ValueError), none negative
        stages = turn_stages(out, before, server_stage_totals([qwen_vl_server.url]))
        assert min(stages.values()) >= 0.0 and stages["prefill forward"] > 0.0, (arm, stages)
        assert (stages["client tower"] > 0.0) == (arm != "stock raw image"), (arm, stages)
        answers = out["answers"]
        assert [(a["user"], a["index"], a["item"]) for a in answers] == expected, arm
        assert all(a["output_tokens"] == 2 for a in answers), arm
        assert out["atoms_match_prompt_tokens"] == len(plan), arm
        # a cache of unbounded size does at least as well as the server's
        assert 0.0 < out["ideal_hit_rate"] < 1.0 and out["hit_rate"] <= out["ideal_hit_rate"] + 1e-9, arm
        if arm != "stock raw image":  # one tower pass per distinct item, shared by both users
            assert out["tower_passes_per_item"] == 1.0, arm
