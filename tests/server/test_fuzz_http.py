"""Hostile input over HTTP, never a 5xx: a 200 with a well-formed answer, or a 4xx with an error
body, and a live server that answers a good request as HF does afterwards.

Three fuzzers, on a server of every family served (``helpers.FAMILY_SERVERS``): random span
fields (payloads well-formed or not) on /generate and the OpenAI routes; random prompts:
interleavings of text, ids (the vision start, end and pad ids included), spans with and without
image and clip grids, spans by handle, and (off the natively served VLMs) spans attended as a
block or given a bad ``attention``, sent as JSON or as a binary body on /generate,
/v1/completions and /v1/chat/completions, their outcomes counted (some served, some refused, the
grid, clip and attention checks reached); and judged prompts, each built valid or with one named
fault (``strategies.judged_prompts``), whose outcome is known before it is sent: every valid one
served (on the plain Llama, HF's token and logprob), every faulty one a 400 naming its fault,
each of the family's faults in every example.

CI runs a fixed, derandomized set of examples (the random prompts from a set seed, the same stream
alone and in the full suite: tests/conftest.py); ``SGLANG_EMBEDS_FUZZ_EXAMPLES=N``
runs N random ones per fuzzer and server and prints the counts (``scripts/fuzz_long.sh``)."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import sglang as sgl

import helpers
import sgl_embeds
from llava_harness import LlavaHarness
from qwen_vl_harness import ask, assert_matches_hf, chat_text, grid_span, span_segments
from sgl_embeds.vlm import image_prompt
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.gemma3 import tiny_gemma3_dir
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir
from sgl_embeds_testing.paligemma import tiny_paligemma_dir
from sgl_embeds_testing.qwen_vl import (sample_images, tiny_qwen2_5_vl_dir, tiny_qwen2_vl_dir, tiny_qwen3_5_dir,
                                         tiny_qwen3_5_moe_dir, tiny_qwen3_vl_dir)
from sgl_embeds_protocol import binary_body, wire
from sgl_embeds_protocol.segments import ATTENTION, BIDIRECTIONAL, GRID_FIELDS, IMAGE_GRID, VIDEO_GRID
from strategies import HELD_ROWS, faults_of, judged_prompts, payloads, prompts

pytestmark = pytest.mark.per_server  # each family's tests where its server runs anyway
LONG = int(os.environ.get("SGLANG_EMBEDS_FUZZ_EXAMPLES", "0"))  # 0: the CI run
PAYLOAD_EXAMPLES, PROMPT_EXAMPLES, JUDGED_EXAMPLES = (LONG, LONG, LONG) if LONG else (24, 50, 3)
VALID_PER_EXAMPLE = 4  # and one prompt with each fault of the family
# the random prompts' stream in CI (a long run: random), a function of the seed and strategies.py
# alone (tests/conftest.py): seed 3's reaches a grid refusal and a clip-time refusal on every kind
# of M-RoPE server (measured; 1 or 2 clip-time refusals each, so an edit to the strategies may need
# another seed: the reach assertions say so). SGLANG_EMBEDS_FUZZ_SEED tries another
FIXED_PROMPTS = seed(int(os.environ.get("SGLANG_EMBEDS_FUZZ_SEED", "3"))) if not LONG else (lambda test: test)
FUZZ = dict(deadline=None, database=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ONE_TOKEN = {"max_new_tokens": 1}

ROUTES = {
    "/generate": lambda p: {"input_segments": [{"type": "text", "text": "a"}, {"type": "embeds", "embeds": p}], "sampling_params": ONE_TOKEN},
    "/generate#full": lambda p: {"input_embeds": p, "sampling_params": ONE_TOKEN},
    "/v1/completions": lambda p: {"model": "default", "prompt": "", "max_tokens": 1, "input_embeds": p},
    "/v1/chat/completions": lambda p: {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "input_embeds", "input_embeds": p}]}]},
}


def _chat_parts(segments: list[dict]) -> list[dict]:
    """A prompt's text and spans as chat content parts (a chat has no ids parts: they are left out)."""
    parts = [{"type": "text", "text": s["text"]} if s["type"] == "text"
             else {"type": "input_embeds", "input_embeds": s["embeds"],
                   **{k: s[k] for k in (*GRID_FIELDS, ATTENTION) if k in s}}
             for s in segments if s["type"] != "input_ids"]
    return parts or [{"type": "text", "text": "a"}]


