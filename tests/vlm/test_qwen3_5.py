"""Qwen3.5 served on CPU (issue #36): a hybrid model, three Gated DeltaNet layers (linear
attention with a recurrent state) to one of full attention, whose ops come from the CPU fallback
(``sgl_embeds_cpu/gdn.py``, ``fused.py``). Text prompts' greedy tokens and logprobs equal HF's
``Qwen3_5ForConditionalGeneration`` (float32, its pure-torch recurrent kernels): prompts prefilled
in chunks of 16 positions (the state carried from chunk to chunk), then decoded step by step;
requests batched together (each its own state slot); a repeat served from the prefix cache
(``MambaRadixCache``, which holds the recurrent state) gives the same answer. Image spans as on
Qwen3-VL: the server's vision weights are NaN, so an answer equal to HF's on the pixels proves the
tower never ran. Also equal to HF: an image and a box through the client's vision half
(``sgl.region``), clips (Qwen3-VL's processor: ``video_timestamps``), a span cut by a prefill
chunk, and the answers after a hit through one and two images (the same as without the hit);
concurrent prompts that retract answer as they do alone.

No deepstack, by design of the model, not a gap: transformers 5.19's ``Qwen3_5VisionModel``
deletes Qwen3-VL's ``deepstack_visual_indexes`` and ``deepstack_merger_list`` and
``Qwen3_5VisionConfig`` has no such field, so HF's Qwen3.5 never adds deepstack rows and a span
is ``[n, hidden]``; there is no "deepstack dropped" break to catch. SGLang reads the field, with
Qwen3-VL's default ``[8, 16, 24]`` when a config lacks it: on the tiny tower (2 blocks) no block
is captured, and the warm-up image failed in ``mm_utils._scatter_mm_embedding`` (``index_copy_``:
a destination of 192 = 3 x 64 deepstack columns, a source of 0). The tiny checkpoint therefore says
``deepstack_visual_indexes: []``, as real Qwen3.5 configs do."""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
import requests

import helpers
from sgl_embeds import EmbedsEndpoint
from sgl_embeds_protocol import binary_body
from sgl_embeds_protocol.segments import Grid, Span, Text
from qwen_vl_harness import (BOX, MIN_COMPARED, MAX_TOKENS, ask, assert_matches_hf, assert_regions_match_hf, chat_text,
                             clip_span, grid_span, span_segments)
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.qwen_vl import (
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    hf_qwen_vl,
    image_rows,
    qwen_vl_greedy,
    qwen_vl_inputs,
    sample_clip,
    sample_images,
    tiny_qwen3_5_dir,
    tiny_qwen3_5_moe_dir,
)

pytestmark = pytest.mark.server
CHUNK = 16  # the server's --chunked-prefill-size
RETRACTED_TOKENS = 40  # eight prompts of ~40 positions and this many new tokens: more than its KV pool
QUESTIONS = [
    "what is the color of the sky",
    "describe the small red car near the tree",
    # long enough for several prefill chunks
    " ".join(["the quick brown fox is near the lazy dog on the road and the cat is under the tree"] * 4)
    + " what is there",
]


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_qwen3_5_dir()


@pytest.fixture
def server(qwen3_5_server):
    """The pooled ``qwen3_5`` server, named so that the pool keeps it while these tests run."""
    return qwen3_5_server


def _ask(server, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS},
            **helpers.OUTPUT_LOGPROBS, **extra}
    return helpers.generate(server, body)


def _assert_matches_hf(out: dict, checkpoint, text: str, label: str) -> list[int]:
    greedy = functools.partial(qwen_vl_greedy, checkpoint, text, [], MAX_TOKENS)
    eos = ref.eos_ids(hf_qwen_vl(str(checkpoint))[0])
    return ref.assert_vlm_matches_hf(out, greedy, eos, f"{label}: ", MIN_COMPARED).tokens


