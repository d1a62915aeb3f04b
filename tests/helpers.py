"""Small request builders shared by the server tests."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import pytest
import requests
import sglang as sgl
import torch
from PIL import Image

from sgl_embeds_protocol import wire
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.server import Server, cpu_env

GREEDY = {"temperature": 0.0}
# A pooled server of each family served (tests/conftest.py): a text LLM, the Qwen-VL families served
# natively (Qwen2.5-VL, Qwen3-VL, Qwen2-VL; NaN vision towers), a split LLaVA-NeXT's LLM, and the
# split Gemmas (PaliGemma, Gemma 3, Gemma 4's E2B layout)
FAMILY_SERVERS = ("llama", "qwen_vl_spans", "qwen3_vl_spans", "qwen2_vl_spans", "qwen3_5", "qwen3_5_moe",
                  "llava_llama", "llava_next", "llava_onevision", "paligemma", "gemma3_vlm", "gemma4_vlm",
                  "gemma4_31b_vlm")
# lines a test leaves for the run's closing summary (conftest.py), e.g. each family's fuzz counts
SUMMARY_LINES = pytest.StashKey[list]()
# what a /generate body asks for to have its numbers compared with HF (ref.assert_matches_hf):
# output logprobs with top-3 maps, and with LOGPROBS the input logprobs of every position too
# (SGLang then recomputes the whole prompt: no prefix-cache hit)
OUTPUT_LOGPROBS = {"return_logprob": True, "top_logprobs_num": ref.TOP_K}
LOGPROBS = {**OUTPUT_LOGPROBS, "logprob_start_len": 0}


def seeded_rows(seed: int, n: int, hidden: int = 64, scale: float = 0.05) -> torch.Tensor:
    """A reproducible span of ``n`` random rows, at the scale of the tiny models' embeddings."""
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * scale