PROMPT_ROUTES = {
    "/generate": lambda segments: {"input_segments": segments, "sampling_params": ONE_TOKEN},
    "/v1/completions": lambda segments: {"model": "default", "prompt": "", "max_tokens": 1, "input_segments": segments},
    "/v1/chat/completions": lambda segments: {"model": "default", "max_tokens": 1, "messages": [
        {"role": "user", "content": _chat_parts(segments)}]},
}
# A phrase of each check's refusal (segments.Grid, image_spans.check_grid_span and check_vision_ids,
# parse, prompts) -> the check, to count which checks the fuzzed prompts reached
CHECKS = {
    "rows (merge size": "grid rows",
    "a clip on ": "clip time",
    "a finite number of seconds": "clip time",
    "one time in seconds": "clip time",
    "an image's grid has t = 1": "image t = 1",
    "of positive ints": "grid form",
    "multiples of the merge size": "grid sides",
    "are a clip's time": "time without a clip",
    "must follow the vision-start token": "vision start",
    "must be followed by the vision-end token": "vision end",
    "outside a grid span": "pad outside a span",
    "places rows at 1-D positions": "grid on a 1-D model",
    "give the span its": "span without a grid",
    "unknown span handle": "unknown handle",
    "outside the vocabulary": "ids",
    "attention must be": "attention value",
    "cannot be served here": "block refused",
    "a block is prefilled in one step": "block too long",
}
OUTCOMES: dict[str, Counter] = {name: Counter() for name in helpers.FAMILY_SERVERS}


def _post(server, route: str, body: dict, binary: bool = False) -> requests.Response:
    """``body`` (its spans tensors or wire objects) as a binary body, or as JSON: Python's json
    writes NaN / Infinity as bare tokens (not JSON, but what a careless client sends)."""
    if binary:
        data, content_type = binary_body.encode_body(body)
    else:
        data, content_type = json.dumps(binary_body.json_form(body), allow_nan=True).encode(), "application/json"
    return requests.post(server.url + route.split("#")[0], data=data, headers={"content-type": content_type},
                         timeout=120)


def _assert_an_error_body(r: requests.Response, context) -> str:
    assert 400 <= r.status_code < 500, (context, r.status_code, r.text[:300])
    message = helpers.error_message(r)
    assert message, (context, r.text[:300])
    return message


@pytest.fixture(scope="module", params=helpers.pooled(helpers.FAMILY_SERVERS))
def server_name(request):
    """A family's server: each runs this module's tests one after the other (pytest groups them)."""
    return request.param


@settings(max_examples=PAYLOAD_EXAMPLES, **FUZZ)
@given(data=st.data())
def test_random_span_fields_never_cause_a_server_error(servers, server_name, data):
    server = servers.get(server_name)[0]
    route = data.draw(st.sampled_from(sorted(ROUTES)), "route")
    r = _post(server, route, ROUTES[route](data.draw(payloads, "payload")))
    if r.status_code != 200:
        _assert_an_error_body(r, route)


@pytest.fixture
def served(servers, server_name):
    """(the server, its /sgl_embeds/info, the handle of a span of ``HELD_ROWS`` rows it holds)."""
    server = servers.get(server_name)[0]
    info = requests.get(server.url + "/sgl_embeds/info", timeout=30).json()
    return server, info, _hold(server, info)[1]


def _hold(server, info: dict) -> tuple[torch.Tensor, str]:
    """The rows of the span the fuzzed server holds, uploaded (again), and its handle."""
    rows = helpers.seeded_rows(5, HELD_ROWS, info["span_width"])
    up = requests.post(server.url + "/sgl_embeds/spans", json={"embeds": wire.encode_tensor(rows)}, timeout=60)
    assert up.status_code == 200, up.text
    return rows, up.json()["handle"]


def _kinds(segments: list[dict]) -> set[str]:
    """What spans a prompt holds: "image", "clip", "span" (no grid), "handle", "block"
    (bidirectional)."""
    kinds = set()
    for s in segments:
        if s["type"] == "embeds":
            kinds.add("image" if IMAGE_GRID in s else "clip" if VIDEO_GRID in s else "span")
            if isinstance(s["embeds"], dict):
                kinds.add("handle")
            if s.get(ATTENTION) == BIDIRECTIONAL:
                kinds.add("block")
    return kinds


