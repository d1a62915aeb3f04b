"""Real sizes (#47 item 7): each family's smallest published member that fits this machine,
served as a user serves it and checked against HF on the same weights.

A model is a random-weight checkpoint at its published sizes (the published config.json's text and
vision settings, written down in ``testing``: ``qwen_vl.PUBLISHED``,
``llava_next.PUBLISHED_ONEVISION_TEXT``, ``gemma3.PUBLISHED_4B``, ``paligemma.PUBLISHED_3B``,
``gemma4.PUBLISHED_E2B``; HF's own init scaled as each module says, float32 unless ``Model.dtype``
says, our small tokenizer with the embeddings at the published vocabulary size). It is started
with ``sgl_embeds.serve.launch`` (split or native, as ``serve`` decides), reached with ``connect``
and asked one question about one image by ``programs.vqa`` (PaliGemma, which has no chat template:
in its ``answer en`` task form); then the server stops and HF's own VLM class answers the same
prompt (greedy, float32): tokens under ``reference.check_greedy``'s counted near-tie rule,
logprobs within ``reference.LOGPROB_TOL``, and HF's answer must change with another image. Where
HF fits in float64 (``FLOAT64_MAX_GB``), it answers again in float64, and ours' and HF's float32
logprobs are measured against it (``float64_gaps``). A model whose reference does not fit says why
(``Model.no_reference``) and is served and timed only.

Recorded per model: checkpoint size; the server's load time (launch to ready) and memory (RSS
summed over its processes, once ready and after the requests); the client's vision half (load
time, one image's rows); time to first token of the image question (a one-token request: the
first time, then again with its prefix cached); decode time per token; HF's load, answer time
and memory. Not part of the test suite (minutes per model).

    python benchmarks/real_size.py [--models llava_onevision_0_5b,qwen3_vl_2b,qwen2_vl_2b] [--tokens 8]

The models whose float32 weights take most of this machine's 24 GB run with a small KV pool
(``Model.kv_tokens``), one at a time. Each checkpoint stays in the model cache (3.4 to 17.2 GB;
78 GB for all eight, and a split's vision half beside it): delete the ``published-*`` folders and
their splits between runs where the disk is small.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import sglang as sgl
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # programs/

from common import RESULTS, provenance, save, table  # noqa: E402
import sgl_embeds  # noqa: E402
from programs.vqa import visual_qa  # noqa: E402
from sgl_embeds.serve import launch  # noqa: E402
from sgl_embeds.vlm import render_chat  # noqa: E402
from sgl_embeds.vlm.paligemma import prompt_text  # noqa: E402
from sgl_embeds.vlm.prompt import image_prompt  # noqa: E402
from sgl_embeds_testing import reference as ref  # noqa: E402
from sgl_embeds_testing.gemma3 import PUBLISHED_4B, published_gemma3_dir  # noqa: E402
from sgl_embeds_testing.gemma4 import PUBLISHED_E2B, published_gemma4_e2b_dir  # noqa: E402
from sgl_embeds_testing.llava_next import published_llava_onevision_dir  # noqa: E402
from sgl_embeds_testing.encoders import synthetic_scene  # noqa: E402
from sgl_embeds_testing.paligemma import PUBLISHED_3B, published_paligemma_dir  # noqa: E402
from sgl_embeds_testing.qwen_vl import PUBLISHED, hf_qwen_vl, published_qwen_vl_dir, qwen_vl_greedy  # noqa: E402

QUESTION = "what is in the picture"
GB = 1e9
NOISE_EPS, NOISE_SEEDS = 1e-7, 3  # hf_noise_floor's relative change of the image rows, and its tries
FLOAT64_MAX_GB = 18.0  # HF in float64 (float64_gaps) where its weights take at most this much


@sgl.function
def paligemma_qa(s, image, question: str, bos_token: str, max_tokens: int):
    """PaliGemma's own prompt form (no chat template): the image, bos, ``question``, a newline."""
    s += image_prompt(prompt_text(question, bos_token), [image])
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0)


def chat_question(backend, image, tokens: int) -> tuple:
    """QUESTION about ``image`` in a chat (``programs.vqa``): the program, its arguments and the
    prompt text HF's processor is given (the checkpoint's chat template, rendered)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return (visual_qa, dict(image=image, question=QUESTION, max_tokens=tokens),
            render_chat(backend.server_info.model.vision_dir, messages))


def paligemma_question(backend, image, tokens: int) -> tuple:
    """QUESTION as PaliGemma's VQA task prompt (``answer en ...``), as ``chat_question``."""
    question = f"answer en {QUESTION}"
    return (paligemma_qa, dict(image=image, question=question, bos_token=backend.vision_encoder.bos_token,
                               max_tokens=tokens), question)


