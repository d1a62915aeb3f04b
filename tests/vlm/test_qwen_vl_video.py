"""Clip spans on the natively served Qwen-VL families: a clip's rows (HF's ``get_video_features``,
frame after frame; Qwen3-VL's three deepstack layers' rows along the width) with its
``video_grid_thw`` and the time its family reads (Qwen2.5-VL ``second_per_grid_t``, Qwen3-VL
``video_timestamps``, Qwen2-VL none) between the vision tokens. The server's greedy tokens and
logprobs equal HF's own class on the frames (float32) for clips of 4 and 8 frames at two sizes
and two frame rates, clips as users send them (frame counts that do not fill a temporal step, at
1, 3 and 30 fps, encoded by the client; two clips and two images in one prompt, in either order;
frames as PIL images, an array or a tensor); the servers' vision weights are NaN, so an exact
answer proves the tower never ran. The clip sizes keep a
Qwen2.5-VL clip's time extent below its width: past it, HF 5.19 starts the text after a clip at
another position than SGLang's rope index (and the original Qwen code) do (docs/vision-encoders.md).
"""

from __future__ import annotations

import pytest
import requests
import torch
from PIL import Image

import helpers
import sgl_embeds
from sgl_embeds import vision
from qwen_vl_harness import (CLIP_FAMILIES, MAX_TOKENS, ask, assert_matches_hf, chat_text, clip_span, grid_span,
                             program_text, span_segments)
from sgl_embeds_testing.qwen_vl import (
    VIDEO_PLACEHOLDER,
    clip_rows,
    hf_qwen_vl,
    qwen_vl_greedy,
    qwen_vl_inputs,
    sample_clip,
    sample_images,
)
from sgl_embeds.vlm import load_encoder
from sgl_embeds_protocol import wire

pytestmark = pytest.mark.server
OTHER_SEED = 14  # another clip, whose answers are varied on every family (measured)
# (frames, fps) as users send them: odd frame counts, so the processor repeats the last frame to
# fill the last temporal step, at rates other than the 2 and 4 fps above
CLIPS_AS_SENT = ((3, 1.0), (5, 3.0), (7, 30.0))
TIMED = ["qwen_vl_spans", "qwen3_vl_spans"]  # the families whose clips carry their time


@pytest.fixture(scope="module", params=helpers.pooled(CLIP_FAMILIES))
def family(request):
    """(server name, checkpoint, frame sizes, seed) of one family."""
    make, sizes, seed = CLIP_FAMILIES[request.param]
    return request.param, make(), sizes, seed


@pytest.fixture
def served(family, servers):
    """(checkpoint, its running server, frame sizes, seed)."""
    name, checkpoint, sizes, seed = family
    return checkpoint, servers.get(name)[0], sizes, seed


def video_text(checkpoint, question: str = "what happens in the video") -> str:
    return chat_text(checkpoint, question, 0, media=("video",))


def test_a_clip_equals_hf_on_its_frames_at_two_lengths_sizes_and_rates(served):
    checkpoint, server, (wide, small), seed = served
    text = video_text(checkpoint)
    references = {}
    for frames, size, fps in ((4, wide, 2.0), (8, wide, 2.0), (8, small, 4.0), (4, small, 4.0)):
        clip = (sample_clip(frames, *size, seed=seed), fps)
        label = f"{frames} frames of {size[0]}x{size[1]} at {fps:g} fps"
        out = ask(server, span_segments(text, [clip_span(checkpoint, *clip)]))
        references[label] = assert_matches_hf(out, checkpoint, text, [], label, clips=[clip])
        hf_prompt = qwen_vl_inputs(checkpoint, text, [], clips=[clip])["input_ids"][0]
        assert out["meta_info"]["prompt_tokens"] == len(hf_prompt), label
    assert len({tuple(r) for r in references.values()}) == len(references), f"clips must change HF: {references}"