def _assert_well_formed(route: str, answer: dict, vocab: int) -> None:
    """A 200's answer: one new token of the vocabulary, and the prompt's length."""
    if route == "/generate":
        assert isinstance(answer["text"], str) and answer["meta_info"]["prompt_tokens"] > 0, answer
        assert len(answer["output_ids"]) == 1 and 0 <= answer["output_ids"][0] < vocab, answer
    else:
        choice = answer["choices"][0]
        assert isinstance(choice["text"] if route == "/v1/completions" else choice["message"]["content"], str), answer
        assert answer["usage"]["prompt_tokens"] > 0 and answer["usage"]["completion_tokens"] == 1, answer


@settings(max_examples=PROMPT_EXAMPLES, **FUZZ)
@FIXED_PROMPTS
@given(data=st.data())
def test_random_prompts_never_cause_a_server_error(served, server_name, data):
    server, info, handle = served
    _hold(server, info)  # again: a held span let go since (the server's store is shared) hides deeper checks
    segments = data.draw(prompts(info, handle), "segments")
    route = data.draw(st.sampled_from(sorted(PROMPT_ROUTES)), "route")
    binary = data.draw(st.booleans(), "binary")
    r = _post(server, route, PROMPT_ROUTES[route](segments), binary)
    outcomes = OUTCOMES[server_name]
    if r.status_code == 200:
        _assert_well_formed(route, r.json(), info["vocab_size"])
        outcomes.update(["200", *(f"200 {kind}" for kind in _kinds(segments))])
    else:
        message = _assert_an_error_body(r, (route, binary, segments))
        outcomes.update(["4xx", *{f"4xx {check}" for phrase, check in CHECKS.items() if phrase in message}])


# The judged fuzzer's routes: those that take the segments as they are (a chat writes its own text
# around its parts, so a prompt built valid there is another thing; the chat route is fuzzed above)
JUDGED_ROUTES = ("/generate", "/v1/completions")
VERDICTS: dict[str, Counter] = {name: Counter() for name in helpers.FAMILY_SERVERS}
HF_CHECKED = ("llama",)  # where HF's answer to each valid prompt is cheap: a plain Llama, rows as they are


def _assert_hf_answers(server, segments: list[dict], held: torch.Tensor, answer: dict) -> None:
    """The one token served for a valid prompt is HF's greedy one (a near tie where ours is HF's
    runner-up forgiven and counted) and its logprob HF's number."""
    rows, blocks = [], []
    position = 0
    for i, s in enumerate(segments):
        if s["type"] == "text":
            part = ref.text_embeds(server.model_dir, s["text"], first=i == 0)
        elif s["type"] == "input_ids":
            part = ref.embed_ids(server.model_dir, s["input_ids"])
        else:
            part = held if isinstance(s["embeds"], dict) else s["embeds"].float()
            if s.get(ATTENTION) == BIDIRECTIONAL:
                blocks.append((position, position + part.shape[0]))
        rows.append(part)
        position += part.shape[0]
    reference = ref.greedy_after(server.model_dir, torch.cat(rows), 1, blocks=blocks)
    (token,), ((logprob, _, _),) = answer["output_ids"], answer["meta_info"]["output_token_logprobs"]
    hf = reference.distributions[0]
    assert abs(logprob - float(hf[token])) <= ref.LOGPROB_TOL, (segments, logprob, float(hf[token]))
    if token != reference.tokens[0]:
        assert reference.gaps[0] < ref.NEAR_TIE and token == reference.runner_ups[0], (token, reference)
        ref.FORGIVEN.append(f"fuzzed prompt {segments}")