@dataclass(frozen=True)
class Model:
    """A published checkpoint's size: its hub id, the builder of its random-weight copy, HF's
    greedy on it and HF's model; ``question``: how it is asked (``chat_question``);
    ``kv_tokens``: the server's KV pool in tokens, where serve's default would not fit beside the
    weights in this machine's memory; ``dtype``: the server's (and so the client's) dtype;
    ``no_reference``: why HF's answer is not computed, where it is not."""

    hub_id: str
    checkpoint: Callable[[], Path]
    greedy: Callable  # (checkpoint, text, images, max_new_tokens, prefix=()) -> ref.Greedy
    model: Callable[[str], object]
    question: Callable = chat_question
    kv_tokens: int | None = None
    dtype: str = "float32"
    no_reference: str = ""


# the Qwen-VL sizes whose server needs a small pool: Qwen2.5-VL-3B's 15 GB of float32 weights,
# with the client's 2.7 GB tower beside it
QWEN_VL_KV_TOKENS = {"qwen2_5_vl_3b": 2048}

MODELS = {
    "llava_onevision_0_5b": Model("llava-hf/llava-onevision-qwen2-0.5b-ov-hf", published_llava_onevision_dir,
                                  ref.llava_greedy, lambda c: ref.hf_llava(c)[0]),
    **{name: Model(PUBLISHED[name][1], functools.partial(published_qwen_vl_dir, name), qwen_vl_greedy,
                   lambda c: hf_qwen_vl(c)[0], kv_tokens=QWEN_VL_KV_TOKENS.get(name))
       for name in PUBLISHED},
    # 15.6 GB of float32 weights on the server: serve's 16384-token pool would add 4.6 GB
    "gemma3_4b": Model(PUBLISHED_4B[0], published_gemma3_dir, ref.gemma3_greedy, lambda c: ref.hf_gemma3(c)[0],
                       kv_tokens=2048),
    "paligemma_3b": Model(PUBLISHED_3B[0], published_paligemma_dir, ref.paligemma_greedy,
                          lambda c: ref.hf_paligemma(c)[0], question=paligemma_question),
    # served as the hub stores it, in bfloat16 (9.3 GB of weights on the server): in float32 its
    # language model alone is 18.5 GB, and Gemma 3 4B's server took 3.7 GB more than its weights
    "gemma4_e2b": Model(PUBLISHED_E2B[0], published_gemma4_e2b_dir, ref.gemma4_greedy, lambda c: ref.hf_gemma4(c)[0],
                        kv_tokens=2048, dtype="bfloat16", no_reference=(
                            "HF's float32 reference needs 19.2 GB beside this script; a bfloat16 one "
                            "checks nothing within 1e-4")),
}


