"""Florence-2 served by ``python -m sgl_embeds serve`` as users launch it: the checkpoint whole, its
BART encoder reading the image's rows (the client's DaViT tower and projector, ``sgl_embeds.connect``)
and the task prompt, the decoder generating with cross-attention on SGLang's encoder-decoder path.

Greedy tokens and logprobs equal HF ``Florence2ForConditionalGeneration`` (float32) for two tasks on
two images, for a batch of different images, and for a cached repeat, whose encoder region is one
prefix-cache hit; 16-position prefill chunks never cut the encoder region (30 to 42 positions).
HF's own answer changes with the image, with the task, and when the encoder attends causally, so a
server that ignored any of them would fail. Bad input is refused with the reason, and the server
keeps serving.
"""

from __future__ import annotations

import functools

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import helpers
import sgl_embeds
from sgl_embeds.vlm.florence2 import Florence2Encoder
from sgl_embeds_protocol import binary_body, wire
from sgl_embeds_protocol.family import ENCODER_DECODER
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.florence2 import ROWS_PER_IMAGE, tiny_florence2_dir
from strategies import prompts

MAX_TOKENS, MIN_COMPARED = 10, 8
TASKS = ("<OD>", "<CAPTION>")
SERVER = "florence2"
pytestmark = pytest.mark.pooled(SERVER)


@functools.cache
def _backend(url: str):
    return sgl_embeds.connect(url)


def _images() -> list[Image.Image]:
    return [synthetic_scene(), helpers.random_image(140, 100, seed=5)]


def _segments(backend, task: str, image: Image.Image, text_input: str | None = None):
    encoder = backend.vision_encoder
    return encoder.prompt_segments(encoder(image), task, text_input)


def _ask(backend, prompts: list, **fields) -> list[dict]:
    try:
        out = backend.run(input_segments=prompts, return_logprob=True, top_logprobs_num=ref.TOP_K,
                          sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}, **fields)
    except OSError as e:  # a scheduler that died (an encoder region cut by a chunk trips SGLang's assert)
        pytest.fail(f"the server dropped the request: {e!r}")
    return out if isinstance(out, list) else [out]


def _check(out: dict, task: str, image: Image.Image, context: str) -> ref.Greedy:
    checkpoint = tiny_florence2_dir()
    model, _ = ref.hf_florence2(str(checkpoint))
    return ref.assert_vlm_matches_hf(
        out, lambda prefix=(): ref.florence2_greedy(checkpoint, task, image, MAX_TOKENS, prefix),
        ref.eos_ids(model), context, MIN_COMPARED)


@pytest.fixture(scope="module")
def florence2(servers):
    return servers.get(SERVER)[0]


def test_the_vision_half_equals_hf_and_connect_loads_it(florence2):
    checkpoint = tiny_florence2_dir()
    model, processor = ref.hf_florence2(str(checkpoint))
    encoder = Florence2Encoder(checkpoint)
    for image in _images():
        pixels = processor(images=image, text="<OD>", return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            theirs = model.model.get_image_features(pixels).pooler_output[0]
        ref.assert_same_rows(encoder(image), theirs, "the tower and projector, as HF runs them: ")
    assert encoder(_images()[0]).shape == (ROWS_PER_IMAGE, 64)
    served = _backend(florence2.url).server_info.model
    assert (served.family, served.served_as) == ("florence2", ENCODER_DECODER)
    assert isinstance(_backend(florence2.url).vision_encoder, Florence2Encoder)


def test_two_tasks_on_two_images_match_hf_florence2(florence2):
    backend, answers = _backend(florence2.url), {}
    for task in TASKS:
        for i, image in enumerate(_images()):
            (out,) = _ask(backend, _segments(backend, task, image))
            context = f"{task} on image {i}: "
            answers[task, i] = tuple(_check(out, task, image, context).tokens)
            causal = ref.florence2_greedy(tiny_florence2_dir(), task, image, MAX_TOKENS, causal=True)
            assert causal.tokens != list(answers[task, i]), f"{context}HF's answer must change when the encoder is causal"
    assert len(set(answers.values())) == len(answers), f"the image and the task must change the answer: {answers}"


def test_a_batch_of_different_images_matches_hf(florence2):
    backend, images = _backend(florence2.url), _images()
    outs = _ask(backend, [_segments(backend, "<OD>", image) for image in images])
    assert len(outs) == len(images)
    for i, (out, image) in enumerate(zip(outs, images)):
        _check(out, "<OD>", image, f"batch, image {i}: ")


def test_a_repeat_hits_the_whole_encoder_region_and_another_task_none_of_it(florence2):
    backend, image = _backend(florence2.url), helpers.random_image(90, 120, seed=11)
    segments = _segments(backend, "<CAPTION>", image)
    (first,) = _ask(backend, segments)
    (again,) = _ask(backend, segments)
    encoder_len = first["meta_info"]["prompt_tokens"] - 2  # the decoder's start and forced first token
    assert encoder_len > 16, "the encoder region must be longer than a prefill chunk"
    # everything but the last decoder token is cached: the encoder's cross keys and values with it
    assert again["meta_info"]["cached_tokens"] == encoder_len + 1, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]
    _check(again, "<CAPTION>", image, "cached repeat: ")
    (other,) = _ask(backend, _segments(backend, "<OD>", image))
    assert other["meta_info"]["cached_tokens"] == 0, "the same image under another task is another encoder input"
    _check(other, "<OD>", image, "same image, another task: ")


