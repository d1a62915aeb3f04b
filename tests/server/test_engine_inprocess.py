"""Span prompts through an in-process ``sglang.Engine`` (the plugin hooks Engine.generate).

The engine runs in a child process (``engine_probe.py``): its ``shutdown()`` kills every child
of the calling process, which here would take the shared test servers down with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import seeded_rows as rows
from helpers import reference_embeds, with_other_spans
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing import zygote
from sgl_embeds_testing.server import cpu_env

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def probe(llama_dir, servers):
    servers.make_room(1)  # the child's engine
    script = Path(__file__).parents[1] / "engine_probe.py"
    done = zygote.run([str(script), str(llama_dir)], cpu_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_engine_span_prompt_matches_hf_and_hits_the_cache(probe, llama_dir):
    res = probe["segments"]
    parts = ["the small dog", rows(11, 7), " is"]
    ref.assert_matches_hf({"output_ids": res["ids"], "meta_info": res["meta_info"]}, llama_dir, reference_embeds(llama_dir, parts), 10,
                          other_span_embeds=reference_embeds(llama_dir, with_other_spans(parts)))
    assert res["cached"] == res["prompt"] - 1 and res["again_ids"] == res["ids"]


def test_engine_full_prompt_tensor_batch_and_stream(probe, llama_dir):
    for seed, ids in zip((1, 2), probe["batch"]):
        ref.assert_matches_hf(ids, llama_dir, rows(seed, 6), 6, f"prompt {seed}: ", other_span_embeds=rows(seed + 50, 6))
    assert probe["stream"]["chunks"] > 1 and probe["stream"]["completion"] == 6


def test_engine_bad_input_raises_value_error_and_keeps_serving(probe):
    assert "hidden size 3" in probe["errors"][0] and "NaN or Inf" in probe["errors"][1]
    assert "input_ids[2] = 1000000 is outside the vocabulary" in probe["errors"][2]
    assert "input_ids[1] = -2" in probe["errors"][3] and "input_ids[1][0]" in probe["errors"][4]
    assert probe["after_errors"] == 3
