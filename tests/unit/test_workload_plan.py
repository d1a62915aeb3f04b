"""The VLM chat workload's turn planning (``testing.workload.plan_turns``): the same seed gives the
same turns, exactly the share of turns asked for reuse an item seen before, and items are whole
images, boxes and masks of the pool's images."""

from __future__ import annotations

import numpy as np

from workload import chat_pieces, plan_turns, region_of


def test_a_seed_gives_one_plan():
    plan = plan_turns(4, 5, 0.5, seed=3, image_side=448)
    assert plan == plan_turns(4, 5, 0.5, seed=3, image_side=448)
    assert plan != plan_turns(4, 5, 0.5, seed=4, image_side=448)
    assert [(t.user, t.index) for t in plan] == [(u, i) for i in range(5) for u in range(4)]


def test_reuse_is_the_share_asked_and_means_seen_before():
    for reuse in (0.0, 0.5, 0.8):
        plan = plan_turns(8, 5, reuse, seed=1, image_side=448)
        assert sum(t.reuse for t in plan) == round(reuse * 40)
        seen = set()
        for t in plan:
            assert t.reuse == (t.item in seen)
            seen.add(t.item)
        assert not plan[0].reuse


def test_items_are_images_boxes_and_masks_inside_the_image():
    plan = plan_turns(8, 8, 0.5, seed=2, image_side=448)
    kinds = {t.item.region[0] if t.item.region else "image" for t in plan}
    assert kinds == {"image", "box", "mask"}
    for t in plan:
        region = region_of(t.item, 448)
        if isinstance(region, np.ndarray):
            assert region.shape == (448, 448) and region.any()
        elif region is not None:
            x0, y0, x1, y1 = region
            assert 0 <= x0 < x1 <= 448 and 0 <= y0 < y1 <= 448


def test_a_chat_holds_every_earlier_turn_and_its_answer():
    plan = plan_turns(1, 3, 0.0, seed=5, image_side=448)
    pieces = chat_pieces([(plan[0], "a"), (plan[1], "b")], plan[2])
    assert [p for p in pieces if not isinstance(p, str)] == [t.item for t in plan]
    assert "a<|im_end|>" in pieces[2] and pieces[-1].endswith("<|im_start|>assistant\n")