def test_a_region_task_reads_the_box_as_loc_tokens(florence2):
    backend, image = _backend(florence2.url), synthetic_scene()
    encoder = backend.vision_encoder
    region = encoder.region_input((8, 8, 40, 30), *image.size)
    assert region.count("<loc_") == 4
    (out,) = _ask(backend, _segments(backend, "<REGION_TO_DESCRIPTION>", image, region))
    checkpoint = tiny_florence2_dir()
    task = "<REGION_TO_DESCRIPTION>" + region
    model, _ = ref.hf_florence2(str(checkpoint))
    ref.assert_vlm_matches_hf(out, lambda prefix=(): ref.florence2_greedy(checkpoint, task, image, MAX_TOKENS, prefix),
                              ref.eos_ids(model), "region: ", MIN_COMPARED)
    parsed = encoder.parse_answer("</s><s>a dog" + region + "</s>", "<OD>", image.size)
    assert parsed["<OD>"]["labels"] == ["a dog"] and len(parsed["<OD>"]["bboxes"]) == 1


def test_bad_input_is_refused_with_the_reason_and_the_server_keeps_serving(florence2):
    backend = _backend(florence2.url)
    rows = backend.vision_encoder(_images()[1])
    cases = {
        "text alone": (helpers.body([helpers.text("<s>What does the image describe?</s>")]), "reads an image"),
        "raw image": ({"text": "<OD>", "image_data": "data:image/png;base64,AAAA",
                       "sampling_params": {"max_new_tokens": 2}}, "vision tower on the client"),
        "wrong width": (helpers.body([helpers.span(rows[:, :32]), helpers.text("<s>x</s>")]), "hidden size"),
        "longer than the encoder": (helpers.body([helpers.span(rows.repeat(16, 1)), helpers.text("<s>x</s>")]),
                                    "positions"),
    }
    for name, (payload, reason) in cases.items():
        r = requests.post(florence2.url + "/generate", json=payload, timeout=60)
        assert r.status_code == 400, f"{name}: {r.status_code} {r.text[:300]}"
        assert reason in helpers.error_message(r), f"{name}: {helpers.error_message(r)}"
    (out,) = _ask(backend, _segments(backend, "<OD>", _images()[1]))
    _check(out, "<OD>", _images()[1], "after the refusals: ")


@pytest.mark.parametrize("task", ["<OD>", "<OCR_WITH_REGION>", "<REGION_TO_DESCRIPTION>", "<CAPTION_TO_PHRASE_GROUNDING>"])
def test_the_task_programs_answer_as_hf_and_parse_as_its_processor(florence2, task):
    """programs/florence2.py: each task's answer equals HF's greedy answer, and its parse equals
    HF's processor's post-processing of HF's own decoded answer (boxes in the image's pixels)."""
    from programs import florence2 as tasks

    backend, image = _backend(florence2.url), synthetic_scene()
    text_input = {"<REGION_TO_DESCRIPTION>": backend.vision_encoder.region_input((8, 8, 40, 30), *image.size),
                  "<CAPTION_TO_PHRASE_GROUNDING>": "a red square"}.get(task)
    answer = tasks.run_task(backend, image, task, text_input, max_tokens=MAX_TOKENS, return_logprob=True,
                            top_logprobs_num=ref.TOP_K)
    checkpoint = tiny_florence2_dir()
    model, processor = ref.hf_florence2(str(checkpoint))
    prompt = task + (text_input or "")
    hf = ref.florence2_greedy(checkpoint, prompt, image, MAX_TOKENS)
    assert answer.ids == hf.tokens, f"{task}: ours {answer.ids}, HF {hf.tokens}"
    hf_text = processor.tokenizer.decode(hf.tokens, skip_special_tokens=False)
    assert answer.text == hf_text
    assert answer.parsed == processor.post_process_generation(text=hf_text, task=task, image_size=image.size)



