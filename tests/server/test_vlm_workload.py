"""The VLM chat workload of ``benchmarks/bench_vlm_workload.py`` on the tiny Qwen2.5-VL server
with a working tower: every arm replays the same turns and answers every one of them, on the
server and through smg (``workload.route``), and the token count the ideal hit rate is computed
from is the server's own prompt length; the stages a turn's time to first token is split into are
each counted once a turn and none is negative; the prompt tokens the server counts (what the
bench reads to see how a gateway spread the turns) are the answers' prompt tokens."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import requests
from transformers import AutoTokenizer

from workload import (
    ARMS, SMG_ARMS, ArmClient, Turn, plan_turns, prompt_tokens_taken, route, run_episode, server_stage_totals,
    turn_stages,
)
from sgl_embeds.vlm import QwenVLEncoder


@pytest.fixture(scope="module")
def client_parts(qwen_vl_dir):
    """The encoder and the tokenizer the arms' clients share."""
    return QwenVLEncoder(qwen_vl_dir, device="cpu"), AutoTokenizer.from_pretrained(qwen_vl_dir)


def _check_every_turn_answered(out: dict, plan: list[Turn], client: str, arm: str) -> None:
    """``out``: an episode of ``plan`` by ``client`` (one of ``ARMS``) in ``arm``."""
    expected = sorted((t.user, t.index, asdict(t.item)) for t in plan)
    answers = out["answers"]
    assert [(a["user"], a["index"], a["item"]) for a in answers] == expected, arm
    assert all(a["output_tokens"] == 2 for a in answers), arm
    assert out["atoms_match_prompt_tokens"] == len(plan), arm
    # a cache of unbounded size does at least as well as the server's
    assert 0.0 < out["ideal_hit_rate"] < 1.0 and out["hit_rate"] <= out["ideal_hit_rate"] + 1e-9, arm
    if client != "stock raw image":  # one tower pass per distinct item, shared by both users
        assert out["tower_passes_per_item"] == 1.0, arm


def test_every_arm_answers_every_turn_of_one_plan(qwen_vl_server, client_parts):
    plan = plan_turns(2, 2, 0.5, seed=1, image_side=224)
    for arm in ARMS:
        requests.post(qwen_vl_server.url + "/flush_cache", timeout=60).raise_for_status()
        client = ArmClient(arm, qwen_vl_server.url, *client_parts, 224, answer_tokens=2)
        before = server_stage_totals([qwen_vl_server.url])
        (tokens_before,) = prompt_tokens_taken([qwen_vl_server.url])
        out = run_episode(client, plan, [qwen_vl_server.proc.pid])
        # what the bench reads to see how a gateway spread the turns: the server's own prompt count
        (tokens_after,) = prompt_tokens_taken([qwen_vl_server.url])
        assert tokens_after - tokens_before == sum(a["prompt_tokens"] for a in out["answers"]) > 0, arm
        # one sample a turn in each of the server's stages (else a ValueError), none negative
        stages = turn_stages(out, before, server_stage_totals([qwen_vl_server.url]))
        assert min(stages.values()) >= 0.0 and stages["prefill forward"] > 0.0, (arm, stages)
        assert (stages["client tower"] > 0.0) == (arm != "stock raw image"), (arm, stages)
        _check_every_turn_answered(out, plan, arm, arm)


def test_the_smg_arms_answer_every_turn_through_the_gateway(qwen_vl_server, client_parts):
    """``SMG_ARMS`` through ``route``'s gateway (cache-aware) in front of the pooled server under
    two addresses, which smg takes for two workers (a second model server would cost a launch;
    so no handle is refused here: both "workers" hold every span): every turn answered, each
    request through the gateway, the caches flushed first (the previous test left this plan's
    prefixes on the server: unflushed, the stock arm's hit rate would pass the ideal)."""
    plan = plan_turns(2, 2, 0.5, seed=1, image_side=224)
    addresses = [qwen_vl_server.url, qwen_vl_server.url.replace("127.0.0.1", "localhost")]
    for arm in SMG_ARMS:
        assert arm.workers == len(addresses)
        with route(addresses, [qwen_vl_server.proc.pid] * arm.workers) as to:
            client = ArmClient(arm.client, to.url, *client_parts, 224, answer_tokens=2)
            out = run_episode(client, plan, to.pids)
            _check_every_turn_answered(out, plan, arm.client, arm.name)
            assert out["resent"] == 0, arm.name
            assert to.gateway.posts_taken("/generate") == len(plan), arm.name
            assert to.pids == [qwen_vl_server.proc.pid, to.gateway.proc.pid], arm.name
