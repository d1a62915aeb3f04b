"""Span prompts through an in-process ``sglang.Engine`` (the plugin hooks Engine.generate)."""

from __future__ import annotations

import pytest
import torch

from helpers import reference_embeds
from sgl_embeds.testing import reference as ref
from sgl_embeds.testing.server import engine as make_engine

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def llama_engine(llama_dir):
    eng = make_engine(llama_dir)
    yield eng
    eng.shutdown()


def test_engine_span_prompt_matches_hf_and_hits_the_cache(llama_engine, llama_dir):
    E = torch.randn(7, 64, generator=torch.Generator().manual_seed(11)) * 0.05
    segments = [{"type": "text", "text": "the small dog"}, {"type": "embeds", "embeds": E}, {"type": "text", "text": " is"}]
    sp = {"temperature": 0, "max_new_tokens": 10}
    out = llama_engine.generate(input_segments=segments, sampling_params=sp)
    tokens, gaps = ref.greedy(llama_dir, reference_embeds(llama_dir, ["the small dog", E, " is"]), 10)
    ref.assert_same_tokens(out["output_ids"], tokens, gaps)
    again = llama_engine.generate(input_segments=segments, sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == out["output_ids"]


def test_engine_full_prompt_tensor_batch_and_stream(llama_engine, llama_dir):
    xs = [torch.randn(6, 64, generator=torch.Generator().manual_seed(s)) * 0.05 for s in (1, 2)]
    sp = {"temperature": 0, "max_new_tokens": 6}
    batch = llama_engine.generate(input_embeds=xs, sampling_params=sp)
    for x, o in zip(xs, batch):
        tokens, gaps = ref.greedy(llama_dir, x, 6)
        ref.assert_same_tokens(o["output_ids"], tokens, gaps)
    chunks = list(llama_engine.generate(input_embeds=xs[0], sampling_params=sp, stream=True))
    assert len(chunks) > 1 and chunks[-1]["meta_info"]["completion_tokens"] == 6


def test_engine_bad_input_raises_value_error_and_keeps_serving(llama_engine):
    with pytest.raises(ValueError, match="hidden size 3"):
        llama_engine.generate(input_embeds=torch.zeros(2, 3), sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="NaN or Inf"):
        llama_engine.generate(input_embeds=torch.full((2, 64), float("nan")), sampling_params={"max_new_tokens": 1})
    out = llama_engine.generate(prompt="the red fox", sampling_params={"temperature": 0, "max_new_tokens": 3})
    assert len(out["output_ids"]) == 3
