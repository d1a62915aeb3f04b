"""Segments, server-side segment parsing and placeholder ids (no server)."""

from __future__ import annotations

import pytest
import torch

from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol import wire
from sgl_embeds_srt.parse import segments_from_wire
from sgl_embeds_srt.placeholders import PLACEHOLDER_BASE, is_placeholder, placeholder_ids


def test_placeholders_depend_only_on_row_content_as_the_model_sees_it():
    x = torch.randn(4, 16)
    ids = placeholder_ids(x)
    assert ids == placeholder_ids(x.clone())
    assert len(set(ids)) == 4
    assert placeholder_ids(x[2:3]) == ids[2:3]  # position-independent
    y = x.clone()
    y[1, 3] += 1e-3
    assert placeholder_ids(y)[1] != ids[1] and placeholder_ids(y)[0] == ids[0]
    # bf16 rows hash their bf16 bytes: two float32 rows that round alike share an id
    a = torch.tensor([[1.0, 2.0]])
    b = a + 1e-6
    assert placeholder_ids(a.bfloat16()) == placeholder_ids(b.bfloat16())
    assert placeholder_ids(a) != placeholder_ids(b)


def test_placeholder_range_is_far_above_any_vocab_and_fits_int64():
    ids = placeholder_ids(torch.randn(1000, 8))
    assert all(PLACEHOLDER_BASE <= i < 2**63 for i in ids)  # int64 holds them
    assert PLACEHOLDER_BASE >= 2**40
    assert all(is_placeholder(i) for i in ids) and not is_placeholder(151_935)


def test_prompt_merges_adjacent_text_and_round_trips_the_wire():
    from sgl_embeds.writer import encode_prompt

    p = seg.Prompt()
    p.append(seg.Text("a "))
    p.append(seg.Text("b"))
    p.append(seg.Span(torch.ones(2, 4)))
    p.append(seg.Ids([5, 6]))
    p.append(seg.Text(""))
    assert [type(s).__name__ for s in p.segments] == ["Text", "Span", "Ids"]
    assert p.segments[0].text == "a b"
    back = segments_from_wire(encode_prompt(p, hidden_size=4))
    assert back[0] == seg.Text("a b") and back[2] == seg.Ids([5, 6])
    assert torch.equal(back[1].rows, torch.ones(2, 4))


@pytest.mark.parametrize(
    "items, message",
    [
        ([], "non-empty list"),
        ([{"type": "image"}], "unknown type"),
        ([{"type": "text", "text": 3}], "'text' must be a string"),
        ([{"type": "input_ids", "input_ids": [1, -2]}], "non-negative ints"),
        ([{"type": "embeds"}], "needs an 'embeds' field"),
        ([{"type": "text", "text": "x"}, {"type": "embeds", "embeds": [[1.0], [1.0, 2.0]]}], "segment 1: ragged"),
        (["text"], "must be an object"),
    ],
)
def test_bad_segments_name_the_segment_and_problem(items, message):
    with pytest.raises(wire.WireError, match=message):
        segments_from_wire(items)


def test_total_span_bytes_share_one_budget():
    items = [{"type": "embeds", "embeds": wire.encode_tensor(torch.zeros(10, 10))}] * 3
    segments_from_wire(items, max_bytes=1200)
    with pytest.raises(wire.WireError, match="size limit"):
        segments_from_wire(items + items, max_bytes=1200)