def random_image(w: int, h: int, seed: int = 0) -> Image.Image:
    """An RGB image of uniform noise: every pixel a resize or crop gets wrong shows."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def chat_as_generate(response: dict) -> dict:
    """A chat completion sent with ``logprobs`` and ``return_token_ids`` in the shape of a
    ``/generate`` response (ids and output logprobs), for ``ref.assert_matches_hf``."""
    choice = response["choices"][0]
    logprobs, ids = [e["logprob"] for e in choice["logprobs"]["content"]], choice["response_token_ids"]
    assert len(logprobs) == len(ids), f"{len(logprobs)} logprobs for {len(ids)} tokens"
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)]}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def span(x: torch.Tensor, fmt: str = "base64", dtype: str | None = None) -> dict:
    return {"type": "embeds", "embeds": wire.encode_tensor(x, fmt, dtype)}


def body(segments: list, max_new_tokens: int = 8, **extra) -> dict:
    return {"input_segments": segments, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}, **extra}


def error_message(r) -> str:
    """The message of an error response: SGLang's ``{"message": ...}`` or OpenAI's ``{"error": {"message": ...}}``."""
    payload = r.json()
    error = payload.get("error")
    return payload.get("message") or (error.get("message", "") if isinstance(error, dict) else error or "")


def generate(server, payload: dict) -> dict:
    r = server.generate(payload)
    assert r.status_code == 200, r.text
    return r.json()


reference_embeds = ref.prompt_embeds


def with_other_spans(parts: list, seed: int = 1000) -> list:
    """The same prompt parts with every span replaced by other random rows of the same shape."""
    return [p if isinstance(p, str) else seeded_rows(seed + i, p.shape[0], p.shape[1]) for i, p in enumerate(parts)]


def to_segments(parts: list, fmt: str = "base64") -> list:
    return [text(p) if isinstance(p, str) else span(p, fmt) for p in parts]


def hf_select_scores(model_dir, parts: list, suffix: str, choices: list[str]) -> list[float]:
    """HF's score of each choice after ``parts`` + ``suffix``: the token-length-normalized logprob
    of the choice's tokens, as SGLang's ``select`` computes it (the suffix's trailing space
    belongs to the choice's first token, as the tokenizer merges it)."""
    tok, model = ref.hf_tokenizer(str(model_dir)), ref.hf_model(str(model_dir))
    prefix = reference_embeds(model_dir, parts)
    n_pre = prefix.shape[0] + len(tok.encode(suffix.rstrip(" "), add_special_tokens=False))
    scores = []
    for c in choices:
        ids = tok.encode(suffix + c, add_special_tokens=False)
        full = torch.cat([prefix, ref.embed_ids(model_dir, ids)])
        with torch.no_grad():
            logp = model(inputs_embeds=full.unsqueeze(0)).logits[0].log_softmax(-1)
        tail = ids[len(ids) - (full.shape[0] - n_pre):]
        lps = [logp[p - 1, t].item() for p, t in zip(range(n_pre, full.shape[0]), tail)]
        scores.append(sum(lps) / len(lps))
    return scores


def assert_select_scores(state, name: str, hf_scores: list[float], context: str = "") -> list[float]:
    """A program's ``select`` by its numbers: each choice's normalized logprob equals HF's within
    ``ref.LOGPROB_TOL``, and the choice made is HF's best. Returns our scores."""
    ours = state.get_meta_info(name)["normalized_prompt_logprobs"]
    worst = max(abs(a - b) for a, b in zip(ours, hf_scores))
    assert len(ours) == len(hf_scores) and worst <= ref.LOGPROB_TOL, f"{context}select scores {ours} vs HF {hf_scores}"
    assert ours.index(max(ours)) == hf_scores.index(max(hf_scores)), f"{context}{ours} vs {hf_scores}"
    return ours


def start_multi_tokenizer(model_dir, extra_args: list[str], workers: int = 2):
    """A server of ``model_dir`` in multi-tokenizer mode (``--tokenizer-worker-num``), returned
    once every HTTP worker has registered (the server says it is ready after the first)."""
    # On a busy 2-core machine a worker's import can outlast uvicorn's 10 s health check of its
    # workers, which then replaces it: give it time.
    server = Server(model_dir, extra_args=["--tokenizer-worker-num", str(workers), *extra_args],
                    env={"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "120"}).start()
    deadline = time.monotonic() + 180
    while f"(total: {workers})" not in server.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline or not server.alive():
            server.stop()
            raise AssertionError(server.log_tail())
        time.sleep(0.5)
    return server


CHILD_TIMEOUT_S = 180


def run_with_changed_sglang(tmp_path, change: str, then: str) -> subprocess.CompletedProcess:
    """``then`` in a child Python whose first lines are ``change`` (written to a file, as SGLang's
    code is, so its source can be read): how a changed SGLang is seen where a user would see it."""
    (tmp_path / "changed_sglang.py").write_text(change)
    script = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport changed_sglang\n{then}"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cpu_env(),
                          timeout=CHILD_TIMEOUT_S, start_new_session=True)


def pooled(names, server_of=None) -> list:
    """Parameters naming servers of the session's pool, each marked ``pooled`` with the server it
    asks for (``server_of(name)``; default: the name itself), so the pool starts it early and
    keeps it for the test (tests/conftest.py)."""
    return [pytest.param(name, marks=pytest.mark.pooled((server_of or str)(name))) for name in names]


def assert_retraction_keeps_outputs(roomy, constrained, prompts_of: Callable[[int], list],
                                    matches_hf: Callable[[list, dict], object], max_new_tokens: int = 40) -> None:
    """The prompts ``prompts_of(attempt)`` (segment lists) sent at once to the ``constrained``
    server (a KV pool too small for them all) give what ``roomy`` gives each alone, which is HF's
    answer over all ``max_new_tokens`` (``matches_hf(segments, out)``, ``out`` sent with output
    logprobs), and the pool retracted one. Whether it retracts depends on how the requests arrive
    (on a slow machine they can come in waves that fit): every attempt must give equal outputs,
    and one of at most 4 must retract."""
    retracted, attempts = 0, 0
    while retracted == 0 and attempts < 4:
        prompts = prompts_of(attempts)
        alone = [generate(roomy, body(p, max_new_tokens, **OUTPUT_LOGPROBS)) for p in prompts]
        for p, out in zip(prompts, alone):
            matches_hf(p, out)
        requests.post(constrained.url + "/flush_cache", timeout=60)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate(constrained, body(p, max_new_tokens)), prompts))
        assert [g["output_ids"] for g in got] == [out["output_ids"] for out in alone]
        retracted = sum(g["meta_info"].get("num_retractions", 0) for g in got)
        attempts += 1
    assert retracted > 0, f"the KV pool was meant to force retraction ({attempts} attempts)"


