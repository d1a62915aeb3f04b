"""Image spans on the other Qwen-VL families SGLang serves natively: Qwen3-VL (deepstack,
interleaved M-RoPE, patch 16) and Qwen2-VL. As for Qwen2.5-VL (``test_qwen_vl_spans.py``): the
client computes an image's rows with HF's own vision module (``load_encoder``), sends them between
the vision tokens, and the server's greedy tokens and logprobs equal HF's own class on the pixels
(float32); the server's vision weights are NaN, so an exact answer proves the tower never ran, and
its small prefill chunk cuts every image. A Qwen3-VL span carries its deepstack rows after its
main rows along the width ([n, 64 x 4]): the same rows without them are a 400 that names the
width, and with them zeroed the answer is not HF's."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import helpers
from sgl_embeds_testing import reference as ref
from qwen_vl_harness import (BOX, MAX_TOKENS, ask, assert_matches_hf, assert_regions_match_hf, chat_text, grid_span,
                             span_segments)
from sgl_embeds_testing.qwen_vl import (
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    image_rows,
    png_base64,
    qwen_vl_greedy,
    qwen_vl_inputs,
    sample_images,
    tiny_qwen2_vl_dir,
    tiny_qwen3_vl_dir,
)
from sgl_embeds_protocol import wire

pytestmark = pytest.mark.server
CHECKPOINTS = {"qwen3_vl_spans": tiny_qwen3_vl_dir, "qwen2_vl_spans": tiny_qwen2_vl_dir}


@pytest.fixture(scope="module", params=helpers.pooled(CHECKPOINTS))
def family(request):
    """(checkpoint, server name) of one family."""
    return CHECKPOINTS[request.param](), request.param


@pytest.fixture
def served(family, servers):
    """(checkpoint, its running server)."""
    checkpoint, name = family
    return checkpoint, servers.get(name)[0]


def test_one_image_span_equals_hf_on_the_pixels_at_several_sizes(served):
    checkpoint, server = served
    text = chat_text(checkpoint, "what is the color of the object", 1)
    references = {}
    for name, image in list(sample_images().items())[:3]:
        out = ask(server, span_segments(text, [grid_span(checkpoint, image)]))
        references[name] = assert_matches_hf(out, checkpoint, text, [image], name)
        assert out["meta_info"]["prompt_tokens"] == len(qwen_vl_inputs(checkpoint, text, [image])["input_ids"][0])
    assert len({tuple(r) for r in references.values()}) == len(references), f"images must change HF: {references}"


def test_two_images_each_its_own_item_and_their_order_matters(served):
    checkpoint, server = served
    text = chat_text(checkpoint, "compare them", 2)
    first, second = sample_images()["stripes"], sample_images()["checks"]  # one grid: only their rows differ
    spans = [grid_span(checkpoint, first), grid_span(checkpoint, second)]
    forward = assert_matches_hf(ask(server, span_segments(text, spans)), checkpoint, text, [first, second], "forward")
    swapped = assert_matches_hf(ask(server, span_segments(text, spans[::-1])), checkpoint, text, [second, first],
                                "swapped")
    assert forward != swapped, "HF's answer must depend on the images' order"


def test_a_repeat_is_cached_and_another_grid_is_not(served):
    checkpoint, server = served
    text = chat_text(checkpoint, "describe it in a few words", 1)
    span = grid_span(checkpoint, sample_images()["stripes"])  # grid 1x4x8
    first, again = ask(server, span_segments(text, [span])), ask(server, span_segments(text, [span]))
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    other = ask(server, span_segments(text, [{**span, "image_grid_thw": [1, 8, 4]}]))
    text_before = len(qwen_vl_inputs(checkpoint, text.split(IMAGE_PLACEHOLDER)[0] + VISION_START, [])["input_ids"][0])
    assert other["meta_info"]["cached_tokens"] <= text_before, "another grid must not reuse the rows' KV"
    numbers = [[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in (first, other)]
    moved = max(abs(a - b) for a, b in zip(*numbers))
    assert other["output_ids"] != first["output_ids"] or moved > 100 * ref.LOGPROB_TOL, (
        "the grid must change the positions, so the answer's numbers")


def test_a_program_with_the_client_vision_half_sees_the_image_a_box_and_a_mask(served):
    """``load_encoder(DIR)`` gives this family's vision half: ``sgl.image`` and ``sgl.region``
    (a box, a ring-shaped mask) between the vision tokens answer as HF does on the image, the
    crop and the masked crop."""
    image = sample_images()["disc"]
    mask = np.zeros((image.height, image.width), dtype=bool)
    mask[20:70, 10:50] = True
    mask[30:60, 20:40] = False  # a ring: not a box
    assert_regions_match_hf(*served, {"image": None, "box": BOX, "mask": mask})


@pytest.mark.parametrize("change, message", [
    (lambda s: {**s, "image_grid_thw": [2, 4, 4]}, "t > 1 is a clip"),
    (lambda s: {**s, "image_grid_thw": [1, 4, 4]}, "makes t*h*w/merge**2 = 4 rows"),
])
def test_a_bad_grid_is_a_400_that_says_which(served, change, message):
    checkpoint, server = served
    text = chat_text(checkpoint, "what is it", 1)
    span = change(grid_span(checkpoint, sample_images()["stripes"]))  # 8 rows
    res = server.generate(helpers.body(span_segments(text, [span]), MAX_TOKENS))
    assert res.status_code == 400 and message in res.json()["message"], res.text


def test_vision_tokens_outside_a_span_and_a_span_left_open_are_400s(served):
    """SGLang's rope index counts image pad ids written as text as another image (an IndexError,
    a 500, on stock's path): refused before it; so is a span not closed by the vision-end token.
    The server answers a good request after both."""
    checkpoint, server = served
    text = chat_text(checkpoint, "what is it", 1)
    span = grid_span(checkpoint, sample_images()["stripes"])
    extra_pad = span_segments(text, [span])  # beside the span, the literal vision tokens of another image
    extra_pad[-1] = helpers.text(extra_pad[-1]["text"].replace("what is it", f"{VISION_START}{IMAGE_PAD}{VISION_END} what is it"))
    res = server.generate(helpers.body(extra_pad, MAX_TOKENS))
    assert res.status_code == 400 and "image pad token" in res.json()["message"], res.text
    open_span = span_segments(text, [span])
    open_span[-1] = helpers.text(open_span[-1]["text"].removeprefix(VISION_END))
    res = server.generate(helpers.body(open_span, MAX_TOKENS))
    assert res.status_code == 400 and "followed by the vision-end token" in res.json()["message"], res.text
    good = ask(server, span_segments(text, [span]))
    assert_matches_hf(good, checkpoint, text, [sample_images()["stripes"]], "after the refusals")


@pytest.mark.pooled("qwen3_vl_spans")
def test_qwen3_vl_without_its_deepstack_rows_is_a_400_and_each_zeroed_layer_changes_the_answer(servers):
    """Without its deepstack rows a Qwen3-VL span is another model's: a 400 that names the width
    ([n, 64 x (1 + 3)] = [n, 256]); with any one of its three deepstack layers zeroed, the
    answer's numbers are not HF's (each layer reaches the LLM)."""
    checkpoint, server = tiny_qwen3_vl_dir(), servers.get("qwen3_vl_spans")[0]
    text = chat_text(checkpoint, "what is the color of the object", 1)
    image = sample_images()["stripes"]
    rows, grid = image_rows(checkpoint, image)
    assert rows.shape[1] == 256
    main_only = {**helpers.span(rows[:, :64]), "image_grid_thw": list(grid)}
    res = server.generate(helpers.body(span_segments(text, [main_only]), MAX_TOKENS))
    message = res.json().get("message", "")
    assert res.status_code == 400 and "[n, 64 x (1 + 3)] = [n, 256]" in message and "deepstack" in message, res.text
    reference = qwen_vl_greedy(checkpoint, text, [image], MAX_TOKENS)
    for layer in (1, 2, 3):
        zeroed = rows.clone()
        zeroed[:, 64 * layer:64 * (layer + 1)] = 0
        out = ask(server, span_segments(text, [{**helpers.span(zeroed), "image_grid_thw": list(grid)}]))
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        worst = max(abs(a - b) for a, b in zip(ours, reference.logprobs))
        assert out["output_ids"] != reference.tokens or worst > 100 * 1e-4, f"zeroed deepstack layer {layer}"


def test_qwen3_vl_raw_images_and_spans_on_one_server_both_equal_hf(qwen3_vl_server):
    """Stock's raw images still work on a server that takes spans (its tower runs on them, not on
    ours): both kinds sent together equal HF, and the span's rows without their deepstack rows
    are a 400 naming the width, after which the server still answers both."""
    checkpoint = tiny_qwen3_vl_dir()
    text = chat_text(checkpoint, "what is the color of the object", 1)
    pictures = sample_images()
    raw = {"text": text, "image_data": png_base64(pictures["disc"]), "return_logprob": True,
           "sampling_params": {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}}
    span = grid_span(checkpoint, pictures["stripes"])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda b: helpers.generate(qwen3_vl_server, b),
                             [raw, helpers.body(span_segments(text, [span]), MAX_TOKENS, return_logprob=True)] * 2))
    assert_matches_hf(outs[0], checkpoint, text, [pictures["disc"]], "raw image")
    assert_matches_hf(outs[1], checkpoint, text, [pictures["stripes"]], "image span")
    assert outs[2]["output_ids"] == outs[0]["output_ids"] and outs[3]["output_ids"] == outs[1]["output_ids"]
    rows = wire.decode_tensor(span["embeds"])
    main_rows = {**span, **helpers.span(rows[:, :64])}  # the image's rows alone
    res = qwen3_vl_server.generate(helpers.body(span_segments(text, [main_rows]), MAX_TOKENS))
    assert res.status_code == 400 and "[n, 64 x (1 + 3)] = [n, 256]" in res.json()["message"], res.text
    again = helpers.generate(qwen3_vl_server, raw)
    assert again["output_ids"] == outs[0]["output_ids"]
