"""The checks of an image or clip span on a natively served Qwen-VL, without a server
(``prompts.build_ids`` with a ``VisionSpec``): the span's width with a Qwen3-VL's deepstack rows,
the grid and a clip's time, the ids SGLang's rope index will read (no pad token outside a span,
every span closed), a clip's ids and positions per family, and the items' cache identity."""

from __future__ import annotations

import pytest
import torch

from sgl_embeds_protocol import wire
from sgl_embeds_srt.image_spans import VisionSpec, identity
from sgl_embeds_srt.prompts import ModelSpec, build_ids
from sgl_embeds_protocol.segments import Grid, Ids, Span

START, END, IMAGE, VIDEO = 500, 501, 502, 503


class LetterTokenizer:
    """One id per character (300 + its code mod 100): enough to see a clip's frame times."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [300 + ord(c) % 100 for c in text]


def spec(deepstack_layers: int, model_type: str | None = None, tokens_per_second: float | None = None) -> ModelSpec:
    model_type = model_type or ("qwen3_vl" if deepstack_layers else "qwen2_vl")
    vision = VisionSpec(model_type, IMAGE, VIDEO, START, END, 2, tokens_per_second, deepstack_layers)
    return ModelSpec(hidden_size=16, dtype=torch.float32, vocab_size=600, context_len=256,
                     tokenizer=LetterTokenizer(), vision=vision)


def image(width: int, grid=(1, 4, 4), rows: int = 4) -> list:
    return [Ids([1, START]), Span(torch.randn(rows, width), grid=Grid(grid)), Ids([END, 2])]


def clip(width: int, grid: Grid, rows: torch.Tensor | None = None) -> list:
    rows = torch.randn(grid.n_rows(2), width) if rows is None else rows
    return [Ids([1, START]), Span(rows, grid=grid), Ids([END, 2])]


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
    with pytest.raises(ValueError, match=r"image_grid_thw \[2, 2, 4\]: .*t > 1 is a clip.*video_grid_thw"):
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
    with pytest.raises(ValueError, match=r"spans are not served on qwen3_vl_moe models: .*3 deepstack layers"):
        build_ids(image(64), moe)


def test_a_qwen2_5_vl_clip_spaces_its_steps_by_its_seconds():
    """Grid (2, 2, 4), merge 2: two steps of 1 x 2 rows; 1.0 s per step at 2 positions per second
    puts the second step 2 time positions after the first (SGLang's rope index; HF's the same
    here, where the time extent stays below the width)."""
    grid = Grid((2, 2, 4), video=True, second_per_grid_t=1.0)
    ids, rows = build_ids(clip(16, grid), spec(0, "qwen2_5_vl", tokens_per_second=2))
    assert ids == [1, START, VIDEO, VIDEO, VIDEO, VIDEO, END, 2]
    (item,) = rows.images.mm_items
    assert item.modality.name == "VIDEO" and item.offsets == [(2, 5)]
    expected = torch.tensor([[0, 1, 2, 2, 4, 4, 5, 6],   # time: steps at 2 and 2 + 1.0 * 2
                             [0, 1, 2, 2, 2, 2, 5, 6],   # height: one merged row
                             [0, 1, 2, 3, 2, 3, 5, 6]])  # width: two merged columns
    assert torch.equal(rows.images.mrope_positions, expected)
    faster = build_ids(clip(16, Grid((2, 2, 4), video=True, second_per_grid_t=0.5)), spec(0, "qwen2_5_vl", 2))[1]
    assert faster.images.mrope_positions[0].tolist() == [0, 1, 2, 2, 3, 3, 4, 5]


def test_a_qwen3_vl_clip_is_written_frame_by_frame_after_each_frame_time():
    """As its processor (and SGLang's) writes a video: per temporal step, its time as text, then
    the frame's rows inside their own vision start and end; one item per frame."""
    grid = Grid((2, 2, 4), video=True, timestamps=(0.25, 1.25))
    ids, rows = build_ids(clip(48, grid), spec(2))
    text = LetterTokenizer().encode
    frame = [START, VIDEO, VIDEO, END]
    assert ids == [1, START, *text("<0.2 seconds>"), *frame, *text("<1.2 seconds>"), *frame, END, 2]
    starts = [i + 1 for i, t in enumerate(ids) if t == START and ids[i + 1] == VIDEO]
    assert [item.offsets for item in rows.images.mm_items] == [[(s, s + 1)] for s in starts]
    assert rows.positions == [p for s in starts for p in (s, s + 1)]
    positions = rows.images.mrope_positions
    for s in starts:  # each frame: one time position, its two columns side by side
        assert positions[0, s] == positions[0, s + 1] and positions[2, s + 1] == positions[2, s] + 1


@pytest.mark.parametrize("model_type, grid, message", [
    ("qwen2_5_vl", Grid((2, 2, 4), video=True), "a clip on qwen2_5_vl takes second_per_grid_t .*got no time field"),
    ("qwen2_5_vl", Grid((2, 2, 4), video=True, timestamps=(0.0, 1.0)), "takes second_per_grid_t .*got video_timestamps"),
    ("qwen3_vl", Grid((2, 2, 4), video=True, second_per_grid_t=1.0), "takes video_timestamps .*got second_per_grid_t"),
    ("qwen2_vl", Grid((2, 2, 4), video=True, second_per_grid_t=1.0), "takes no time field .*got second_per_grid_t"),
    ("qwen2_vl", Grid((2, 2, 6), video=True), r"video_grid_thw \[2, 2, 6\] makes t\*h\*w/merge\*\*2 = 6 rows"),
])
def test_a_clip_without_the_time_its_model_reads_or_of_another_size_is_refused(model_type, grid, message):
    deepstack = 2 if model_type == "qwen3_vl" else 0
    rows = torch.randn(4, 16 * (1 + deepstack))
    with pytest.raises(ValueError, match=message):
        build_ids(clip(16, grid, rows), spec(deepstack, model_type, tokens_per_second=2))


@pytest.mark.parametrize("fields, message", [
    ({"image_grid_thw": [1, 2, 2], "video_grid_thw": [2, 2, 2]}, "an image .* or a clip .*, not both"),
    ({"image_grid_thw": [1, 2, 2], "second_per_grid_t": 1.0}, "give them with video_grid_thw"),
    ({"video_timestamps": [0.0]}, "give them with its video_grid_thw"),
    ({"video_grid_thw": [2, 2, 2], "video_timestamps": [0.0]}, r"one time .* per temporal step: 2 for"),
    ({"video_grid_thw": [2, 2, 2], "second_per_grid_t": 0}, "finite number of seconds > 0"),
    ({"video_grid_thw": [2, 2, 2], "video_timestamps": [0.0, float("nan")]}, "finite, >= 0"),
    ({"video_grid_thw": [2, 0, 2]}, r"video_grid_thw must be \[t, h, w\] of positive ints"),
])
def test_a_malformed_grid_is_refused_where_it_enters(fields, message):
    with pytest.raises(ValueError, match=message):
        Grid.of_fields(fields)


def test_the_cache_identity_names_the_rows_the_grid_the_time_and_the_frame():
    image = Grid((1, 2, 4))
    clip_a = Grid((2, 2, 4), video=True, second_per_grid_t=1.0)
    different = [identity("span-a", image), identity("span-b", image), identity("span-a", Grid((1, 4, 2))),
                 identity("span-a", Grid((1, 2, 4), video=True)), identity("span-a", clip_a),
                 identity("span-a", Grid((2, 2, 4), video=True, second_per_grid_t=0.5)),
                 identity("span-a", Grid((2, 2, 4), video=True, timestamps=(0.0, 1.0))),
                 identity("span-a", Grid((2, 2, 4), video=True, timestamps=(0.0, 2.0))),
                 identity("span-a", Grid((2, 2, 4), video=True, timestamps=(0.0, 2.0)), run=1)]
    assert len(set(different)) == len(different) and all(len(i) == 32 for i in different)
    assert identity("span-a", clip_a) == identity("span-a", Grid((2, 2, 4), video=True, second_per_grid_t=1.0))


# -- the span budget sized from the served model (issue #47 item 4) ----------------------------


def published_processor(model_type: str):
    """The image processor of the family's published checkpoints, as their
    preprocessor_config.json says it (Qwen2.5-VL: patch 14 and ``max_pixels``; Qwen3-VL: patch 16
    and ``size.longest_edge``, as transformers 5 writes both)."""
    from types import SimpleNamespace

    from transformers import Qwen2VLImageProcessor

    if model_type == "qwen3_vl":
        image = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 65536, "longest_edge": 16777216})
    else:
        image = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                      min_pixels=3136, max_pixels=12845056)
    return SimpleNamespace(image_processor=image)


