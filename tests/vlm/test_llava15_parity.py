"""A split tiny LLaVA served as its LLM by a real SGLang server plus the client-side open_clip
vision half: greedy tokens of ``@sgl.function`` programs equal HF ``LlavaForConditionalGeneration``
on the same checkpoint (float32), for whole images, boxes, masks and two images in one prompt."""

from __future__ import annotations

import numpy as np
import sglang as sgl
from PIL import Image, ImageDraw

from llava_harness import MAX_TOKENS, ask, harness_fixtures
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds.vision import mask_image

vlm, _vlm_server_runs = harness_fixtures({"llama": "llava_llama", "qwen2": "llava_qwen"})


def _images() -> list[Image.Image]:
    """Three images of different sizes and aspect ratios, and clearly different content."""
    stripes = Image.new("RGB", (120, 48), (240, 240, 240))
    draw = ImageDraw.Draw(stripes)
    for x in range(0, 120, 24):
        draw.rectangle((x, 0, x + 11, 48), fill=(20, 120, 40))
    return [synthetic_scene(), Image.new("RGB", (40, 40), (200, 30, 30)), stripes]


def test_whole_images_match_hf_llava(vlm):
    text = vlm.text("what is the color of the object")
    references = [vlm.check(vlm.run(text, [image]), text, [image], f"image {i}") for i, image in enumerate(_images())]
    assert len({tuple(r) for r in references}) == len(references), f"the image must change the answer: {references}"


def test_box_region_matches_hf_llava_on_the_crop(vlm):
    scene, box = synthetic_scene(), (4, 4, 40, 36)
    text = vlm.text("describe this region")
    crop_tokens = vlm.check(vlm.run(text, [sgl.region(box, scene)]), text, [scene.crop(box)], "box")
    whole_tokens = ref.llava_greedy(vlm.checkpoint, text, [scene], MAX_TOKENS).tokens
    assert crop_tokens != whole_tokens, "the crop must change the answer"


def test_mask_region_matches_hf_llava_on_the_masked_crop(vlm):
    scene = synthetic_scene()
    mask = np.zeros((scene.height, scene.width), dtype=bool)
    yy, xx = np.mgrid[: scene.height, : scene.width]
    mask[(yy - 48) ** 2 + (xx - 70) ** 2 <= 14 ** 2] = True  # the blue disc
    expected = mask_image(scene, mask, vlm.encoder.mean_color)
    assert expected.size == (29, 29) and tuple(np.asarray(expected)[0, 0]) == vlm.encoder.mean_color
    text = vlm.text("what is the color of the object")
    masked = vlm.check(vlm.run(text, [sgl.region(mask, scene)]), text, [expected], "mask")
    boxed = ref.llava_greedy(vlm.checkpoint, text, [scene.crop((56, 34, 85, 63))], MAX_TOKENS).tokens
    assert masked != boxed, "masking the box's corners must change the answer"


def test_two_images_in_one_prompt_match_hf_llava(vlm):
    a, b, c = _images()
    text = vlm.text("which is brighter", images=2)
    first = vlm.check(vlm.run(text, [a, b]), text, [a, b], "two images")
    # HF's answer depends on the images' order, so ours equal to it shows our order is right
    swapped = ref.llava_greedy(vlm.checkpoint, text, [b, a], MAX_TOKENS).tokens
    assert first != swapped, "HF's answer must depend on the images' order"


def test_ten_questions_run_the_tower_once_and_hit_the_prefix_cache(vlm):
    scene = synthetic_scene()
    cache = vlm.backend.encoder_cache
    before = cache.stats()
    cached_tokens = []
    for q in ["what is it", "what color", "is it big", "where is the dog", "what is left", "is there sky",
              "how many", "what is on top", "describe it", "is it dark"]:
        state = ask.run(text=vlm.text(q), images=[scene], image_token=vlm.encoder.image_token, backend=vlm.backend)
        cached_tokens.append(state.get_meta_info("answer")["cached_tokens"])
    after = cache.stats()
    assert after["misses"] - before["misses"] <= 1 and after["hits"] - before["hits"] >= 9
    rows = vlm.encoder.rows_per_image
    assert all(c >= rows for c in cached_tokens[1:]), cached_tokens  # BOS + "USER: " + the image rows
