"""Split tiny LLaVA-NeXT and LLaVA-OneVision checkpoints, each served as its LLM by a real SGLang
server, plus the client-side any-resolution vision half (``AnyresEncoder``): greedy tokens and
their logprobs equal HF's ``generate(pixel_values=..., image_sizes=...)`` on the same checkpoint
(float32), for images of several sizes and aspect ratios, two images in one prompt, a box and a
mask, through ``/generate`` segments and through ``@sgl.function`` programs with ``sgl.image`` /
``sgl.region`` via ``EmbedsEndpoint``."""

from __future__ import annotations

import numpy as np
import sglang as sgl
from PIL import Image

import helpers
from llava_harness import MAX_TOKENS, ask, harness_fixtures
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import scene_disc_mask, synthetic_scene
from sgl_embeds_testing.qwen_vl import sample_images
from sgl_embeds.vision import mask_image, region_image

vlm, _vlm_server_runs = harness_fixtures({"llava_next": "llava_next", "llava_onevision": "llava_onevision"})


def _images() -> dict[str, Image.Image]:
    """Sizes that pick different pinpoints, tile counts and unpadding (width x height)."""
    pictures = sample_images()
    return {"wide": pictures["stripes"],  # 120x48
            "tall": pictures["disc"],  # 64x96
            "square": pictures["square"],  # 56x56
            "tiny": helpers.random_image(9, 7),
            "above the largest pinpoint": synthetic_scene(400, 150)}


def test_images_of_several_sizes_through_generate_segments_match_hf(vlm):
    text = vlm.text("what is the color of the object")
    references = {name: vlm.check(vlm.generate(text, [image]), text, [image], f"/generate {name}")
                  for name, image in _images().items()}
    assert len({tuple(r) for r in references.values()}) == len(references), (
        f"the image must change the answer: {references}")


def test_a_program_with_sgl_image_matches_hf(vlm):
    text = vlm.text("what is the color of the object")
    for name in ("wide", "tall"):
        image = _images()[name]
        vlm.check(vlm.run(text, [image]), text, [image], f"program {name}")


def test_two_images_in_one_prompt_match_hf(vlm):
    """Each image tiled on its own, as HF's processor does for a flat list of images."""
    images = _images()
    tall, wide = images["tall"], images["wide"]
    text = vlm.text("which is brighter", images=2)
    first = vlm.check(vlm.run(text, [tall, wide]), text, [tall, wide], "two images, program")
    vlm.check(vlm.generate(text, [tall, wide]), text, [tall, wide], "two images, /generate")
    swapped = ref.llava_greedy(vlm.checkpoint, text, [wide, tall], MAX_TOKENS).tokens
    assert first != swapped, "the order of the images must change the answer"


def test_a_box_and_a_mask_match_hf_on_what_they_show(vlm):
    """``sgl.region(box)``: HF on the crop; ``sgl.region(mask)``: HF on the mask's bounding box
    with the outside in the processor's mean colour. Each tiled as a whole image of its size."""
    scene, box, mask = synthetic_scene(), (4, 4, 40, 36), scene_disc_mask()
    shown = {"box": scene.crop(box), "mask": mask_image(scene, mask, vlm.encoder.mean_color)}
    assert region_image(scene, mask, vlm.encoder).tobytes() == shown["mask"].tobytes()
    assert tuple(np.asarray(shown["mask"])[0, 0]) == vlm.encoder.mean_color
    text = vlm.text("describe this region")
    answers = {name: vlm.check(vlm.run(text, [sgl.region(region, scene)]), text, [shown[name]], name)
               for name, region in (("box", box), ("mask", mask))}
    others = {"the whole image": [scene], "the mask's box": [scene.crop((56, 34, 85, 63))]}
    for name, images in others.items():
        assert ref.llava_greedy(vlm.checkpoint, text, images, MAX_TOKENS).tokens not in answers.values(), name


def test_a_repeated_image_is_encoded_once_and_its_rows_hit_the_prefix_cache(vlm):
    """Three questions about an image: one tower run (the encoder cache), and the server's
    prefix cache holds the text before the image and all of the image's rows."""
    image = _images()["above the largest pinpoint"]
    stats = vlm.backend.encoder_cache.stats()
    cached = []
    for question in ("what is it", "is it dark", "describe it"):
        state = ask.run(text=vlm.text(question), images=[image], image_token=vlm.encoder.image_token,
                        backend=vlm.backend)
        cached.append(state.get_meta_info("answer")["cached_tokens"])
    now = vlm.backend.encoder_cache.stats()
    assert now["misses"] - stats["misses"] <= 1 and now["hits"] - stats["hits"] >= 2
    before_image = vlm.text("x").split(vlm.encoder.image_token)[0]
    prefix = len(ref.hf_tokenizer(str(vlm.split_dir / "llm")).encode(before_image))
    rows = vlm.encoder.rows_for(*image.size)
    assert all(c >= prefix + rows for c in cached[1:]), (cached, prefix, rows)