@pytest.mark.parametrize("model_type, hidden, deepstack, width", [
    ("qwen3_vl", 2048, 3, 2048 * 4),  # Qwen3-VL-2B: a span [n, 2048 x (1 + 3)]
    ("qwen2_5_vl", 2048, 0, 2048),  # Qwen2.5-VL-3B
])
def test_the_span_budget_holds_the_largest_image_the_processor_makes(monkeypatch, model_type, hidden, deepstack, width):
    """16384 rows for the largest image of either family's processor: at Qwen3-VL-2B's width that
    is 512 MiB as float32, over the 256 MiB default, so the budget grows to it, and such a span
    is read; SGLANG_EMBEDS_MAX_BYTES still sets it, and a refusal names that setting."""
    monkeypatch.delenv(wire.BUDGET_VAR, raising=False)
    vision = VisionSpec(model_type, IMAGE, VIDEO, START, END, 2, None, deepstack)
    rows = vision.largest_image_rows(published_processor(model_type))
    assert rows == 16384
    served = ModelSpec(hidden_size=hidden, dtype=torch.bfloat16, vocab_size=600, context_len=32768,
                       tokenizer=None, vision=vision, largest_image_rows=rows)
    largest = rows * width * 4
    assert served.max_span_bytes == max(wire.MAX_SPAN_BYTES, largest)
    shape = [rows, width]
    wire.declared_size("bfloat16", shape, served.max_span_bytes)  # read, not refused
    if largest > wire.MAX_SPAN_BYTES:
        with pytest.raises(wire.WireError, match=wire.BUDGET_VAR):
            wire.declared_size("bfloat16", shape, wire.MAX_SPAN_BYTES)
    monkeypatch.setenv(wire.BUDGET_VAR, str(1 << 20))
    assert served.max_span_bytes == 1 << 20
    with pytest.raises(wire.WireError, match=f"exceed the size limit of {1 << 20} bytes .*{wire.BUDGET_VAR}"):
        wire.declared_size("bfloat16", shape, served.max_span_bytes)


def test_a_processor_that_does_not_say_leaves_the_default_budget(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.delenv(wire.BUDGET_VAR, raising=False)
    vision = VisionSpec("qwen2_vl", IMAGE, VIDEO, START, END, 2, None, 0)
    assert vision.largest_image_rows(None) == vision.largest_image_rows(SimpleNamespace(image_processor=None)) == 0
    assert spec(0).max_span_bytes == wire.MAX_SPAN_BYTES
