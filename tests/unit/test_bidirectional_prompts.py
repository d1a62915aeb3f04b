"""A bidirectional span from the program to the scheduler's ranges, without a server: the DSL, the
wire both ways, the ids ``build_ids`` gives it, and the 400s where a server cannot attend a block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sglang as sgl
import torch

from sgl_embeds import lang
from sgl_embeds.writer import SpanWriter
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import FAMILY_FILE, family_file
from sgl_embeds_srt.blocks import span_blocks
from sgl_embeds_srt.parse import segments_from_wire
from sgl_embeds_srt.prompts import ModelSpec, block_limit, blocks_refused, build_ids
from test_lang_compile import _run_fill_only

ROWS = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))


def test_a_program_span_keeps_its_attention_on_the_wire_and_back():
    @sgl.function
    def prog(s):
        s += "look " + sgl.embeds(ROWS, attention="bidirectional") + " then " + sgl.embeds(ROWS[:2])

    segments = lang.program_segments(_run_fill_only(prog))
    assert [s.bidirectional for s in segments if isinstance(s, seg.Span)] == [True, False]
    wired = SpanWriter(8).fields("input_segments", [segments], batch=False)["input_segments"]
    assert wired[1][seg.ATTENTION] == seg.BIDIRECTIONAL and seg.ATTENTION not in wired[3]
    parsed = segments_from_wire(wired)
    assert [s.bidirectional for s in parsed if isinstance(s, seg.Span)] == [True, False]


@pytest.mark.parametrize("value", ["both", "Bidirectional", 1])
def test_an_unknown_attention_is_refused_where_it_enters(value):
    with pytest.raises(ValueError, match="attention must be 'causal' or 'bidirectional'"):
        sgl.embeds(ROWS, attention=value)
    with pytest.raises(ValueError, match="segment 0: attention must be"):
        segments_from_wire([{"type": "embeds", "embeds": ROWS.tolist(), seg.ATTENTION: value}])


def _spec(**kwargs) -> ModelSpec:
    return ModelSpec(8, torch.float32, 100, 64, None, **kwargs)


def _ids_and_rows(bidirectional: bool, spec: ModelSpec | None = None):
    return build_ids([seg.Ids([1, 2]), seg.Span(ROWS, bidirectional=bidirectional), seg.Ids([3])], spec or _spec())


def test_a_block_names_its_whole_span_in_its_first_id():
    causal_ids, _ = _ids_and_rows(False)
    block_ids, prompt_rows = _ids_and_rows(True)
    assert block_ids[3:] == causal_ids[3:] and block_ids[:2] == causal_ids[:2] == [1, 2]
    assert block_ids[2] != causal_ids[2], "the same rows sent causally must not share a block's cache"
    other_ids, _ = build_ids([seg.Ids([1, 2]), seg.Span(torch.cat([ROWS, ROWS[:1]]), bidirectional=True)], _spec())
    assert other_ids[2] != block_ids[2] and other_ids[3:7] == block_ids[3:7], "a longer block is another block"
    assert span_blocks(prompt_rows) == [(2, 7)]


def _args(backend: str, prefill: str | None = None, model_path: str | None = None, **more):
    return SimpleNamespace(attention_backend=backend, prefill_attention_backend=prefill,
                           max_prefill_tokens=16, model_path=model_path, **more)


def _limit(backend: str = "torch_native", window: int | None = None):
    text = SimpleNamespace(sliding_window=window)
    return block_limit(_args(backend), SimpleNamespace(hf_text_config=text))


@pytest.mark.parametrize("refused, max_block, message", [
    ("a reason", None, "a bidirectional span cannot be served here: a reason"),
    (None, _limit(), "a bidirectional span has 17 positions; a block is prefilled in one step, of at most 16"),
    (None, _limit("triton", window=8), "a bidirectional span has 17 positions; on 'triton' a block must fit "
                                       "the model's sliding window of 8 positions"),
])
def test_a_block_the_server_cannot_attend_is_a_400(refused, max_block, message):
    rows = torch.randn(17, 8)
    prompt = [seg.Ids([1, 2]), seg.Span(rows, bidirectional=True), seg.Ids([3])]
    with pytest.raises(ValueError, match=f"segment 1: {message}"):
        build_ids(prompt, _spec(blocks_refused=refused, max_block=max_block))
    prompt[1] = seg.Span(rows)
    build_ids(prompt, _spec(blocks_refused=refused, max_block=max_block))  # causal spans pass


def test_the_sliding_window_bounds_a_block_on_the_gpu_backends_only():
    assert _limit(window=4).positions == 16, "torch_native attends a block past the window"
    assert _limit("flashinfer", window=4).positions == 4
    assert _limit("triton", window=64).positions == 16, "the smaller limit holds"
    assert _limit("triton").positions == 16
    qwen2 = SimpleNamespace(hf_text_config=SimpleNamespace(sliding_window=4, use_sliding_window=False))
    assert block_limit(_args("triton"), qwen2).positions == 16, "a window the model does not use"


def test_a_prefix_lm_prompt_is_one_block_under_the_same_limit():
    build_ids([seg.Ids(list(range(16)))], _spec(prefix_lm=True, max_block=_limit()))
    with pytest.raises(ValueError, match="the prompt .* has 17 positions"):
        build_ids([seg.Ids(list(range(17)))], _spec(prefix_lm=True, max_block=_limit()))


def test_where_blocks_are_refused_and_why():
    plain = SimpleNamespace(linear_attn_registry_result=None)
    for backend in ("torch_native", "triton", "flashinfer"):
        assert blocks_refused(_args(backend), plain, None) is None
    assert "prefills with 'fa3'" in blocks_refused(_args("fa3"), plain, None)
    assert "prefills with 'fa3'" in blocks_refused(_args("triton", "fa3"), plain, None)
    assert "natively" in blocks_refused(_args("torch_native"), plain, object())
    hybrid = SimpleNamespace(linear_attn_registry_result=object())
    assert "linear-attention" in blocks_refused(_args("torch_native"), hybrid, None)
    # what the GPU backends' masks do not reach
    assert "speculative" in blocks_refused(_args("triton", speculative_algorithm="EAGLE"), plain, None)
    assert "deterministic" in blocks_refused(_args("triton", enable_deterministic_inference=True), plain, None)
    assert "context parallelism" in blocks_refused(_args("flashinfer", dcp_size=2), plain, None)
    mla = SimpleNamespace(linear_attn_registry_result=None, attention_arch=SimpleNamespace(name="MLA"))
    assert "latent" in blocks_refused(_args("triton"), mla, None)
    assert blocks_refused(_args("torch_native", speculative_algorithm="EAGLE"), plain, None) is None


def test_blocks_on_the_sliding_layers_only_are_attended_on_torch_native_and_triton(tmp_path):
    """A split Gemma 4 26B / 31B (its family file says ``sliding_blocks``): torch_native and
    Triton attend a block on the sliding layers alone (Triton's within the window); FlashInfer
    plans one mask for every layer, so it is refused by name."""
    (tmp_path / FAMILY_FILE).write_text(family_file("gemma4", "../vision", "<|image|>",
                                                    sliding_blocks=True))
    plain = SimpleNamespace(linear_attn_registry_result=None)
    for backend in ("torch_native", "triton"):
        assert blocks_refused(_args(backend, model_path=str(tmp_path)), plain, None) is None
    why = blocks_refused(_args("flashinfer", model_path=str(tmp_path)), plain, None)
    assert "sliding layers only" in why and "'flashinfer'" in why
    text = SimpleNamespace(hf_text_config=SimpleNamespace(sliding_window=8))
    assert block_limit(_args("triton", model_path=str(tmp_path)), text).positions == 8
