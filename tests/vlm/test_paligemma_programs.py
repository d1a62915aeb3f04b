"""programs/detect.py and programs/segment.py on the pool's tiny PaliGemma 1 and 2 servers
(``serve``, split): the answers, held to their regexes by SGLang's grammar backend, parse into boxes
inside the image and mask codes, and their tokens equal HF ``PaliGemmaForConditionalGeneration``'s
greedy tokens under the same constraint (``sgl_embeds_testing.constrained``: HF's ``generate``
held at each step to the tokens that keep the answer a prefix of a match, and to the end token
only after a full match). Then the first detected box asked about with ``sgl.region`` equals HF on the crop.

The tiny models are random: their labels and boxes mean nothing; what is checked is that the
same constrained decoding and the same region pixels give the same tokens.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import sglang as sgl
from PIL import Image

import helpers
import sgl_embeds
from programs.detect import detect, detect_prompt, detection_regex, parse_detections
from programs.segment import masks, parse_segmentations, segment, segment_prompt, segmentation_regex
from sgl_embeds.vlm.paligemma import prompt_text
from sgl_embeds.vlm.paligemma_masks import MaskDecoder
from sgl_embeds.vlm.prompt import image_prompt
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.constrained import paligemma_constrained
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.paligemma import mask_decoder_weights, tiny_paligemma_dir

SERVERS = {1: "paligemma", 2: "paligemma2"}
LABELS = ["cat", "dog"]
MAX_TOKENS = 64
ASK_TOKENS, MIN_COMPARED = 10, 8
# a question whose HF answer about the detected region is not one token repeated, per generation
QUESTIONS = {1: "caption en", 2: "answer en what is it"}


@functools.cache
def _backend(url: str):
    """``connect`` to a PaliGemma server laid out as published (no chat template: none is
    looked for), which warns of nothing."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        backend = sgl_embeds.connect(url)
    assert not seen, [f"{w.category.__name__}: {w.message}" for w in seen]
    return backend


def _images() -> list[Image.Image]:
    # a wide and a tall image: x and y scale back by different factors
    return [synthetic_scene(), helpers.random_image(40, 90, seed=5)]


def _run_program(backend, program, pattern: str, **arguments) -> dict:
    """The program's answer, checked equal to its compiled segments sent by ``EmbedsEndpoint.run``
    with the same regex, whose output (with ids) is returned."""
    state = program.run(backend=backend, **arguments)
    segments = sgl_embeds.compile_program(program, like=backend, **arguments)[0]
    out = backend.run(input_segments=segments, sampling_params={
        **helpers.GREEDY, "max_new_tokens": MAX_TOKENS, "regex": pattern})
    assert state["answer"] == out["text"], (state["answer"], out["text"])
    return out


def _check_like_hf(out: dict, generation: int, prompt: str, image, pattern: str, context: str):
    checkpoint = tiny_paligemma_dir(generation)
    model, _ = ref.hf_paligemma(str(checkpoint))
    theirs = lambda prefix=(): paligemma_constrained(checkpoint, prompt, image, pattern, MAX_TOKENS, prefix)
    forgiven = ref.check_greedy(out["output_ids"], theirs, context, eos_ids=ref.eos_ids(model))
    print(f"{context}{len(out['output_ids'])} constrained tokens equal HF's ({forgiven} near-tie(s) "
          f"forgiven): {out['text']!r}")


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_detect_parses_and_matches_hf_under_the_same_regex(servers, generation):
    backend = _backend(servers.get(SERVERS[generation])[0].url)
    bos = backend.vision_encoder.bos_token
    pattern = detection_regex(LABELS, max_objects=4)
    for i, image in enumerate(_images()):
        out = _run_program(backend, detect, pattern, image=image, labels=LABELS, bos_token=bos,
                           max_objects=4, max_tokens=MAX_TOKENS)
        detections = parse_detections(out["text"], image.width, image.height)
        assert detections and all(d.label in LABELS for d in detections), out["text"]
        for d in detections:
            x0, y0, x1, y1 = d.box
            assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 <= image.height, d
        _check_like_hf(out, generation, detect_prompt(LABELS), image, pattern,
                       f"PaliGemma {generation}, detect, image {i}: ")


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_segment_parses_and_matches_hf_under_the_same_regex(servers, generation):
    backend = _backend(servers.get(SERVERS[generation])[0].url)
    image = synthetic_scene()
    pattern = segmentation_regex(["cat"])
    out = _run_program(backend, segment, pattern, image=image, label="cat",
                       bos_token=backend.vision_encoder.bos_token, max_tokens=MAX_TOKENS)
    (cat,) = parse_segmentations(out["text"], image.width, image.height)
    assert cat.label == "cat" and len(cat.codes) == 16 and all(0 <= c < 128 for c in cat.codes)
    x0, y0, x1, y1 = cat.box
    assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 <= image.height, cat
    # its codes decoded (a decoder of vae-oid.npz's layout, random weights): a mask in its box only
    (mask,) = masks([cat], MaskDecoder(mask_decoder_weights(0)), image.width, image.height)
    assert mask.shape == (image.height, image.width) and mask[y0:y1, x0:x1].any()
    assert mask.sum() == mask[y0:y1, x0:x1].sum()
    _check_like_hf(out, generation, segment_prompt("cat"), image, pattern,
                   f"PaliGemma {generation}, segment: ")


@sgl.function
def ask(s, region, question: str, bos_token: str):
    s += image_prompt(prompt_text(question, bos_token), [region])
    s += sgl.gen("answer", max_tokens=ASK_TOKENS, temperature=0)


@pytest.mark.parametrize("generation", helpers.pooled([1, 2], SERVERS.get))
def test_a_detected_region_asked_about_matches_hf_on_its_crop(servers, generation):
    backend = _backend(servers.get(SERVERS[generation])[0].url)
    bos, image = backend.vision_encoder.bos_token, synthetic_scene()
    state = detect.run(image=image, labels=LABELS, bos_token=bos, backend=backend)
    box = parse_detections(state["answer"], image.width, image.height)[0].box
    question = QUESTIONS[generation]
    arguments = dict(region=sgl.region(box, image), question=question, bos_token=bos)
    answer = ask.run(backend=backend, **arguments)["answer"]
    segments = sgl_embeds.compile_program(ask, like=backend, **arguments)[0]
    out = backend.run(input_segments=segments, return_logprob=True, top_logprobs_num=ref.TOP_K,
                      sampling_params={**helpers.GREEDY, "max_new_tokens": ASK_TOKENS})
    assert answer == out["text"]
    checkpoint = tiny_paligemma_dir(generation)
    model, _ = ref.hf_paligemma(str(checkpoint))
    crop = image.crop(box)
    ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.paligemma_greedy(checkpoint, question, [crop], ASK_TOKENS, prefix),
        ref.eos_ids(model), f"PaliGemma {generation}, detected box {box}: ", MIN_COMPARED)
    whole = ref.paligemma_greedy(checkpoint, question, [image], ASK_TOKENS)
    assert whole.tokens != out["output_ids"][: len(whole.tokens)], "the region must change the answer"
