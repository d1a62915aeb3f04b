"""Spans with an image grid on a natively served Qwen2.5-VL (issue #22): the client computes an
image's rows with HF's own vision module, sends them as ``input_segments`` between the vision
tokens, and the server's greedy tokens equal HF ``Qwen2_5_VLForConditionalGeneration`` on the
pixels (float32). The server's vision weights are NaN (``poisoned_vision_dir``): an exact answer
proves the tower never ran on the rows. Its small prefill chunk cuts images across chunks. The
gateway test runs on every Qwen-VL family (Qwen2.5-VL, Qwen3-VL, Qwen2-VL).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import sglang as sgl

import engine_probe
import helpers
from qwen_vl_harness import (CLIP_FAMILIES, image_program, MAX_TOKENS, ask, program_text, assert_matches_hf, chat_text, grid_span,
                             span_segments)
from sgl_embeds import EmbedsEndpoint, vision
from sgl_embeds.vlm import load_encoder
from sgl_embeds_testing.qwen_vl import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    VISION_END,
    VISION_START,
    clip_rows,
    hf_qwen_vl,
    image_rows,
    png_base64,
    poisoned_vision_dir,
    qwen_vl_greedy,
    qwen_vl_inputs,
    sample_clip,
    sample_images,
    tiny_qwen2_5_vl_dir,
    tiny_qwen2_vl_dir,
    tiny_qwen3_vl_dir,
)
from sgl_embeds_testing import zygote
from sgl_embeds_testing.server import Gateway, cpu_env
from sgl_embeds_protocol import keys, wire
from sgl_embeds_protocol.segments import Grid, Span, Text

pytestmark = pytest.mark.server
RETRACTED_TOKENS = 60  # eight prompts of ~50 positions and this many new tokens: more than the KV pool


def test_one_image_span_equals_hf_on_the_pixels(qwen_vl_spans_server, qwen_vl_dir):
    text = chat_text(qwen_vl_dir, "what is the color of the object", 1)
    references = {}
    for name, image in list(sample_images().items())[:3]:
        out = ask(qwen_vl_spans_server, span_segments(text, [grid_span(qwen_vl_dir, image)]))
        references[name] = assert_matches_hf(out, qwen_vl_dir, text, [image], name)
        expected_len = len(qwen_vl_inputs(qwen_vl_dir, text, [image])["input_ids"][0])
        assert out["meta_info"]["prompt_tokens"] == expected_len
    assert len({tuple(r) for r in references.values()}) == len(references), f"images must change HF: {references}"


def test_two_images_each_its_own_item_and_their_order_matters(qwen_vl_spans_server, qwen_vl_dir):
    text = chat_text(qwen_vl_dir, "compare them", 2)
    first, second = sample_images()["stripes"], sample_images()["checks"]  # the same grid: only their rows differ
    spans = [grid_span(qwen_vl_dir, first), grid_span(qwen_vl_dir, second)]
    forward = ask(qwen_vl_spans_server, span_segments(text, spans))
    swapped = ask(qwen_vl_spans_server, span_segments(text, spans[::-1]))
    ref_forward = assert_matches_hf(forward, qwen_vl_dir, text, [first, second], "stripes, checks")
    ref_swapped = assert_matches_hf(swapped, qwen_vl_dir, text, [second, first], "checks, stripes")
    assert ref_forward != ref_swapped, "HF's answer must depend on the images' order"


def test_a_repeat_is_cached_like_a_raw_image_and_another_grid_is_not(qwen_vl_spans_server, qwen_vl_dir):
    """A repeat reports all but the last prompt token cached (a raw image's repeat does the same,
    tests/vlm/test_qwen_vl_native.py); the same rows under another grid of as many rows share no KV
    past the text before them."""
    text = chat_text(qwen_vl_dir, "describe it in a few words", 1)
    span = grid_span(qwen_vl_dir, sample_images()["stripes"])  # grid 1x4x8
    first = ask(qwen_vl_spans_server, span_segments(text, [span]))
    again = ask(qwen_vl_spans_server, span_segments(text, [span]))
    prompt_tokens = again["meta_info"]["prompt_tokens"]
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == prompt_tokens - 1
    text_before = len(hf_qwen_vl(str(qwen_vl_dir))[1].tokenizer.encode(text.split(IMAGE_PLACEHOLDER)[0] + VISION_START))
    transposed = {**span, "image_grid_thw": [1, 8, 4]}
    other = ask(qwen_vl_spans_server, span_segments(text, [transposed]))
    assert other["meta_info"]["prompt_tokens"] == prompt_tokens
    assert other["meta_info"]["cached_tokens"] <= text_before, "another grid must not reuse the rows' KV"
    assert other["output_ids"] != first["output_ids"], "the grid must change the positions, so the answer"


def test_a_span_by_handle_is_served_alike(qwen_vl_spans_server, qwen_vl_dir):
    text = chat_text(qwen_vl_dir, "what shape is it", 1)
    span = grid_span(qwen_vl_dir, sample_images()["square"])
    inline = ask(qwen_vl_spans_server, span_segments(text, [span]), keep_spans=True)
    handle = keys.content_key(wire.decode_tensor(span["embeds"]))
    by_handle = ask(qwen_vl_spans_server, span_segments(text, [{"type": "embeds", "embeds": {"handle": handle},
                                                               "image_grid_thw": span["image_grid_thw"]}]))
    assert by_handle["output_ids"] == inline["output_ids"]
    assert by_handle["meta_info"]["cached_tokens"] == by_handle["meta_info"]["prompt_tokens"] - 1


@pytest.mark.parametrize("change, message", [
    (lambda s: {**s, "image_grid_thw": [1, 4, 4]}, "makes t*h*w/merge**2 = 4 rows"),
    (lambda s: {**s, "image_grid_thw": [1, 3, 8]}, "multiples of the merge size"),
    (lambda s: {k: v for k, v in s.items() if k != "image_grid_thw"}, "give the span its image_grid_thw"),
    (lambda s: {**s, "image_grid_thw": [1, 4]}, "must be [t, h, w] of positive ints"),
])
def test_a_bad_grid_is_a_400_that_says_which(qwen_vl_spans_server, qwen_vl_dir, change, message):
    text = chat_text(qwen_vl_dir, "what is it", 1)
    span = change(grid_span(qwen_vl_dir, sample_images()["stripes"]))
    res = qwen_vl_spans_server.generate(helpers.body(span_segments(text, [span]), MAX_TOKENS))
    assert res.status_code == 400 and message in res.json()["message"], res.text


def test_a_span_not_after_the_vision_start_token_is_a_400(qwen_vl_spans_server, qwen_vl_dir):
    span = grid_span(qwen_vl_dir, sample_images()["stripes"])
    res = qwen_vl_spans_server.generate(helpers.body([helpers.text("look: "), span], MAX_TOKENS))
    assert res.status_code == 400 and "must follow the vision-start token" in res.json()["message"], res.text


def test_a_grid_on_a_text_model_is_a_400(llama_server):
    rows = helpers.seeded_rows(0, 8)
    res = llama_server.generate(helpers.body([{**helpers.span(rows), "image_grid_thw": [1, 4, 8]}]))
    assert res.status_code == 400 and "image_grid_thw and video_grid_thw are for VLMs" in res.json()["message"], res.text


def test_the_poisoned_tower_really_is_poisoned(qwen_vl_spans_server, qwen_vl_dir):
    """The same image on this server: as a span (the tower never runs) HF's answer, 200 and equal
    tokens; as pixels (the NaN tower runs) not HF's answer: another answer or a 4xx, never a 500.
    The span goes first: a raw image's prefill chunk leaves NaN in the KV of the text before it
    (seen: every later request not cached past that text answered token 0), so that text must be
    cached already, and the raw image's entries are flushed after."""
    text = chat_text(qwen_vl_dir, "what is the color of the object", 1)
    image = sample_images()["stripes"]
    reference = qwen_vl_greedy(qwen_vl_dir, text, [image], MAX_TOKENS).tokens
    span = qwen_vl_spans_server.generate(helpers.body(span_segments(text, [grid_span(qwen_vl_dir, image)]),
                                                      MAX_TOKENS))
    assert span.status_code == 200, span.text
    assert span.json()["output_ids"] == reference
    res = qwen_vl_spans_server.generate({"text": text, "image_data": png_base64(image),
                                         "sampling_params": {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}})
    assert requests.post(qwen_vl_spans_server.url + "/flush_cache", timeout=30).ok
    if res.status_code == 200:
        assert res.json()["output_ids"] != reference, "the tower ran as if it were not poisoned"
    else:
        assert 400 <= res.status_code < 500, res.text