def tree_rss(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in GB."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / GB


def timed(call: Callable):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def run(name: str, tokens: int) -> dict:
    model = MODELS[name]
    checkpoint, build_s = timed(model.checkpoint)
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / GB
    print(f"[{name}] checkpoint {checkpoint} ({size:.2f} GB, {build_s:.0f} s to build or find)", flush=True)
    image = synthetic_scene().resize((448, 448))  # sky, grass, a red square, a blue disc
    other = image.transpose(0).rotate(90)  # mirrored and turned
    # a small pool, and a static fraction high enough that SGLang's check of the memory the weights
    # leave passes (the pool is held to kv_tokens whatever the fraction)
    pool = ("--max-total-tokens", str(model.kv_tokens), "--mem-fraction-static", "0.85") if model.kv_tokens else ()
    served, load_s = timed(lambda: launch(checkpoint, "--enable-cache-report", *pool, "--dtype", model.dtype,
                                          timeout=3600))
    try:
        rss_ready = tree_rss(served.process.pid)
        backend, connect_s = timed(lambda: sgl_embeds.connect(served.url, device="cpu"))
        encoder = backend.vision_encoder
        rows, vision_s = timed(lambda: encoder(image))
        program, arguments, prompt = model.question(backend, image, tokens)
        call = sgl_embeds.compile_program(program, like=backend, **arguments)[0]
        one = {"temperature": 0, "max_new_tokens": 1}
        _, ttft_cold = timed(lambda: backend.run(input_segments=call, sampling_params=one))
        _, ttft_cached = timed(lambda: backend.run(input_segments=call, sampling_params=one))
        out, answer_s = timed(lambda: backend.run(
            input_segments=call, return_logprob=True, top_logprobs_num=ref.TOP_K,
            sampling_params={"temperature": 0, "max_new_tokens": tokens}))
        state = program.run(**arguments, backend=backend)
        assert state["answer"] == out["text"], (state["answer"], out["text"])
        rss_end = tree_rss(served.process.pid)
        served_as = backend.server_info.model.served_as
    finally:
        served.stop()
    measured = dict(
        model=name, hub_id=model.hub_id, served_as=served_as, dtype=model.dtype, checkpoint_gb=size,
        parameters_b=checkpoint_parameters(checkpoint) / 1e9, server_load_s=load_s,
        server_rss_ready_gb=rss_ready, server_rss_end_gb=rss_end, connect_s=connect_s,
        image_rows=int(getattr(rows, "rows", rows).shape[0]),  # a VisionRows on M-RoPE VLMs
        vision_s=vision_s, ttft_cold_s=ttft_cold, ttft_cached_s=ttft_cached,
        decode_s_per_token=(answer_s - ttft_cached) / max(1, len(out["output_ids"]) - 1),
        prompt_tokens=out["meta_info"]["prompt_tokens"], ours=out["output_ids"])
    if model.no_reference:
        print(f"[{name}] served; no HF reference: {model.no_reference}", flush=True)
        return {**measured, "tokens": f"not compared: {model.no_reference}"}
    before = psutil.Process().memory_info().rss
    hf, hf_load_s = timed(lambda: model.model(str(checkpoint)))
    greedy = functools.partial(model.greedy, checkpoint, prompt, [image], tokens)
    reference, hf_answer_s = timed(greedy)
    hf_gb = (psutil.Process().memory_info().rss - before) / GB
    try:
        forgiven = ref.check_greedy(out["output_ids"], greedy, f"{name}: ", eos_ids=ref.eos_ids(hf))
        compared = ref.assert_response_logprobs(out, reference, f"{name}: ")
        verdict = f"equal ({len(out['output_ids'])} tokens, {forgiven} near-tie forgiven, {compared} logprobs within {ref.LOGPROB_TOL:.0e})"
    except AssertionError as e:
        verdict = f"DIFFERENT: {e}"
    changes = model.greedy(checkpoint, prompt, [other], tokens).tokens != reference.tokens
    noise = hf_noise_floor(hf, greedy, reference)
    truth = float64_gaps(hf, greedy, reference, out) if measured["parameters_b"] * 8 <= FLOAT64_MAX_GB else None
    print(f"[{name}] {verdict}; HF's answer changes with the image: {changes}; HF's own logprobs move "
          f"{noise} under a {NOISE_EPS:.0e} change of the image rows", flush=True)
    return {**measured, "hf": reference.tokens, "distinct_tokens": len(set(reference.tokens)), "tokens": verdict,
            "hf_changes_with_image": changes, "hf_load_s": hf_load_s, "hf_answer_s": hf_answer_s, "hf_rss_gb": hf_gb,
            "hf_noise": noise, "float64_gaps": truth}


def float64_gaps(hf, greedy: Callable, reference: ref.Greedy, out: dict) -> dict | str:
    """How far float32 answers are from float64 ones on these weights: HF's model is turned to
    float64 in place and answers again; at each step where ours, HF's and the float64 tokens
    agree, every logprob ours reports (the chosen token's and the top-k's) is compared with the
    float64 one, and HF's float32 logprob of the same token too. Returns the largest gap of each
    (``hf``, ``ours``), or why none: the float64 tokens differ."""
    hf.to(torch.float64)
    truth = greedy()
    if truth.tokens != reference.tokens:
        return "HF's float64 tokens differ from its float32 ones"
    meta = out["meta_info"]
    steps = 0
    while steps < len(truth.tokens) and steps < len(out["output_ids"]) and out["output_ids"][steps] == truth.tokens[steps]:
        steps += 1
    gaps = {"hf": 0.0, "ours": 0.0}
    for step in range(steps):
        entries = [meta["output_token_logprobs"][step], *(meta.get("output_top_logprobs") or [[]] * steps)[step]]
        for logprob, token, _ in entries:
            exact = float(truth.distributions[step][token])
            gaps["ours"] = max(gaps["ours"], abs(logprob - exact))
            gaps["hf"] = max(gaps["hf"], abs(float(reference.distributions[step][token]) - exact))
    return gaps


def checkpoint_parameters(checkpoint: Path) -> int:
    """The parameters a checkpoint's safetensors files hold (read from their headers)."""
    total = 0
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    return total


def hf_noise_floor(hf, greedy: Callable, reference: ref.Greedy) -> float | str:
    """HF's own float32 noise at this init: the largest move of its chosen-token logprobs when the
    image's rows (the output of its projector, or of Qwen-VL's merger; Qwen3-VL's deepstack rows
    are left as they are) change by a relative ``NOISE_EPS``, over ``NOISE_SEEDS`` seeds. A gap to
    ours of this size is rounding the model amplifies, not a wrong computation. Else why not
    measured: no such module, or the changed rows change HF's tokens."""
    projector = getattr(hf.model, "multi_modal_projector", None)
    if projector is None and hasattr(hf.model, "visual"):
        projector = getattr(hf.model.visual, "merger", None)
    if projector is None:
        return "no projector module"
    state = {"seed": 0}

    def perturb(module, args, rows: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(state["seed"]), dtype=rows.dtype)
        return rows * (1 + NOISE_EPS * noise)

    handle = projector.register_forward_hook(perturb)
    try:
        moves = []
        for state["seed"] in range(NOISE_SEEDS):
            moved = greedy()
            if moved.tokens != reference.tokens:
                return "HF's tokens change"
            moves.append(max(abs(a - b) for a, b in zip(moved.logprobs, reference.logprobs)))
    finally:
        handle.remove()
    return max(moves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(psutil.cpu_count())
    names = [name for name in args.models.split(",") if name]
    for name in names:
        report({**run(name, args.tokens), "provenance": provenance()})
    if not names:  # --models '': the table again from the saved results
        report(None)


def _tokens(result: dict) -> str:
    """Ours against HF's tokens, or why that is no check: no HF answer, an HF answer of fewer
    than three distinct tokens, or one the image does not change (``reference.assert_not_degenerate``)."""
    if "hf" not in result:
        return "not compared"
    if result.get("distinct_tokens", 3) < 3 or not result["hf_changes_with_image"]:
        return "no check: HF's answer is degenerate"
    return "equal" if result["ours"] == result["hf"] else "DIFFERENT"


def _logprobs(verdict: str) -> str:
    """The logprob part of a run's verdict: within the tolerance, or the first gap over it (the
    check stops there)."""
    if verdict.startswith("equal"):
        return f"within {ref.LOGPROB_TOL:.0e}"
    if "logprob" not in verdict:
        return "not compared"
    return verdict.split(": ", 2)[-1].split(": ours [")[0]  # the values are in the notes below


def _noise(result: dict) -> str:
    """``hf_noise_floor``'s move, or why there is none (runs before it existed: not measured)."""
    noise = result.get("hf_noise", "not measured")
    return noise if isinstance(noise, str) else f"{noise:.1e}"


def _float64(result: dict) -> str:
    """``float64_gaps``: HF's and ours' largest gaps to float64 logprobs, or why none."""
    gaps = result.get("float64_gaps", "not measured")
    if gaps is None:
        return f"not run (over {FLOAT64_MAX_GB:.0f} GB)"
    return gaps if isinstance(gaps, str) else f"{gaps['hf']:.1e} / {gaps['ours']:.1e}"


def _hf_columns(result: dict) -> list[str]:
    """HF's own move, whether HF's answer changes with the image, its time and memory ("-"
    where HF did not run)."""
    if "hf" not in result:
        return ["-"] * 5
    return [_noise(result), _float64(result), str(result["hf_changes_with_image"]).lower(),
            f"{result['hf_load_s']:.0f} + {result['hf_answer_s']:.0f}", f"{result['hf_rss_gb']:.1f}"]


def report(measured: dict | None) -> None:
    """Save the table with ``measured`` in it (None: as saved); the models not run this time keep
    their rows."""
    kept = RESULTS / "real_size.json"
    results = json.loads(kept.read_text())["results"] if kept.exists() else []
    if measured is not None:
        results = [*(r for r in results if r["model"] != measured["model"]), measured]
    results = sorted(results, key=lambda r: list(MODELS).index(r["model"]))
    rows = [[r["model"], r["hub_id"], r["served_as"], r.get("dtype", "float32"), f"{r['parameters_b']:.2f}",
             f"{r['checkpoint_gb']:.1f}",
             f"{r['server_load_s']:.0f}", f"{r['server_rss_ready_gb']:.1f} / {r['server_rss_end_gb']:.1f}",
             f"{r['connect_s']:.1f}", f"{r['image_rows']} in {r['vision_s']:.1f}",
             f"{r['ttft_cold_s']:.1f} / {r['ttft_cached_s']:.2f}", f"{r['decode_s_per_token']:.2f}",
             _tokens(r), _logprobs(r["tokens"]), *_hf_columns(r)] for r in results]
    text = table("Real sizes: random weights at the published sizes, this machine", [
        "model", "published as", "served", "dtype", "params (B)", "checkpoint GB", "server load s",
        "server RSS GB (ready / end)", "connect s", "image rows in s", "TTFT s (first / cached)",
        "decode s/token", "tokens vs HF", "logprobs vs HF", f"HF's own move ({NOISE_EPS:.0e} rows)",
        "off float64 HF: HF / ours",
        "HF changes with image", "HF load + answer s", "HF RSS GB"], rows)
    text += "\n"
    for r in results:
        text += (f"\n- {r['model']}: {r['prompt_tokens']} prompt tokens; ours {r['ours']}, HF {r.get('hf', '-')}: "
                 f"{r['tokens']}. Measured at {r['provenance']}")
    save("real_size", {"results": results}, text)


if __name__ == "__main__":
    main()
