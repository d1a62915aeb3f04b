"""The checks of an image span on a natively served Qwen-VL, without a server (``prompts.build_ids``
with a ``VisionSpec``): the span's width with a Qwen3-VL's deepstack rows, the grid, and the ids
SGLang's rope index will read (no pad token outside a span, every span closed)."""

from __future__ import annotations

import pytest
import torch

from sgl_embeds_srt import wire
from sgl_embeds_srt.image_spans import VisionSpec
from sgl_embeds_srt.prompts import ModelSpec, build_ids
from sgl_embeds_srt.segments import Ids, Span

START, END, IMAGE, VIDEO = 500, 501, 502, 503


def spec(deepstack_layers: int) -> ModelSpec:
    vision = VisionSpec("qwen3_vl" if deepstack_layers else "qwen2_vl", IMAGE, VIDEO, START, END, 2, None,
                        deepstack_layers)
    return ModelSpec(hidden_size=16, dtype=torch.float32, vocab_size=600, context_len=256, tokenizer=None,
                     vision=vision)


def image(width: int, grid=(1, 4, 4), rows: int = 4) -> list:
    return [Ids([1, START]), Span(torch.randn(rows, width), image_grid_thw=grid), Ids([END, 2])]


def test_the_span_width_holds_the_deepstack_rows():
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(text_config={"hidden_size": 64}, vision_config={"deepstack_visual_indexes": [0, 1, 2]})
    vision = VisionSpec.of(config)
    assert (vision.model_type, vision.deepstack_layers, vision.span_width(64)) == ("qwen3_vl", 3, 256)
    assert spec(2).span_width == 48 and spec(0).span_width == 16
    ids, rows = build_ids(image(48), spec(2))
    assert ids == [1, START, IMAGE, IMAGE, IMAGE, IMAGE, END, 2] and rows.embeds.shape == (4, 48)


def test_a_span_of_another_width_names_the_width_and_why():
    with pytest.raises(wire.WireError, match=r"segment 1: .*\[n, 16 x \(1 \+ 2\)\] = \[n, 48\].*deepstack.*Got width 16"):
        build_ids(image(16), spec(2))
    with pytest.raises(wire.WireError, match=r"\(qwen2_vl\) is \[n, 16\] \(the LLM's hidden size\); got width 48"):
        build_ids(image(48), spec(0))


def test_an_image_grid_with_t_above_1_is_refused():
    with pytest.raises(ValueError, match=r"image_grid_thw \[2, 2, 4\]: .*t > 1 is a video"):
        build_ids(image(16, grid=(2, 2, 4)), spec(0))


@pytest.mark.parametrize("extra, message", [
    ([Ids([START, IMAGE, END])], "position 9 holds the image pad token"),
    ([Ids([VIDEO])], "position 8 holds the video pad token"),
])
def test_pad_tokens_outside_a_span_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        build_ids(image(16) + extra, spec(0))


def test_an_image_span_not_closed_by_the_vision_end_token_is_refused():
    open_span = image(16)[:2] + [Ids([2])]
    with pytest.raises(ValueError, match="image span at position 2 must be followed by the vision-end token"):
        build_ids(open_span, spec(0))
    with pytest.raises(ValueError, match="followed by the vision-end token"):
        build_ids(image(16)[:2], spec(0))  # the prompt ends with the span


def test_qwen3_vl_moe_is_refused_by_name():
    """Its LLM adds exactly 3 deepstack layers whatever the config says, and it has not run here
    (docs/vision-encoders.md)."""
    vision = VisionSpec("qwen3_vl_moe", IMAGE, VIDEO, START, END, 2, None, 3)
    moe = ModelSpec(hidden_size=16, dtype=torch.float32, vocab_size=600, context_len=256, tokenizer=None, vision=vision)
    with pytest.raises(ValueError, match=r"spans are not served on qwen3_vl_moe models yet"):
        build_ids(image(64), moe)