def _chunk_end_hit(meta: dict) -> int:
    """Where a repeat of a prompt prefilled from an empty cache hits: the last prefill chunk end
    before its last position (SGLang's ``no_buffer`` rule for a recurrent state; measured with raw
    images too, docs/architecture.md)."""
    return CHUNK * ((meta["prompt_tokens"] - 1) // CHUNK)


def test_text_prompts_equal_hf_prefilled_in_chunks(server, checkpoint):
    answers = {}
    for i, question in enumerate(QUESTIONS):
        text = chat_text(checkpoint, question, 0)
        out = _ask(server, text)
        prompt = len(qwen_vl_inputs(checkpoint, text, [])["input_ids"][0])
        assert out["meta_info"]["prompt_tokens"] == prompt
        answers[i] = tuple(_assert_matches_hf(out, checkpoint, text, f"question {i} ({prompt} tokens)"))
    assert prompt > 3 * CHUNK, "the last prompt must take several prefill chunks"
    assert len(set(answers.values())) == len(answers), f"the prompts must change HF's answer: {answers}"


def test_batched_requests_each_equal_hf(server, checkpoint):
    """Three prompts at once: prefilled and decoded in shared batches, each in its own state slot."""
    texts = [chat_text(checkpoint, q, 0) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        outs = list(pool.map(lambda t: _ask(server, t), texts))
    for i, (text, out) in enumerate(zip(texts, outs)):
        _assert_matches_hf(out, checkpoint, text, f"batched {i}")


def test_a_repeat_is_served_from_the_cache_with_the_same_answer(server, checkpoint):
    text = chat_text(checkpoint, "which object is at the top left corner of the picture", 0)
    _flush(server)
    first = _ask(server, text)
    again = _ask(server, text)
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == _chunk_end_hit(again["meta_info"]), again["meta_info"]
    _assert_matches_hf(again, checkpoint, text, "repeat")
    # a prompt that shares the repeat's text up to its question: the cache must not lend it the
    # repeat's state past the shared part
    other = chat_text(checkpoint, "which object is at the bottom right corner of the picture", 0)
    _assert_matches_hf(_ask(server, other), checkpoint, other, "other question")


def test_image_spans_equal_hf_on_the_pixels(server, checkpoint):
    text = chat_text(checkpoint, "what is the color of the object", 1)
    answers = {}
    for name, image in list(sample_images().items())[:2]:
        out = ask(server, span_segments(text, [grid_span(checkpoint, image)]))
        assert out["meta_info"]["prompt_tokens"] == len(qwen_vl_inputs(checkpoint, text, [image])["input_ids"][0])
        answers[name] = tuple(assert_matches_hf(out, checkpoint, text, [image], name))
    assert len(set(answers.values())) == len(answers), f"images must change HF's answer: {answers}"


def test_a_repeated_span_is_cached_with_its_state_and_another_image_shares_none(server, checkpoint):
    """The prefix cache holds the recurrent state at the nodes it keeps: a repeat of a span prompt
    hits through the span (its answer HF's); an image of the same grid after the same text
    matches at most the text before it, and its answer is HF's on its own pixels."""
    text = chat_text(checkpoint, "describe it in a few words", 1)
    stripes, checks = sample_images()["stripes"], sample_images()["checks"]  # one grid (1x4x8)
    span = grid_span(checkpoint, stripes)
    _flush(server)
    first = ask(server, span_segments(text, [span]))
    again = ask(server, span_segments(text, [span]))
    before = len(qwen_vl_inputs(checkpoint, text.split(IMAGE_PLACEHOLDER)[0] + VISION_START, [])["input_ids"][0])
    rows = span["image_grid_thw"][1] * span["image_grid_thw"][2] // 4
    meta = again["meta_info"]
    print(f"repeat: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached "
          f"({before} before the span, {rows} span rows)")
    assert meta["cached_tokens"] >= before + rows and meta["cached_tokens"] == _chunk_end_hit(meta), meta
    assert again["output_ids"] == first["output_ids"]
    assert_matches_hf(again, checkpoint, text, [stripes], "repeat")
    other = ask(server, span_segments(text, [grid_span(checkpoint, checks)]))
    assert other["meta_info"]["cached_tokens"] <= before, other["meta_info"]
    assert_matches_hf(other, checkpoint, text, [checks], "another image")


def _flush(server) -> None:
    """Empty the prefix cache, so the next prompt is prefilled from its first position."""
    requests.post(server.url + "/flush_cache", timeout=60).raise_for_status()


def _numbers(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def _span_start(checkpoint, text: str) -> int:
    """The position of the first image's first row in ``text``'s prompt."""
    return len(qwen_vl_inputs(checkpoint, text.split(IMAGE_PLACEHOLDER)[0] + VISION_START, [])["input_ids"][0])


def test_an_image_and_a_box_through_the_client_encoder_equal_hf(server, checkpoint):
    """``sgl.image`` and ``sgl.region`` (a box) with Qwen3.5's client vision half (Qwen3-VL's
    tower without deepstack, ``load_encoder``) answer as HF does on the image and the crop."""
    assert_regions_match_hf(checkpoint, server, {"image": None, "box": BOX})


def test_clips_equal_hf_on_their_frames(server, checkpoint):
    """A clip span (Qwen3-VL's processor: each frame after its time as text, ``video_timestamps``)
    equals HF on the frames; another frame rate writes other times and changes HF's answer."""
    text = chat_text(checkpoint, "what happens in the video", 0, media=("video",))
    frames = sample_clip(4, 128, 64, seed=1)
    answers = {}
    for fps in (2.0, 4.0):
        clip = (frames, fps)
        out = ask(server, span_segments(text, [clip_span(checkpoint, *clip)]))
        assert out["meta_info"]["prompt_tokens"] == len(qwen_vl_inputs(checkpoint, text, [], clips=[clip])["input_ids"][0])
        answers[fps] = tuple(assert_matches_hf(out, checkpoint, text, [], f"{fps:g} fps", clips=[clip]))
    assert answers[2.0] != answers[4.0], f"the frame rate must change HF's answer: {answers}"


def test_a_span_cut_by_a_prefill_chunk_equals_hf(server, checkpoint):
    """From an empty cache the prompt is prefilled in chunks of ``CHUNK`` positions, one of whose
    ends falls inside the image's rows: the recurrent and conv states cross the cut inside the span."""
    text = chat_text(checkpoint, "what is in the picture", 1)
    image = helpers.random_image(128, 128)  # grid 1x8x8: 16 rows, from position 7 on
    span = grid_span(checkpoint, image)
    start = _span_start(checkpoint, text)
    end = start + span["image_grid_thw"][1] * span["image_grid_thw"][2] // 4
    assert any(start < cut < end for cut in range(CHUNK, end, CHUNK)), (start, end, CHUNK)
    _flush(server)
    out = ask(server, span_segments(text, [span]))
    assert out["meta_info"]["cached_tokens"] == 0, out["meta_info"]
    assert_matches_hf(out, checkpoint, text, [image], f"rows at {start}..{end - 1}, cut at a multiple of {CHUNK}")


@pytest.mark.parametrize("n_images", [1, 2])
def test_after_a_hit_the_answer_is_the_one_without(server, checkpoint, n_images):
    """The same span prompt from an empty cache, then again: the repeat hits the prefix cache
    through every span (the recurrent and conv states after them restored from the cache), and
    its tokens and logprobs are the first answer's, which is HF's."""
    text = chat_text(checkpoint, "describe what you see", n_images)
    images = [sample_images()[name] for name in ("disc", "square")[:n_images]]
    segments = span_segments(text, [grid_span(checkpoint, image) for image in images])
    _flush(server)
    cold, warm = ask(server, segments), ask(server, segments)
    after_end = len(qwen_vl_inputs(checkpoint, text, images)["input_ids"][0]) - len(
        qwen_vl_inputs(checkpoint, text.rsplit(IMAGE_PLACEHOLDER, 1)[1], [], add_special_tokens=False)["input_ids"][0])
    last_row = after_end - 2  # the last image's last row, before its vision-end token
    print(f"{n_images} image(s): {warm['meta_info']['cached_tokens']} of {warm['meta_info']['prompt_tokens']} "
          f"positions cached, the last image's last row at {last_row}")
    assert cold["meta_info"]["cached_tokens"] == 0 and warm["meta_info"]["cached_tokens"] > last_row, (
        cold["meta_info"], warm["meta_info"])
    assert warm["meta_info"]["cached_tokens"] == _chunk_end_hit(warm["meta_info"]), warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
    worst = max(abs(a - b) for a, b in zip(_numbers(warm), _numbers(cold)))
    assert worst <= ref.LOGPROB_TOL, f"a hit moved the logprobs by {worst:.2e}"
    assert_matches_hf(warm, checkpoint, text, images, f"{n_images} image(s) after a hit")


def test_a_span_by_endpoint_in_a_binary_body_then_by_handle_is_cached_through_it(server, checkpoint):
    """``EmbedsEndpoint.run`` sends an image span's rows once, in a binary body, and the server
    holds them; the repeat names the span by its handle (a body without its rows), hits the prefix
    cache through the span (the recurrent state after it restored), as far as a raw image's repeat
    does, and answers as the first did, which is HF's on the pixels."""
    backend = EmbedsEndpoint(server.url)
    posted = []  # (binary, body bytes) of each /generate post

    def recording_post(body: dict, binary: bool, post=backend.sender.post):
        size = sum(memoryview(p).nbytes for p in binary_body.encode_parts(body)) if binary else None
        posted.append((binary, size))
        return post(body, binary)

    backend.sender.post = recording_post
    text = chat_text(checkpoint, "what is the shape in the picture", 1)
    before, after = text.split(IMAGE_PLACEHOLDER)
    image = sample_images()["checks"]  # no other test has a server hold it (the store's count below)
    rows, grid = image_rows(checkpoint, image)
    segments = [Text(before + VISION_START), Span(rows, grid=Grid(grid)), Text(VISION_END + after)]
    held = requests.get(server.url + "/sgl_embeds/info", timeout=30).json()["span_store"]["count"]
    _flush(server)
    cold, warm = (backend.run(input_segments=segments, **helpers.OUTPUT_LOGPROBS,
                              sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}) for _ in range(2))
    rows_bytes = rows.numel() * rows.element_size()
    assert [binary for binary, _ in posted] == [True, True], posted
    assert posted[0][1] - posted[1][1] >= rows_bytes, f"the rows must cross once: {posted}, {rows_bytes} bytes"
    assert requests.get(server.url + "/sgl_embeds/info", timeout=30).json()["span_store"]["count"] == held + 1
    span_end = _span_start(checkpoint, text) + rows.shape[0]
    print(f"by handle: {warm['meta_info']['cached_tokens']} of {warm['meta_info']['prompt_tokens']} positions "
          f"cached, the span's rows end at {span_end}; bodies {[size for _, size in posted]} bytes")
    assert cold["meta_info"]["cached_tokens"] == 0 and warm["meta_info"]["cached_tokens"] >= span_end, (
        cold["meta_info"], warm["meta_info"])
    # what a repeat with the raw image gets: the last prefill chunk end before the prompt's last
    # position (SGLang's no_buffer rule; measured both ways, docs/architecture.md)
    assert warm["meta_info"]["cached_tokens"] == _chunk_end_hit(warm["meta_info"]), warm["meta_info"]
    for label, out in (("inline, binary body", cold), ("by handle, after a hit", warm)):
        assert_matches_hf(out, checkpoint, text, [image], label)
    assert warm["output_ids"] == cold["output_ids"]


def test_retraction_leaves_the_answers_as_they_were(server, checkpoint):
    """Eight image prompts at once need more KV than the server's pool (``--max-total-tokens``):
    decode retracts some, which are prefilled again from their ids and spans, and every answer is
    the one the prompt gets alone, which is HF's on the pixels over all its tokens."""
    asked = [(chat_text(checkpoint, question, 1), image)
             for question in ("describe the picture", "what is the color of the object")
             for image in sample_images().values()]
    prompts = [span_segments(text, [grid_span(checkpoint, image)]) for text, image in asked]
    alone = [helpers.generate(server, helpers.body(p, RETRACTED_TOKENS, return_logprob=True)) for p in prompts]
    for (text, image), out in zip(asked, alone):
        assert_matches_hf(out, checkpoint, text, [image], "served alone", max_new_tokens=RETRACTED_TOKENS)
    retracted, attempts = 0, 0
    while retracted == 0 and attempts < 3:  # whether it retracts depends on how the eight arrive
        _flush(server)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: helpers.generate(server, helpers.body(p, RETRACTED_TOKENS)), prompts))
        assert [out["output_ids"] for out in together] == [out["output_ids"] for out in alone]
        retracted += sum(out["meta_info"].get("num_retractions", 0) for out in together)
        attempts += 1
    print(f"{retracted} retraction(s) in {attempts} attempt(s)")
    assert retracted > 0, f"the KV pool was meant to force retraction ({attempts} attempts)"
    assert len({tuple(out["output_ids"]) for out in alone}) > len(prompts) // 2, "the prompts must change the answers"


def test_qwen3_5_moe_answers_an_image_span_as_hf(qwen3_5_moe_server):
    """Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``: each MLP a mixture of experts and a
    gated shared expert, ``sgl_embeds_cpu.fused.gate_sigmoid_mul`` on CPU) on the same path: an image span's
    tokens and logprobs equal HF's on the pixels, and another image changes HF's answer."""
    moe = tiny_qwen3_5_moe_dir()
    text = chat_text(moe, "what is the color of the object", 1)
    image, other = sample_images()["disc"], sample_images()["square"]
    out = ask(qwen3_5_moe_server, span_segments(text, [grid_span(moe, image)]))
    tokens = assert_matches_hf(out, moe, text, [image], "Qwen3.5-MoE")
    assert qwen_vl_greedy(moe, text, [other], MAX_TOKENS).tokens != tokens, "the image must change HF's answer"
