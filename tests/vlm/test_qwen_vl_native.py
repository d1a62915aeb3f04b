"""Qwen2.5-VL served natively by SGLang with our plugin loaded (issue #22): raw images in
``image_data`` on ``/generate`` give the greedy tokens of HF ``Qwen2_5_VLForConditionalGeneration``
on the same tiny random checkpoint (float32), a repeated image request hits the prefix cache, and
the plugin's own ``input_segments`` work on the same server."""

from __future__ import annotations


import pytest
from PIL import Image
from transformers import AutoImageProcessor

import helpers
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.qwen_vl import (
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    MAX_IMAGE_TOKENS,
    MIN_IMAGE_TOKENS,
    VISION_SPECIALS,
    hf_qwen_vl,
    qwen_vl_greedy,
    png_base64,
    qwen_vl_inputs,
    sample_images,
)

MAX_TOKENS = 10
MIN_COMPARED = 8
SAMPLING = {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}


def _prompt(checkpoint, question: str) -> str:
    """The chat-template prompt of one image and a question, with the unexpanded placeholder."""
    _, processor = hf_qwen_vl(str(checkpoint))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE_PLACEHOLDER) == 1, text
    return text


@pytest.fixture(scope="module")
def checkpoint(qwen_vl_dir):
    return qwen_vl_dir


def _generate(server, text: str, image: Image.Image) -> dict:
    body = {"text": text, "image_data": png_base64(image), "sampling_params": SAMPLING}
    return helpers.generate(server, body)


def test_checkpoint_round_trips_through_hf(checkpoint):
    """The saved directory loads back with matching ids, and the processor expands the pad to
    t*h*w/merge**2 tokens for images of different shapes."""
    model, processor = hf_qwen_vl(str(checkpoint))
    config, tok = model.config, processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in VISION_SPECIALS] == [
        config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id]
    assert processor.image_token_id == config.image_token_id == tok.convert_tokens_to_ids(IMAGE_PAD)
    merge = processor.image_processor.merge_size
    assert merge == config.vision_config.spatial_merge_size == 2
    alone = AutoImageProcessor.from_pretrained(checkpoint)  # preprocessor_config.json on its own
    assert (alone.size, alone.merge_size) == (processor.image_processor.size, merge)
    text = _prompt(checkpoint, "what is it")
    grids = []
    for name, image in list(sample_images().items())[:3]:  # checks shares the stripes grid
        inputs = qwen_vl_inputs(checkpoint, text, [image])
        (t, h, w), = inputs["image_grid_thw"].tolist()
        pads = int((inputs["input_ids"] == config.image_token_id).sum())
        assert pads == t * h * w // merge**2, f"{name}: {pads} pads for grid {(t, h, w)}"
        assert MIN_IMAGE_TOKENS <= pads <= MAX_IMAGE_TOKENS, f"{name}: {pads} image tokens"
        assert inputs["pixel_values"].shape[0] == t * h * w
        grids.append((t, h, w))
    assert len(set(grids)) == len(grids), f"the images must give different grids: {grids}"


@pytest.mark.server
def test_raw_images_match_hf(qwen_vl_server, checkpoint):
    text = _prompt(checkpoint, "what is the color of the object")
    references = []
    for name, image in list(sample_images().items())[:2]:
        ours = _generate(qwen_vl_server, text, image)["output_ids"]
        reference = qwen_vl_greedy(checkpoint, text, [image], MAX_TOKENS)
        ref.assert_not_degenerate(reference.tokens, f"{name}: ")
        forgiven = ref.check_greedy(
            ours, lambda prefix: qwen_vl_greedy(checkpoint, text, [image], MAX_TOKENS, prefix), f"{name}: ")
        assert len(ours) >= MIN_COMPARED, f"{name}: only {len(ours)} tokens compared"
        print(f"{name}: compared {len(ours)} tokens with HF Qwen2.5-VL, {forgiven} near-tie(s) forgiven")
        references.append(reference.tokens)
    assert references[0] != references[1], f"the image must change HF's answer: {references}"


@pytest.mark.server
def test_repeated_image_request_hits_the_prefix_cache(qwen_vl_server, checkpoint):
    """The same image and text again: all of the prompt but its last token comes from the cache,
    and the answer is the same. Then an image of the same size (so the same pad run) that this
    server has not seen: no hit past the pad run's start."""
    stripes = sample_images()["stripes"]
    text = _prompt(checkpoint, "describe briefly")
    first = _generate(qwen_vl_server, text, stripes)
    second = _generate(qwen_vl_server, text, stripes)
    prompt_tokens = second["meta_info"]["prompt_tokens"]
    print(f"repeat: cached {second['meta_info']['cached_tokens']} of {prompt_tokens} prompt tokens")
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] == prompt_tokens - 1
    unseen = Image.new("RGB", stripes.size, (200, 30, 30))
    other = _generate(qwen_vl_server, text, unseen)
    ids = qwen_vl_inputs(checkpoint, text, [unseen])["input_ids"][0].tolist()
    first_pad = ids.index(hf_qwen_vl(str(checkpoint))[0].config.image_token_id)
    assert other["meta_info"]["prompt_tokens"] == len(ids) == prompt_tokens
    assert other["meta_info"]["cached_tokens"] <= first_pad, "another image must not hit the first one's rows"


@pytest.mark.server
def test_the_plugin_serves_segments_on_the_vlm_server(qwen_vl_server):
    """The plugin is loaded: a text-only ``input_segments`` prompt answers as the same ``text``."""
    question = "what is the color of the object"
    ours = helpers.generate(qwen_vl_server, helpers.body([helpers.text(question)], MAX_TOKENS))
    stock = helpers.generate(qwen_vl_server, {"text": question, "sampling_params": SAMPLING})
    assert ours["output_ids"] == stock["output_ids"]
    assert ours["meta_info"]["prompt_tokens"] == stock["meta_info"]["prompt_tokens"]