def test_spans_and_raw_images_in_one_batch_are_both_served(qwen_vl_server, qwen_vl_dir):
    """Both kinds sent at once (generation paused while they arrive) equal HF, on the server with
    a working tower. Whether they share a prefill batch is up to the scheduler (seen: 3 of 4 in
    one batch, or 2 of a kind); tests/vlm/test_qwen_vl_mm_embedding.py builds such batches deterministically."""
    text = chat_text(qwen_vl_dir, "what is the color of the object", 1)
    pictures = sample_images()
    raw = {"text": text, "image_data": png_base64(pictures["disc"]), "return_logprob": True,
           "sampling_params": {**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}}
    span = helpers.body(span_segments(text, [grid_span(qwen_vl_dir, pictures["stripes"])]), MAX_TOKENS,
                        return_logprob=True)
    assert requests.post(qwen_vl_server.url + "/pause_generation", json={"mode": "in_place"}).ok
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(helpers.generate, qwen_vl_server, b) for b in [raw, span, raw, span]]
        time.sleep(3)  # all four reach the scheduler's queue
        assert requests.post(qwen_vl_server.url + "/continue_generation", json={}).ok
        outs = [f.result() for f in futures]
    assert_matches_hf(outs[0], qwen_vl_dir, text, [pictures["disc"]], "raw disc")
    assert_matches_hf(outs[1], qwen_vl_dir, text, [pictures["stripes"]], "stripes span")
    assert outs[2]["output_ids"] == outs[0]["output_ids"] and outs[3]["output_ids"] == outs[1]["output_ids"]
    assert qwen_vl_server.alive()