def test_odd_frame_counts_at_other_rates_encoded_by_the_client_equal_hf(served):
    """The client's ``clip`` (``vision.encode_clip``: the checkpoint's video processor, the tower,
    the time as the family's processor writes it) on clips whose last temporal step is filled with
    a repeated frame, at 1, 3 and 30 fps (at 30 fps Qwen2.5-VL's steps share their time
    positions): each answer is HF's on the frames."""
    checkpoint, server, (wide, _), seed = served
    encoder = load_encoder(checkpoint, device="cpu")
    text = video_text(checkpoint)
    references = {}
    for frames, fps in CLIPS_AS_SENT:
        clip = (sample_clip(frames, *wide, seed=seed), fps)
        label = f"{frames} frames at {fps:g} fps"
        encoded = vision.encode_clip(*clip, encoder)
        assert encoded.grid.thw[0] == -(-frames // encoder.temporal_patch_size), label
        out = ask(server, span_segments(text, [{**helpers.span(encoded.rows), **encoded.grid.fields()}]))
        references[label] = assert_matches_hf(out, checkpoint, text, [], label, clips=[clip])
    assert len({tuple(r) for r in references.values()}) == len(references), f"clips must change HF: {references}"


def test_two_clips_and_two_images_in_one_prompt_in_either_order(served):
    """Clip, image, clip, image in one prompt (a clip of 4 frames at 2 fps and one of 3 frames at
    3 fps, of two sizes): equal to HF in both orders of the clips, and the order changes HF's
    answer."""
    checkpoint, server, (wide, small), seed = served
    text = chat_text(checkpoint, "compare the videos and the pictures", 0, media=("video", "image", "video", "image"))
    pictures = sample_images()
    clips = [(sample_clip(4, *wide, seed=seed), 2.0), (sample_clip(3, *small, seed=OTHER_SEED), 3.0)]
    answers = []
    for order in (clips, clips[::-1]):
        label = f"clips of {len(order[0][0])} then {len(order[1][0])} frames"
        spans = [clip_span(checkpoint, *order[0]), grid_span(checkpoint, pictures["disc"]),
                 clip_span(checkpoint, *order[1]), grid_span(checkpoint, pictures["square"])]
        out = ask(server, span_segments(text, spans))
        answers.append(assert_matches_hf(out, checkpoint, text, [pictures["disc"], pictures["square"]], label,
                                         clips=order))
    assert answers[0] != answers[1], f"the clips' order must change HF's answer: {answers}"


@pytest.mark.parametrize("name", helpers.pooled(TIMED))
def test_the_frame_rate_changes_the_answer_and_a_clip_without_its_time_is_a_400(name, servers):
    """The same frames at 2 and at 4 fps: Qwen2.5-VL spaces the steps' rotary positions by the
    seconds, Qwen3-VL writes other times; ours equals HF at both. Without the time field the
    server refuses the clip, naming the field. (Qwen2-VL reads no time: its steps are 1 position
    apart.)"""
    make, (wide, _), seed = CLIP_FAMILIES[name]
    checkpoint, server = make(), servers.get(name)[0]
    text = video_text(checkpoint)
    frames = sample_clip(8, *wide, seed=seed)
    answers = {}
    for fps in (2.0, 4.0):
        out = ask(server, span_segments(text, [clip_span(checkpoint, frames, fps)]))
        answers[fps] = assert_matches_hf(out, checkpoint, text, [], f"{fps:g} fps", clips=[(frames, fps)])
    assert answers[2.0] != answers[4.0], f"the frame rate must change HF's answer: {answers}"
    span = clip_span(checkpoint, frames, 2.0)
    timeless = {k: v for k, v in span.items() if k not in ("second_per_grid_t", "video_timestamps")}
    res = server.generate(helpers.body(span_segments(text, [timeless]), MAX_TOKENS))
    field = "second_per_grid_t" if "second_per_grid_t" in span else "video_timestamps"
    assert res.status_code == 400 and f"takes {field}" in res.json()["message"], res.text


@pytest.mark.parametrize("change, message", [
    (lambda s: {**s, "video_grid_thw": [s["video_grid_thw"][0], s["video_grid_thw"][1] * 2, s["video_grid_thw"][2]]},
     "rows (merge size 2), but the span has"),
    (lambda s: {**s, "image_grid_thw": s["video_grid_thw"]}, "an image (image_grid_thw) or a clip (video_grid_thw), not both"),
    (lambda s: {**s, "video_grid_thw": [0, 2, 2]}, "video_grid_thw must be [t, h, w] of positive ints"),
])
def test_a_bad_clip_grid_is_a_400_that_says_which(served, change, message):
    checkpoint, server, (wide, _), seed = served
    text = video_text(checkpoint)
    span = change(clip_span(checkpoint, sample_clip(4, *wide, seed=seed), 2.0))
    res = server.generate(helpers.body(span_segments(text, [span]), MAX_TOKENS))
    assert res.status_code == 400 and message in res.json()["message"], res.text


def test_an_image_and_a_clip_in_one_prompt(served):
    checkpoint, server, (wide, _), seed = served
    text = chat_text(checkpoint, "compare the picture and the video", 0, media=("image", "video"))
    image, clip = sample_images()["disc"], (sample_clip(4, *wide, seed=seed), 2.0)
    out = ask(server, span_segments(text, [grid_span(checkpoint, image), clip_span(checkpoint, *clip)]))
    tokens = assert_matches_hf(out, checkpoint, text, [image], "an image and a clip", clips=[clip])
    other = qwen_vl_greedy(checkpoint, text, [sample_images()["square"]], MAX_TOKENS, clips=[clip]).tokens
    assert other != tokens, "the image must change HF's answer beside the clip"


def test_a_repeat_is_cached_and_another_clip_or_order_shares_only_the_text_before(served):
    checkpoint, server, (wide, _), seed = served
    text = video_text(checkpoint, "describe the video")
    frames = sample_clip(8, *wide, seed=seed)
    span = clip_span(checkpoint, frames, 2.0)
    first, again = ask(server, span_segments(text, [span])), ask(server, span_segments(text, [span]))
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    # the positions before the clip's first row (a Qwen3-VL clip's: after its first frame's time)
    hf_ids = qwen_vl_inputs(checkpoint, text, [], clips=[(frames, 2.0)])["input_ids"][0].tolist()
    text_before = hf_ids.index(hf_qwen_vl(str(checkpoint))[0].config.video_token_id)
    for label, clip in (("frames reversed", (frames[::-1].copy(), 2.0)),
                        ("another clip", (sample_clip(8, *wide, seed=OTHER_SEED), 2.0))):
        out = ask(server, span_segments(text, [clip_span(checkpoint, *clip)]))
        assert out["meta_info"]["cached_tokens"] <= text_before, f"{label} must not reuse the clip's KV"
        assert_matches_hf(out, checkpoint, text, [], label, clips=[clip])


def test_a_program_with_sgl_video_and_the_client_vision_half(served):
    """``load_encoder(DIR).clip`` through ``sgl.video(frames, fps)`` between the vision tokens:
    the program's answer is the one HF gives on the frames, and the backend's encoder cache runs
    the tower once for a clip asked about three times, as PIL images, an array and a tensor. The backend sends it as it sends any span: in a
    binary body, held by the server, by handle the second time."""
    checkpoint, server, (wide, _), seed = served
    encoder = load_encoder(checkpoint, device="cpu")
    backend = sgl_embeds.EmbedsEndpoint(server.url, vision_encoder=encoder)
    text = video_text(checkpoint)
    before, after = text.split(VIDEO_PLACEHOLDER)
    frames = sample_clip(4, *wide, seed=seed)

    import sglang as sgl

    @sgl.function
    def ask_about(s, frames, fps):
        s += before + encoder.vision_start + sgl.video(frames, fps) + encoder.vision_end + after
        s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)

    def held() -> int:  # spans the server's store holds
        return requests.get(server.url + "/sgl_embeds/info", timeout=30).json()["span_store"]["count"]

    held_before = held()
    # the same frames as users hold them: PIL images, the array, a tensor: one encoding, one span
    as_sent = ([Image.fromarray(frame) for frame in frames], frames, torch.from_numpy(frames))
    answers = [ask_about.run(frames=clip, fps=2.0, backend=backend)["answer"] for clip in as_sent]
    assert backend.sends_binary and held() == held_before + 1 and backend.writer.held.sizes()[0] == 1
    direct = ask(server, span_segments(text, [clip_span(checkpoint, frames, 2.0)]))
    assert_matches_hf(direct, checkpoint, text, [], "the clip sent directly", clips=[(frames, 2.0)])
    assert answers == [program_text(server, span_segments(text, [clip_span(checkpoint, frames, 2.0)]), direct)] * 3
    assert (backend.encoder_cache.misses, backend.encoder_cache.hits) == (1, 2)