@settings(max_examples=JUDGED_EXAMPLES, **FUZZ)
@given(data=st.data())
def test_prompts_built_valid_are_served_and_built_faulty_are_refused_naming_the_fault(served, server_name, data):
    """Each prompt has its verdict before it is sent (``strategies.judged_prompts``): one built
    valid must be served (200, on the plain Llama HF's token and logprob), one built with a single
    fault must be a 400 whose message names that fault. Each example builds ``VALID_PER_EXAMPLE``
    valid prompts and one with each of the family's faults."""
    server, info, handle = served
    held, again = _hold(server, info)  # held again, should it have gone
    assert again == handle
    for fault in [None] * VALID_PER_EXAMPLE + sorted(faults_of(info)):
        segments, verdict = data.draw(judged_prompts(info, handle, fault), f"prompt ({fault or 'valid'})")
        route = data.draw(st.sampled_from(JUDGED_ROUTES), "route")
        binary = data.draw(st.booleans(), "binary")
        body = PROMPT_ROUTES[route](segments)
        check_hf = verdict.refusal is None and route == "/generate" and server_name in HF_CHECKED
        if check_hf:
            body = {**body, **helpers.OUTPUT_LOGPROBS, "sampling_params": {**ONE_TOKEN, **helpers.GREEDY}}
        r = _post(server, route, body, binary)
        if verdict.refusal is None:
            assert r.status_code == 200, (route, binary, segments, r.text[:500])
            _assert_well_formed(route, r.json(), info["vocab_size"])
            if check_hf:
                _assert_hf_answers(server, segments, held, r.json())
            VERDICTS[server_name].update(["served", *(["served, HF's answer"] if check_hf else [])])
        else:
            message = _assert_an_error_body(r, (route, binary, verdict, segments))
            assert r.status_code == 400 and verdict.refusal in message, (verdict, route, binary, message, segments)
            VERDICTS[server_name].update(["refused", f"refused: {verdict.fault}"])


# The checkpoints of the natively served VLMs' servers (theirs with NaN vision towers)
QWEN_VL_CHECKPOINTS = {"qwen_vl_spans": tiny_qwen2_5_vl_dir, "qwen3_vl_spans": tiny_qwen3_vl_dir,
                       "qwen2_vl_spans": tiny_qwen2_vl_dir, "qwen3_5": tiny_qwen3_5_dir,
                       "qwen3_5_moe": tiny_qwen3_5_moe_dir}
# The split LLaVA servers -> their checkpoint's name in the ``llava_dirs`` fixture
LLAVA_SERVERS = {"llava_llama": "llama", "llava_next": "llava_next", "llava_onevision": "llava_onevision"}
# What the fuzzed prompts must have reached, beyond some 200s and some 4xx, each one of some
# outcomes: on the M-RoPE VLMs served images and clips, a grid check's refusal and a clip's time
# check's; elsewhere served spans and the refusal of a grid
GRID_CHECKS = ("4xx grid rows", "4xx grid form", "4xx grid sides", "4xx image t = 1")
REACHED = {name: [("200 image",), ("200 clip",), GRID_CHECKS, ("4xx clip time",)] for name in QWEN_VL_CHECKPOINTS}
# and the attention field: a block served or a bad value refused. Either, not both: whether a
# drawn block is served depends on the prompt's other spans (a held handle the server may have let
# go earlier in the suite is refused), so a fixed stream may serve none; blocks served are
# tested outright in tests/server/test_bidirectional_spans.py. (PaliGemma: every prompt a block.)
ATTENTION_REACHED = ("200 block", "4xx attention value")
REACHED_1D = [("200 span",), ("4xx grid on a 1-D model",), ATTENTION_REACHED]


@dataclass(frozen=True)
class SplitGemma:
    """A split Gemma family's server after the fuzzing: the question it is asked (``question(backend)``:
    the prompt HF is given) and HF's checkpoint, greedy and model loader."""

    question: Callable
    checkpoint: Callable
    greedy: Callable
    hf: Callable


def _chat_question(backend) -> str:
    return helpers.image_chat(backend, "What is in the image?", 1)


SPLIT_GEMMAS = {
    "paligemma": SplitGemma(lambda backend: "caption en", lambda: tiny_paligemma_dir(1), ref.paligemma_greedy,
                            ref.hf_paligemma),
    "gemma3_vlm": SplitGemma(_chat_question, tiny_gemma3_dir, ref.gemma3_greedy, ref.hf_gemma3),
    "gemma4_vlm": SplitGemma(_chat_question, lambda: tiny_gemma4_dir("e2b"), ref.gemma4_greedy, ref.hf_gemma4),
    "gemma4_31b_vlm": SplitGemma(_chat_question, lambda: tiny_gemma4_dir("31b"), ref.gemma4_greedy, ref.hf_gemma4),
}