def test_a_program_and_run_send_image_spans(qwen_vl_spans_server, qwen_vl_dir):
    """``sgl.embeds(rows, image_grid_thw=...)`` in a program, and ``EmbedsEndpoint.run`` with an
    ``Span`` segment that carries its grid: HF's tokens and logprobs, and the same text."""
    text = chat_text(qwen_vl_dir, "what is the color of the object", 1)
    before, after = text.split(IMAGE_PLACEHOLDER)
    image = sample_images()["disc"]
    rows, grid = image_rows(qwen_vl_dir, image)
    backend = EmbedsEndpoint(qwen_vl_spans_server.url)
    assert backend.server_info.vision.merge_size == 2
    # the largest image the checkpoint's processor makes (HF's resize of a huge image), which the
    # span budget is sized to hold
    assert backend.server_info.vision.largest_image_rows == load_encoder(qwen_vl_dir).rows_for(4096, 4096) == 16

    @sgl.function
    def ask_image(s, rows, grid):
        s += before + VISION_START + sgl.embeds(rows, image_grid_thw=grid) + VISION_END + after
        s += sgl.gen("answer", max_tokens=MAX_TOKENS, temperature=0)

    direct = backend.run(input_segments=[Text(before + VISION_START), Span(rows, grid=Grid(grid)),
                                         Text(VISION_END + after)],
                         sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}, return_logprob=True)
    assert_matches_hf(direct, qwen_vl_dir, text, [image], "run")
    state = ask_image.run(rows=rows, grid=grid, backend=backend)
    segments = span_segments(text, [{**helpers.span(rows), "image_grid_thw": list(grid)}])
    assert state["answer"] == program_text(qwen_vl_spans_server, segments, direct)
    with pytest.raises(ValueError, match="image_grid_thw must be"):
        sgl.embeds(rows, image_grid_thw=(1, 4))


def test_input_logprobs_are_null_at_image_rows(qwen_vl_spans_server, qwen_vl_dir):
    text = chat_text(qwen_vl_dir, "what is it", 1)
    span = grid_span(qwen_vl_dir, sample_images()["square"])  # 4 rows
    out = ask(qwen_vl_spans_server, span_segments(text, [span]), logprob_start_len=0)
    entries = out["meta_info"]["input_token_logprobs"]
    start = len(hf_qwen_vl(str(qwen_vl_dir))[1].tokenizer.encode(text.split(IMAGE_PLACEHOLDER)[0] + VISION_START))
    nulls = [i for i, e in enumerate(entries) if e[0] is None and i > 0]
    assert nulls == list(range(start, start + 4)), nulls


def chat_messages_text(checkpoint, messages: list[dict]) -> str:
    """HF's processor's rendering of ``messages`` (image parts as ``{"type": "image"}``)."""
    _, processor = hf_qwen_vl(str(checkpoint))
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def span_part(checkpoint, image) -> dict:
    rows, grid = image_rows(checkpoint, image)
    return {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows), "image_grid_thw": list(grid)}