def test_the_chat_route_takes_a_clip_part(served):
    """``/v1/chat/completions`` with an ``input_embeds`` part that carries a video grid: the chat
    template renders it as a video part, so the prompt ids and the answer are HF's."""
    checkpoint, server, (wide, _), seed = served
    clip = (sample_clip(4, *wide, seed=seed), 2.0)
    rows, fields = clip_rows(checkpoint, *clip)
    part = {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows), **fields}
    question = {"type": "text", "text": "what happens in the video"}
    res = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": [part, question]}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "logprobs": True, "return_token_ids": True})
    assert res.status_code == 200, res.text
    text = video_text(checkpoint)
    hf_ids = qwen_vl_inputs(checkpoint, text, [], add_special_tokens=False, clips=[clip])["input_ids"][0].tolist()
    assert res.json()["choices"][0]["prompt_token_ids"] == hf_ids
    assert_matches_hf(helpers.chat_as_generate(res.json()), checkpoint, text, [], "chat route clip",
                      add_special_tokens=False, clips=[clip])


def test_a_clip_span_on_a_text_model_is_a_400(llama_server):
    span = {**helpers.span(helpers.seeded_rows(0, 8)), "video_grid_thw": [2, 4, 4], "second_per_grid_t": 1.0}
    res = llama_server.generate(helpers.body([helpers.text("hi"), span]))
    assert res.status_code == 400 and "video_grid_thw are for VLMs served natively" in res.json()["message"], res.text
