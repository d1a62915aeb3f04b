"""The VLM workloads' turn planning (``benchmarks/workload.py``): the same seed gives the same turns,
exactly the share of turns asked for reuse an item seen before, and items are whole images, boxes
and masks of the pool's images; issue #49's agent chat and shared-image Q&A plans; a system
prompt; and the ``input_embeds`` client's rows."""

from __future__ import annotations

import numpy as np

from workload import INPUT_EMBEDS, ArmClient, chat_pieces, plan_agent_chat, plan_shared_qa, plan_turns, region_of


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


def test_an_agent_chat_is_one_user_with_a_new_image_each_turn():
    plan = plan_agent_chat(16, seed=7)
    assert plan == plan_agent_chat(16, seed=7)
    assert [(t.user, t.index) for t in plan] == [(0, i) for i in range(16)]
    assert len({t.item for t in plan}) == 16 and all(t.item.region is None and not t.reuse for t in plan)


def test_shared_qa_draws_a_pools_images_by_a_zipf_law():
    plan = plan_shared_qa(2000, pool=128, seed=3)
    assert plan == plan_shared_qa(2000, pool=128, seed=3) and plan != plan_shared_qa(2000, pool=128, seed=4)
    assert [(t.user, t.index) for t in plan] == [(k, 0) for k in range(2000)]
    ranks = np.bincount([t.item.image - 3 * 100_000 for t in plan], minlength=128)
    assert len(ranks) == 128 and all(t.item.region is None for t in plan)
    # rank k is drawn in proportion to 1 / k: the first ten ranks about half of all requests
    weights = 1.0 / np.arange(1, 129)
    assert abs(ranks[:10].sum() / 2000 - weights[:10].sum() / weights.sum()) < 0.04
    assert ranks[0] > 1.5 * ranks[1] and ranks[0] > 5 * ranks[20:].mean()
    seen = set()
    for t in plan:
        assert t.reuse == (t.item in seen)
        seen.add(t.item)


def test_a_system_prompt_opens_the_chat():
    (turn,) = plan_shared_qa(1, pool=4, seed=1)
    pieces = chat_pieces([], turn, system="be brief")
    assert pieces[0].startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")
    assert pieces[1] == turn.item


def test_the_input_embeds_client_sends_the_prompts_rows_as_the_server_counts_them(qwen_vl_dir):
    """``INPUT_EMBEDS``' body: one row a token and an image's rows where its pads would be; the
    text rows are the embedding table's, the image rows the client's tower's."""
    from transformers import AutoTokenizer

    from common import embedding_table
    from sgl_embeds.vlm import QwenVLEncoder

    encoder, tokenizer = QwenVLEncoder(qwen_vl_dir, device="cpu"), AutoTokenizer.from_pretrained(qwen_vl_dir)
    table = embedding_table(qwen_vl_dir)
    client = ArmClient(INPUT_EMBEDS, "http://127.0.0.1:9", encoder, tokenizer, 224, embed_tokens=table)
    plan = plan_turns(1, 2, 0.0, seed=2, image_side=224)
    client.prepare(plan)
    pieces = chat_pieces([(plan[0], "an answer")], plan[1])
    body, _ = client.body(pieces)
    rows = np.asarray(body["input_embeds"], dtype=np.float32)
    assert rows.shape == (len(client.atoms(pieces)), table.shape[1])
    first_text = tokenizer.encode(pieces[0], add_special_tokens=False)
    np.testing.assert_array_equal(rows[:len(first_text)], table[first_text].numpy())
    image = client.encode(plan[0].item).rows
    np.testing.assert_array_equal(rows[len(first_text):len(first_text) + len(image)], image.numpy())
    assert client.tower_passes == 2  # each of the two images once, its repeat from the cache