def segment_parts(segments: list[dict]) -> list:
    """A prompt's segments as ``reference_embeds`` parts: each text's string, each span's rows."""
    return [s["text"] if s["type"] == "text" else wire.decode_tensor(s["embeds"]) for s in segments]


IMAGE_ANSWER_TOKENS = 10


@sgl.function
def ask_images(s, text, images, image_token):
    """One prompt, ``text`` with an image's span at each ``image_token``, then a greedy answer."""
    from sgl_embeds.vlm import image_prompt

    s += image_prompt(text, images, image_token)
    s += sgl.gen("answer", max_tokens=IMAGE_ANSWER_TOKENS, temperature=0)


def image_segments(backend, question: str, images: list) -> list:
    """The segments ``ask_images`` sends for one user turn of ``images`` and ``question`` (the
    served checkpoint's chat, ``image_chat``, expanded by the endpoint's encoder)."""
    import sgl_embeds

    encoder = backend.vision_encoder
    text = encoder.prompt_text(image_chat(backend, question, len(images)), len(images))
    return sgl_embeds.compile_program(ask_images, like=backend, text=text, images=images,
                                      image_token=encoder.image_token)[0]


def image_chat(backend, question: str, images: int) -> str:
    """The served checkpoint's chat template (``connect``'s backend) rendered for one user turn:
    ``images`` image parts, then ``question``."""
    from sgl_embeds.vlm import render_chat

    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return render_chat(backend.server_info.model.vision_dir, [{"role": "user", "content": content}])


def chat_part_answer(url: str, model: str, rows, question: str, max_tokens: int, **part_fields) -> dict:
    """The chat route's greedy answer (as a /generate response, with logprobs) to one user turn:
    the image's ``rows`` as an ``input_embeds`` part (with ``part_fields``), then ``question``."""
    res = requests.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "return_token_ids": True,
        "messages": [{"role": "user", "content": [
            {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows), **part_fields},
            {"type": "text", "text": question}]}]})
    assert res.status_code == 200, res.text
    return chat_as_generate(res.json())


def assert_image_chat_route(server, rows, question: str, segments: list, check: Callable, image_word: str,
                            max_tokens: int, causal_check: Callable | None = None) -> None:
    """The chat route of a split VLM that writes images as its processor does (``ImageText``):
    the image's ``rows`` as a part answer as ``check(out, context)`` says HF does, directly and
    through smg (cache-aware) in front of the server; with ``causal_check``, a part marked
    ``attention: causal`` answers as HF with the image attended causally. Through the gateway a
    text that writes ``image_word`` by hand is refused, and a program's ``segments``
    (``EmbedsEndpoint``: binary body, its own routing hint) answer as ``check`` says, then hit the
    cache on a repeat."""
    from sgl_embeds.backend import EmbedsEndpoint
    from sgl_embeds_protocol.segments import ATTENTION, CAUSAL
    from sgl_embeds_testing.server import Gateway

    model = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    direct = chat_part_answer(server.url, model, rows, question, max_tokens)
    check(direct, "chat route: ")
    if causal_check is not None:
        causal_check(chat_part_answer(server.url, model, rows, question, max_tokens, **{ATTENTION: CAUSAL}),
                     "chat route, attention causal: ")
    gateway = Gateway([server.url]).start()
    try:
        through = chat_part_answer(gateway.url, model, rows, question, max_tokens)
        assert through["output_ids"] == direct["output_ids"]
        check(through, "chat route through the gateway: ")
        written_by_hand = requests.post(gateway.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "input_embeds", "input_embeds": wire.encode_tensor(rows)},
                {"type": "text", "text": image_word + question}]}]})
        assert written_by_hand.status_code == 400, written_by_hand.text
        assert f"the text may not hold {image_word!r}" in error_message(written_by_hand)
        sent = {**OUTPUT_LOGPROBS, "sampling_params": {**GREEDY, "max_new_tokens": max_tokens}}
        answers = [EmbedsEndpoint(gateway.url).run(input_segments=segments, **sent) for _ in range(2)]
        check(answers[0], "a program's segments through the gateway: ")
        assert answers[1]["output_ids"] == answers[0]["output_ids"]
        assert answers[1]["meta_info"]["cached_tokens"] == answers[1]["meta_info"]["prompt_tokens"] - 1
    finally:
        gateway.stop()
