"""PaliGemma (Gemma LLM) and PaliGemma 2 (Gemma 2: soft-capping, sliding-window layers) served by
``python -m sgl_embeds serve`` as users launch it: split, the SigLIP tower and projector on the
client (``sgl_embeds.connect``), the LLM in SGLang attending each prompt as one bidirectional block.
Greedy tokens and logprobs equal HF ``PaliGemmaForConditionalGeneration`` (float32, eager) for
whole images, boxes and masks, with the block cut by 8-position prefill chunks (PaliGemma 1's
server) or whole (PaliGemma 2's), after a cached repeat, and in a batch; HF's own answer changes
when the prompt is attended causally, so a mask the server ignored would fail.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import sglang as sgl
from PIL import Image

import helpers
import sgl_embeds
from sgl_embeds.vision import mask_image
from sgl_embeds.vlm.prompt import image_prompt
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.paligemma import tiny_paligemma_dir

MAX_TOKENS, MIN_COMPARED = 10, 8
SERVERS = {1: "paligemma", 2: "paligemma2"}
# questions whose HF answer about the masked crop is not one token repeated, per generation
MASK_PROMPTS = {1: "detect object", 2: "answer en what is it"}


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


@sgl.function
def describe(s, prompt, images):
    s += image_prompt(prompt, images)
    s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)


def _ask(server, prompt: str, images: list) -> dict:
    """The answer of ``describe`` (as a program runs it), checked equal to the same segments sent
    by ``EmbedsEndpoint.run``, whose output (ids, logprobs, top-k maps) is returned."""
    backend = _backend(server.url)
    text = backend.vision_encoder.prompt_text(prompt, images=len(images))
    state = describe.run(prompt=text, images=images, backend=backend)
    segments = sgl_embeds.compile_program(describe, like=backend, prompt=text, images=images)[0]
    out = backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    assert state["answer"] == out["text"]
    return out


def _check(out: dict, generation: int, prompt: str, pixels: list, context: str) -> ref.Greedy:
    checkpoint = tiny_paligemma_dir(generation)
    model, _ = ref.hf_paligemma(str(checkpoint))
    reference = ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.paligemma_greedy(checkpoint, prompt, pixels, MAX_TOKENS, prefix),
        ref.eos_ids(model), context, MIN_COMPARED)
    causal = ref.paligemma_greedy(checkpoint, prompt, pixels, MAX_TOKENS, causal=True)
    assert causal.tokens != reference.tokens, f"{context}HF's answer must change when the prompt is causal"
    return reference


def _images() -> list[Image.Image]:
    return [synthetic_scene(), Image.new("RGB", (40, 40), (200, 30, 30)), helpers.random_image(50, 30, seed=3)]


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_whole_images_match_hf_paligemma(servers, generation):
    server = servers.get(SERVERS[generation])[0]
    answers = []
    for i, image in enumerate(_images()):
        out = _ask(server, "caption en", [image])
        answers.append(tuple(_check(out, generation, "caption en", [image], f"PaliGemma {generation}, image {i}: ").tokens))
    assert len(set(answers)) == len(answers), f"the image must change the answer: {answers}"


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_box_and_mask_regions_match_hf_on_their_crops(servers, generation):
    server = servers.get(SERVERS[generation])[0]
    scene, box = synthetic_scene(), (4, 4, 40, 36)
    out = _ask(server, "detect object", [sgl.region(box, scene)])
    _check(out, generation, "detect object", [scene.crop(box)], f"PaliGemma {generation}, box: ")
    mask = np.zeros((scene.height, scene.width), dtype=bool)
    yy, xx = np.mgrid[: scene.height, : scene.width]
    mask[(yy - 48) ** 2 + (xx - 70) ** 2 <= 14 ** 2] = True
    masked = mask_image(scene, mask, _backend(server.url).vision_encoder.mean_color)
    prompt = MASK_PROMPTS[generation]
    out = _ask(server, prompt, [sgl.region(mask, scene)])
    _check(out, generation, prompt, [masked], f"PaliGemma {generation}, mask: ")


def _send(server, prompt: str, image: Image.Image) -> dict:
    """One request of the segments of ``describe`` about ``image`` (once: its cache report is its own)."""
    backend = _backend(server.url)
    segments = sgl_embeds.compile_program(describe, like=backend, prompt=backend.vision_encoder.prompt_text(prompt),
                                          images=[image])[0]
    return backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                       sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})


@pytest.mark.pooled(SERVERS[2])
def test_a_cached_repeat_hits_and_stays_exact(servers):
    """A repeat hits all of the prompt but its last position (the cache key names the whole
    prompt); another question about the same image is another block and hits nothing."""
    server = servers.get(SERVERS[2])[0]
    image = helpers.random_image(64, 48, seed=11)  # not asked about elsewhere: nothing cached
    first = _send(server, "answer en what is it", image)
    assert first["meta_info"]["cached_tokens"] == 0
    repeat = _send(server, "answer en what is it", image)
    assert repeat["meta_info"]["cached_tokens"] == repeat["meta_info"]["prompt_tokens"] - 1
    assert repeat["output_ids"] == first["output_ids"]
    _check(repeat, 2, "answer en what is it", [image], "cached repeat: ")
    other = _send(server, "answer en what is this", image)
    assert other["meta_info"]["cached_tokens"] == 0, "another prompt is another block: nothing of it is cached"
    _check(other, 2, "answer en what is this", [image], "another question: ")


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_a_batch_of_prompts_matches_hf(servers, generation):
    server = servers.get(SERVERS[generation])[0]
    backend = _backend(server.url)
    images = _images()[:2]
    prompt = backend.vision_encoder.prompt_text("caption en")
    prompts = [sgl_embeds.compile_program(describe, like=backend, prompt=prompt, images=[image])[0] for image in images]
    outs = backend.run(input_segments=prompts, return_logprob=True, top_logprobs_num=ref.TOP_K,
                       sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    for i, (out, image) in enumerate(zip(outs, images)):
        _check(out, generation, "caption en", [image], f"PaliGemma {generation}, batch item {i}: ")