def test_an_answer_with_boxes_parses_into_the_images_pixels():
    """The random model's answers seldom hold four <loc_N> in a row, so the parse into pixels is
    checked on written answers: each box's bins dequantized as the checkpoint's processor does."""
    from sgl_embeds.vlm.florence2 import Florence2Encoder

    encoder, size = Florence2Encoder(tiny_florence2_dir()), (200, 100)
    region = encoder.region_input((20, 10, 120, 90), *size)
    assert region == "<loc_100><loc_100><loc_600><loc_900>"
    parsed = encoder.parse_answer(f"</s><s>dog{region}cat<loc_0><loc_0><loc_999><loc_999></s>", "<OD>", size)
    assert parsed["<OD>"]["labels"] == ["dog", "cat"]
    (dog, cat) = parsed["<OD>"]["bboxes"]
    # a bin stands for its centre, (N + 0.5) / 1000 of the side, floored to a pixel
    assert dog == [20, 10, 120, 90] and cat == [0, 0, 199, 99], parsed


def test_sglangs_health_checks_answer(florence2):
    """SGLang's /health and /health_generate ask for one token after ``[0]``, no image: that id
    is the encoder's prompt here (a gateway polls them; a refusal would mark the server down)."""
    for route in ("/health", "/health_generate"):
        r = requests.get(florence2.url + route, timeout=60)
        assert r.status_code == 200, f"{route}: {r.status_code} {r.text[:300]}"


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_prompts_never_cause_a_server_error(florence2, data):
    """The shared fuzzer's prompts (``strategies.prompts``: text, ids, spans, held spans, blocks,
    grids, in any order) on /generate and /v1/completions: a 200 with one token, or a 4xx with a
    message; never a 5xx, never a dead server (``test_the_server_answers_like_hf_after_the_fuzzing``)."""
    info = requests.get(florence2.url + "/sgl_embeds/info", timeout=30).json()
    handle = _held_handle(florence2.url, info["span_width"])
    segments = data.draw(prompts(info, handle), "segments")
    route = data.draw(st.sampled_from(["/generate", "/v1/completions"]), "route")
    body = ({"input_segments": segments, "sampling_params": {"max_new_tokens": 1}} if route == "/generate"
            else {"model": "default", "prompt": "", "max_tokens": 1, "input_segments": segments})
    data_, content_type = binary_body.encode_body(body)
    r = requests.post(florence2.url + route, data=data_, headers={"content-type": content_type}, timeout=120)
    assert r.status_code == 200 or (400 <= r.status_code < 500 and helpers.error_message(r)), (
        route, segments, r.status_code, r.text[:300])
    FUZZED[r.status_code == 200] += 1


FUZZED = {True: 0, False: 0}  # served, refused


def _held_handle(url: str, width: int) -> str:
    up = requests.post(url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(helpers.seeded_rows(5, 4, width))},
                       timeout=60)
    assert up.status_code == 200, up.text
    return up.json()["handle"]


def test_the_server_answers_like_hf_after_the_fuzzing(florence2):
    # most random prompts are refused here (text or ids alone, grids, bad ids: 37 of 40 in the
    # fixed stream); a few must be served, or the fuzzer never reached the encoder
    assert FUZZED[True] >= 2 and FUZZED[False] >= 20, f"the fuzzer must reach both outcomes: {FUZZED}"
    assert requests.get(florence2.url + "/health", timeout=30).status_code == 200
    backend, image = _backend(florence2.url), _images()[0]
    (out,) = _ask(backend, _segments(backend, "<CAPTION>", image))
    _check(out, "<CAPTION>", image, "after the fuzzing: ")