@sgl.function
def ask_about(s, text, image, image_token):
    s += image_prompt(text, [image], image_token)
    s += sgl.gen("answer", max_tokens=8, temperature=0)


def _answers_like_hf(name: str, server, llava_dirs) -> None:
    """One good span prompt: the server's answer (tokens and logprobs) equals HF's."""
    image = sample_images()["square"]
    if name in QWEN_VL_CHECKPOINTS:
        checkpoint = QWEN_VL_CHECKPOINTS[name]()
        text = chat_text(checkpoint, "what is the color of the object", 1)
        assert_matches_hf(ask(server, span_segments(text, [grid_span(checkpoint, image)])), checkpoint, text,
                          [image], name)
    elif name in SPLIT_GEMMAS:
        backend, gemma = sgl_embeds.connect(server.url), SPLIT_GEMMAS[name]
        question = gemma.question(backend)
        text = backend.vision_encoder.prompt_text(question, 1)
        out = backend.run(input_segments=sgl_embeds.compile_program(ask_about, like=backend, text=text, image=image,
                                                                          image_token=backend.vision_encoder.image_token)[0],
                          return_logprob=True, top_logprobs_num=ref.TOP_K,
                          sampling_params={**helpers.GREEDY, "max_new_tokens": 8})
        checkpoint = gemma.checkpoint()
        ref.assert_vlm_matches_hf(out, lambda prefix=(): gemma.greedy(checkpoint, question, [image], 8, prefix),
                                  ref.eos_ids(gemma.hf(str(checkpoint))[0]), f"{name}: ", 6, min_distinct=2)
    elif name in LLAVA_SERVERS:
        harness = LlavaHarness(name, *llava_dirs(LLAVA_SERVERS[name]), server)
        text = harness.text("what is the color of the object")
        harness.check(harness.generate(text, [image]), text, [image], name)
    else:
        rows = helpers.seeded_rows(11, 6)
        out = helpers.generate(server, helpers.body([helpers.text("the fox"), helpers.span(rows)], 8,
                                                    **helpers.OUTPUT_LOGPROBS))
        embeds = [helpers.reference_embeds(server.model_dir, ["the fox", r]) for r in (rows, rows.flip(0))]
        ref.assert_matches_hf(out, server.model_dir, embeds[0], 8, name, other_span_embeds=embeds[1])


def test_the_server_still_serves_after_the_fuzzing(servers, server_name, llava_dirs, request):
    server = servers.get(server_name)[0]
    outcomes = OUTCOMES[server_name]
    counts = f"fuzz {server_name}: {PROMPT_EXAMPLES} prompts: {dict(sorted(outcomes.items()))}"
    print(counts)
    request.config.stash.setdefault(helpers.SUMMARY_LINES, []).append(counts)
    assert outcomes["200"] + outcomes["4xx"] == PROMPT_EXAMPLES, outcomes  # each sent, and answered
    assert min(outcomes["200"], outcomes["4xx"]) >= PROMPT_EXAMPLES // 8, outcomes
    missed = [any_of for any_of in REACHED.get(server_name, REACHED_1D) if not set(any_of) & set(outcomes)]
    assert not missed, f"no fuzzed prompt reached any of {missed}: {outcomes}"
    verdicts = VERDICTS[server_name]
    faults = faults_of(requests.get(server.url + "/sgl_embeds/info", timeout=30).json())
    judged = f"judged {server_name}: {JUDGED_EXAMPLES} x ({VALID_PER_EXAMPLE} valid + {len(faults)} faults): "
    judged += str(dict(sorted(verdicts.items())))
    print(judged)
    request.config.stash.setdefault(helpers.SUMMARY_LINES, []).append(judged)
    # each prompt as judged: the valid ones served, each fault refused naming it
    assert verdicts["served"] == JUDGED_EXAMPLES * VALID_PER_EXAMPLE, verdicts
    assert all(verdicts[f"refused: {fault}"] == JUDGED_EXAMPLES for fault in faults), verdicts
    assert server.alive() and requests.get(server.url + "/health", timeout=10).status_code == 200
    _answers_like_hf(server_name, server, llava_dirs)