@pytest.mark.parametrize("earlier_turns", [0, 1], ids=["first-turn", "after-a-turn"])
def test_chat_route_image_parts_equal_hf(qwen_vl_spans_server, qwen_vl_dir, earlier_turns):
    """``/v1/chat/completions`` with ``input_embeds`` parts that carry a grid: the server renders
    each as the chat template renders an image (vision tokens around it), so the prompt ids and
    the answer equal HF's processor and model on the pixels, for two images in one message and
    for an image sent after a turn of chat."""
    pictures = sample_images()
    history = [{"role": "user", "content": "I will show you a picture"}, {"role": "assistant", "content": "ok"}]
    history = history[:2 * earlier_turns]
    images = [pictures["disc"], pictures["square"]] if earlier_turns == 0 else [pictures["stripes"]]
    question = {"type": "text", "text": "which colors do you see"}
    hf_messages = history + [{"role": "user", "content": [{"type": "image"}] * len(images) + [question]}]
    ours = history + [{"role": "user", "content": [span_part(qwen_vl_dir, im) for im in images] + [question]}]
    text = chat_messages_text(qwen_vl_dir, hf_messages)
    res = requests.post(qwen_vl_spans_server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": ours, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": True, "return_token_ids": True})
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    hf_ids = qwen_vl_inputs(qwen_vl_dir, text, images, add_special_tokens=False)["input_ids"][0].tolist()
    assert choice["prompt_token_ids"] == hf_ids  # as HF's processor tokenizes a rendered chat
    reference = assert_matches_hf(helpers.chat_as_generate(res.json()), qwen_vl_dir, text, images, f"chat after {earlier_turns} turn(s)",
                                  add_special_tokens=False)
    other = qwen_vl_greedy(qwen_vl_dir, text, [pictures["checks"]] * len(images), MAX_TOKENS,
                           add_special_tokens=False).tokens
    assert other != reference, "another image must change HF's answer"


def test_a_chat_that_writes_the_image_token_itself_is_a_400(qwen_vl_spans_server, qwen_vl_dir):
    part = span_part(qwen_vl_dir, sample_images()["square"])
    res = requests.post(qwen_vl_spans_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<|image_pad|>"}, part]}]})
    assert res.status_code == 400 and "wrote the pad tokens of [image, image]" in res.json()["message"], res.text


ENGINE_FAMILIES = {"qwen2_5_vl": tiny_qwen2_5_vl_dir, "qwen3_vl": tiny_qwen3_vl_dir, "qwen2_vl": tiny_qwen2_vl_dir}


def _engine_text(checkpoint) -> str:
    return chat_text(checkpoint, "what is the color of the object", 1)


@pytest.fixture(scope="module")
def engine_probes(servers) -> dict:
    """``tests/engine_probe.py``'s results on an engine of each Qwen-VL family whose vision
    weights are NaN, by family: a child process per family, all at once (each a first launch in
    its process, so its scheduler is forked, not spawned)."""
    servers.make_room(len(ENGINE_FAMILIES))  # the children's engines
    script = Path(__file__).parents[1] / "engine_probe.py"

    def probe(make) -> dict:
        triple = [str(arg) for arg in (poisoned_vision_dir(make()), make(), _engine_text(make()))]
        done = zygote.run([str(script), *triple], cpu_env(), timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(len(ENGINE_FAMILIES)) as pool:
        results = list(pool.map(probe, ENGINE_FAMILIES.values()))
    return {family: by_family[family] for by_family in results for family in by_family}


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_the_engine_serves_image_spans_as_tensors(family, engine_probes):
    """``sglang.Engine.generate(input_segments=...)`` with a grid span given as a torch tensor
    (two images, a clip), on an engine of each Qwen-VL family whose vision weights are NaN:
    HF's tokens and logprobs, a repeat cached, a bad grid a ``ValueError``."""
    checkpoint = ENGINE_FAMILIES[family]()
    text = _engine_text(checkpoint)
    probe = engine_probes[family]
    frames, width, height, seed, fps = engine_probe.CLIPS[family]
    clip = (sample_clip(frames, width, height, seed=seed), fps)
    for name in ("stripes", "disc", "clip"):
        res = probe[name]
        out = {"output_ids": res["ids"], "meta_info": res["meta_info"]}
        if name == "clip":
            assert_matches_hf(out, checkpoint, text.replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER), [],
                              f"{family} engine, a clip", clips=[clip])
        else:
            assert_matches_hf(out, checkpoint, text, [sample_images()[name]], f"{family} engine, {name}")
        assert res["again_ids"] == res["ids"] and res["cached"] == res["prompt"] - 1
    assert probe["stripes"]["ids"] != probe["disc"]["ids"]
    assert "makes t*h*w/merge**2 = 1 rows" in probe["bad_grid"], probe["bad_grid"]


# The workers behind smg, by family: Qwen2.5-VL's two servers (the cache-aware policy picks between
# them), each other family's pooled span server alone (no server started for the gateway)
GATEWAY_WORKERS = {"qwen_vl_spans": ("qwen_vl_spans", "qwen_vl"), "qwen3_vl_spans": ("qwen3_vl_spans",),
                   "qwen2_vl_spans": ("qwen2_vl_spans",)}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.pooled(*workers))
                                        for name, workers in GATEWAY_WORKERS.items()])
