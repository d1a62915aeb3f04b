"""The segment compiler of the frontend, without a server."""

from __future__ import annotations

import numpy as np
import pytest
import sglang as sgl
import torch
from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import get_chat_template
from sglang.lang.interpreter import ProgramState, StreamExecutor

import sgl_embeds
from sgl_embeds import lang
from sgl_embeds_testing.encoders import GridEncoder, synthetic_scene
from sgl_embeds_protocol import segments as seg


def _executor(use_thread: bool = True) -> StreamExecutor:
    """An offline executor (chatml template); one without a thread needs no ``end()``."""
    template = get_chat_template("chatml")
    return StreamExecutor(BaseBackend(), {}, None, template, False, use_thread=use_thread)


def _run_fill_only(program, **kwargs):
    """Execute a program without gen/select on an offline executor."""
    ex = _executor()
    program.func(ProgramState(ex), **kwargs)
    ex.sync()
    return ex


def test_primitives_are_installed_on_sgl():
    assert sgl.embeds is sgl_embeds.embeds and sgl.region is sgl_embeds.region


def test_text_and_spans_compile_to_interleaved_segments():
    a, b = torch.randn(3, 8), np.ones((2, 8), dtype=np.float32)

    @sgl.function
    def prog(s):
        s += "Describe " + sgl.embeds(a) + " and " + sgl.embeds(b) + " briefly."
        s += sgl.embeds([0.5] * 8)

    ex = _run_fill_only(prog)
    segs = lang.program_segments(ex)
    assert [type(x).__name__ for x in segs] == ["Text", "Span", "Text", "Span", "Text", "Span"]
    assert segs[0] == seg.Text("Describe ") and segs[2] == seg.Text(" and ") and segs[4] == seg.Text(" briefly.")
    assert torch.equal(segs[1].rows, a) and torch.equal(segs[3].rows, torch.ones(2, 8)) and segs[5].rows.shape == (1, 8)


def test_spans_inside_chat_roles_keep_the_template_around_them():
    x = torch.randn(2, 8)

    @sgl.function
    def prog(s):
        s += sgl.system("You see images.")
        s += sgl.user("Look: " + sgl.embeds(x) + " What is it?")

    ex = _run_fill_only(prog)
    segs = lang.program_segments(ex)
    assert isinstance(segs[1], seg.Span) and len(segs) == 3
    assert segs[0].text.endswith("<|im_start|>user\nLook: ") and segs[2].text.startswith(" What is it?<|im_end|>")


def test_fork_copies_spans_to_every_branch():
    x = torch.randn(4, 8)

    @sgl.function
    def prog(s):
        s += "A " + sgl.embeds(x)
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" branch {i}"
        s["texts"] = [lang.program_segments(f) for f in forks]

    ex = _run_fill_only(prog)
    for i, segs in enumerate(ex.variables["texts"]):
        assert torch.equal(segs[1].rows, x) and segs[2] == seg.Text(f" branch {i}")


@pytest.mark.parametrize("bad, message", [(torch.zeros(2, 3, 4), r"\[n, hidden\]"), (torch.tensor([[float("nan")]]), "NaN"),
                                          ("text", "tensor, array or nested list"), ([[1.0], [1.0, 2.0]], "ragged")])
def test_bad_spans_fail_when_the_program_is_written(bad, message):
    with pytest.raises(ValueError, match=message):
        sgl.embeds(bad)


def test_unknown_marker_is_an_error_not_a_silent_drop():
    with pytest.raises(ValueError, match="no tensor"):
        seg.split_at_markers(f"a {seg.marker(7)} b", {})


def test_compile_program_lists_what_each_gen_and_select_would_send():
    x = torch.randn(2, 8)

    @sgl.function
    def prog(s):
        s += "Q: " + sgl.embeds(x) + " A:" + sgl.gen("a", max_tokens=3)
        s += " so " + sgl.select("c", choices=["yes", "no"])

    sent = sgl_embeds.compile_program(prog)
    assert len(sent) == 3
    assert [type(v).__name__ for v in sent[0]] == ["Text", "Span", "Text"] and sent[0][2] == seg.Text(" A:")
    assert sent[1][2] == seg.Text(" A: so ") and sent[2][2] == seg.Text(" A: so yes")



def test_every_executor_gets_its_own_span_record():
    a, b = _executor(use_thread=False), _executor(use_thread=False)
    assert isinstance(lang.program_spans(a), lang.ProgramSpans)
    assert lang.program_spans(a) is not lang.program_spans(b)


def test_a_branch_sees_the_images_of_its_parent():
    @sgl.function
    def prog(s):
        s += "Look: " + sgl.image(synthetic_scene())
        forks = s.fork(2)
        for f in forks:
            f += " here: " + sgl.region((0.0, 0.0, 0.5, 0.5)) + sgl.gen("x", max_tokens=1)
        s["x"] = [f["x"] for f in forks]  # waits for the branches

    sent = sgl_embeds.compile_program(prog, vision_encoder=GridEncoder(hidden=8))
    kinds = [[type(x).__name__ for x in segs] for segs in sent[:2]]
    assert kinds == [["Text", "Span", "Text", "Span"]] * 2  # the image's span, then the region's


def test_an_executor_without_the_record_is_a_clear_error():
    with pytest.raises(RuntimeError, match="import sgl_embeds before running programs"):
        lang.program_spans(object())