def family_gateway(request, servers):
    """(checkpoint, smg (cache-aware) in front of the family's servers, its clip sizes and seed):
    spans are served alike by either worker, since neither runs its tower on them."""
    make, sizes, seed = CLIP_FAMILIES[request.param]
    gw = Gateway([server.url for server in servers.get(*GATEWAY_WORKERS[request.param])]).start()
    yield make(), gw, sizes, seed
    gw.stop()


def test_image_spans_through_the_gateway_equal_hf_and_repeat_on_their_worker(family_gateway):
    """Each Qwen-VL family (Qwen3-VL's spans with their deepstack rows) behind smg:
    ``/generate`` segments (the routing hint covers rows and grid), the chat route with grid
    parts, and a program through ``EmbedsEndpoint`` (its own hint): HF's tokens and logprobs
    behind the gateway, and a repeat lands where its prefix is cached; a clip likewise."""
    # the clip: the family's second size (the first, with the same seed, is the clip of
    # test_qwen_vl_video's program test, which counts the spans the server newly holds)
    checkpoint, gateway, (_, (clip_width, clip_height)), clip_seed = family_gateway
    text = chat_text(checkpoint, "what is the color of the object", 1)
    image = sample_images()["disc"]
    span = grid_span(checkpoint, image)
    segments = span_segments(text, [span])
    rows = wire.decode_tensor(span["embeds"])
    before, after = text.split(IMAGE_PLACEHOLDER)
    hint = keys.routing_text([Text(before + VISION_START), Span(rows, grid=Grid(span["image_grid_thw"])),
                              Text(VISION_END + after)])
    t, h, w = span["image_grid_thw"]  # the hint written out: the rows, the grid, the tag
    assert hint == (before + VISION_START + keys.route_rows(rows) + f"<{t}x{h}x{w}>" + VISION_END + after
                    + keys.ROUTE_TAG)
    def through(payload: dict) -> dict:
        res = requests.post(gateway.url + "/generate", json=payload, timeout=120)
        assert res.status_code == 200, res.text
        return res.json()

    first = through({**helpers.body(segments, MAX_TOKENS, return_logprob=True), "text": hint})
    assert_matches_hf(first, checkpoint, text, [image], "through the gateway")
    again = through({**helpers.body(segments, MAX_TOKENS), "text": hint})
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1

    model = requests.get(gateway.worker_urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
    chat = requests.post(gateway.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "messages": [
            {"role": "user", "content": [span_part(checkpoint, image),
                                         {"type": "text", "text": "what is the color of the object"}]}]})
    assert chat.status_code == 200, chat.text
    hf_chat = qwen_vl_greedy(checkpoint, text, [image], MAX_TOKENS, add_special_tokens=False).tokens
    assert chat.json()["choices"][0]["response_token_ids"] == hf_chat

    backend = EmbedsEndpoint(gateway.url)
    run = backend.run(input_segments=[Text(before + VISION_START), Span(rows, grid=Grid(span["image_grid_thw"])),
                                      Text(VISION_END + after)], sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS})
    assert run["output_ids"] == first["output_ids"]

    # a clip, by EmbedsEndpoint (binary body, held, by handle the second time) through the gateway
    clip_text = text.replace(IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)
    frames = sample_clip(4, clip_width, clip_height, seed=clip_seed)
    clip_rows_, fields = clip_rows(checkpoint, frames, 2.0)
    clip_before, clip_after = clip_text.split(VIDEO_PLACEHOLDER)
    clip_segments = [Text(clip_before + VISION_START), Span(clip_rows_, grid=Grid.of_fields(fields)),
                     Text(VISION_END + clip_after)]
    answers = [backend.run(input_segments=clip_segments, **helpers.OUTPUT_LOGPROBS,
                           sampling_params={**helpers.GREEDY, "max_new_tokens": MAX_TOKENS}) for _ in range(2)]
    assert_matches_hf(answers[0], checkpoint, clip_text, [], "a clip through the gateway", clips=[(frames, 2.0)])
    assert answers[1]["output_ids"] == answers[0]["output_ids"]
    assert answers[1]["meta_info"]["cached_tokens"] == answers[1]["meta_info"]["prompt_tokens"] - 1


def test_a_program_with_the_client_vision_half_sees_the_image_a_box_and_a_mask(qwen_vl_spans_server, qwen_vl_dir):
    """``EmbedsEndpoint(vision_encoder=load_encoder(QWEN_DIR))``: ``sgl.image(img)``,
    ``sgl.region(box, img)`` and ``sgl.region(mask, img)`` between the vision tokens answer as
    HF does on the image, the crop and the masked crop (outside the mask: the processor's mean
    colour), through the program and through ``/generate`` with the encoder's rows."""
    encoder = load_encoder(qwen_vl_dir, device="cpu")
    backend = EmbedsEndpoint(qwen_vl_spans_server.url, vision_encoder=encoder)
    text = chat_text(qwen_vl_dir, "what is the color of the object", 1)
    before, after = text.split(IMAGE_PLACEHOLDER)
    image = sample_images()["disc"]
    mask = np.zeros((image.height, image.width), dtype=bool)
    mask[20:70, 10:50] = True
    mask[30:60, 20:40] = False  # a ring: not a box
    regions = {"image": None, "box": (8, 16, 56, 80), "mask": mask}

    ask_about = image_program(before, after, encoder)

    references = {}
    for name, region in regions.items():
        seen = vision.region_image(image, region, encoder)  # what HF is shown
        encoded = encoder(seen)
        span = {**helpers.span(encoded.rows), **encoded.grid.fields()}
        direct = ask(qwen_vl_spans_server, span_segments(text, [span]))
        references[name] = assert_matches_hf(direct, qwen_vl_dir, text, [seen], f"client encoder, {name}")
        state = ask_about.run(image=image, region=region, backend=backend)
        assert state["answer"] == program_text(qwen_vl_spans_server, span_segments(text, [span]), direct), name
    assert len({tuple(r) for r in references.values()}) == 3, f"the region must change HF: {references}"


def test_retraction_keeps_image_span_outputs_identical(qwen_vl_spans_server, qwen_vl_dir):
    """8 concurrent image-span requests of ~50 positions + 60 new tokens each need far more than
    the server's 256 KV positions: the scheduler retracts some and prefills them again later
    (their image items too); every output equals the same request served alone, which is HF's
    on the pixels over all 60 tokens. Whether it retracts depends on how the requests arrive:
    each attempt must be identical, one must retract."""
    pictures = list(sample_images().values())
    questions = ["what is the color of the object", "describe it in a few words"]
    asked = [(chat_text(qwen_vl_dir, questions[i // 4], 1), pictures[i % 4]) for i in range(8)]
    bodies = [helpers.body(span_segments(text, [grid_span(qwen_vl_dir, image)]), RETRACTED_TOKENS, return_logprob=True)
              for text, image in asked]
    alone = [helpers.generate(qwen_vl_spans_server, b) for b in bodies]
    for (text, image), out in zip(asked, alone):
        assert_matches_hf(out, qwen_vl_dir, text, [image], "served alone", max_new_tokens=RETRACTED_TOKENS)
    want = [out["output_ids"] for out in alone]
    assert len({tuple(w) for w in want}) == 8
    retracted, attempts = 0, 0
    while retracted == 0 and attempts < 3:
        requests.post(qwen_vl_spans_server.url + "/flush_cache", timeout=60)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda b: helpers.generate(qwen_vl_spans_server, b), bodies))
        assert [g["output_ids"] for g in got] == want
        retracted = sum(g["meta_info"].get("num_retractions", 0) for g in got)
        attempts += 1
    assert retracted > 0, f"the KV pool was meant to force retraction ({attempts} attempts)"
