"""Stock SGLang's answers on the tiny Gemma 3, served natively on CPU, against HF's (issue #46).

Not a timing: what stock SGLang 0.5.23 (the sgl_embeds span plugin not loaded) answers when
``Gemma3ForConditionalGeneration`` is served natively with raw images on this CPU, and which of
four HF ``Gemma3ForConditionalGeneration.generate`` runs (float32, eager, greedy) it equals:
HF as it is (each image one bidirectional block, ``token_type_ids``); the images attended causally
(``causal_images=True``); and each of these with SigLIP's MLP activation swapped for QuickGELU,
which stock's ``gemma3_mm`` builds its tower with (``REFERENCES``). Tokens, first divergence with
HF's top-2 gap there, and the largest |logprob difference| of the chosen tokens before it.

The checkpoint is the tests' ``tiny_gemma3_dir()`` (random weights, sliding window 8, 4 rows an
image). Stock cannot load it as transformers 5.19 saves it (``gemma3_mm.load_weights``:
``KeyError: 'vision_tower.embeddings.patch_embedding.weight'``: its SigLIP parameters are under
``vision_tower.vision_model.``), so stock is given the same tensors with the tower's keys in that
layout, the one Google's released Gemma 3 checkpoints use (``--layout saved``: the saved one); HF
reads the saved checkpoint. The questions are tests/vlm/test_gemma3_parity.py's: one image at a
time, two images, a cached repeat, and a second question about the same image; on a server with
SGLang's default chunking, then on one with ``--chunked-prefill-size 10`` (which cuts every image
here). Each request is ``/generate`` with the rendered chat as ``text`` and the images as base64
PNG ``image_data``, greedy, ``--tokens`` new tokens, with logprobs. One server at a time.

Stock here is SGLang with ``SGLANG_PLUGINS=sgl_embeds_cpu``: the span plugin (``sgl_embeds``) is
not loaded. The CPU kernels' plugin is needed for SGLang's CPU path to start at all (it imports ops
from ``sgl_kernel`` at import time and no CPU build of that is installable here): it makes our
pure-torch stand-ins importable as ``sgl_kernel`` (its ``sglang.srt.platforms`` entry point).
``SGLANG_PLUGINS`` filters both entry-point groups, so with no plugin at all a CPU server exits at
startup (``--no-cpu-kernels`` shows it; ``common.STOCK_ENV`` says why). Of the CPU plugin's hooks,
``SGLANG_EMBEDS_CPU_ATTENTION=0`` drops our extend attention, so stock runs SGLang's own
``torch_native`` attention; the two left (a gated RMSNorm and a fused gate, Qwen3.5's) are not on
Gemma 3's path.

    python benchmarks/stock_gemma3_vs_hf.py [--tokens 10] [--layout released|saved] [--no-cpu-kernels]
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from common import STOCK_ENV, provenance, save, table
from sgl_embeds.serve import build_once
from sgl_embeds.vlm import render_chat
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.gemma3 import GEMMA3_CACHE_VERSION, tiny_gemma3_dir
from sgl_embeds_testing.models import cache_dir
from sgl_embeds_testing.server import Server, ServerStartError

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report"]
CHUNK = 10  # tests/vlm/test_gemma3_parity.py's chunk: cuts the two-image prompt's images
SERVERS = {"default chunking": [], f"--chunked-prefill-size {CHUNK}": ["--chunked-prefill-size", str(CHUNK)]}
NO_CPU_KERNELS_ENV = {"SGLANG_PLUGINS": "no-plugin-at-all"}  # no plugin of either entry-point group
WHAT, BRIGHTER, COLORS = "What is in the image?", "Which one is brighter?", "Describe the colors."


def released_layout(saved: Path) -> Path:
    """``saved`` (the tiny checkpoint as transformers saves it) with the vision tower's keys under
    ``vision_tower.vision_model.``, as in Google's released Gemma 3 checkpoints; the same tensors."""
    def build(tmp: Path) -> None:
        for f in saved.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, tmp / f.name)
        tower = "vision_tower."
        weights = {(tower + "vision_model." + k[len(tower):] if k.startswith(tower) else k): v
                   for k, v in load_file(str(saved / "model.safetensors")).items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return build_once(cache_dir() / f"tiny-gemma3-released-{GEMMA3_CACHE_VERSION}", build)


def noise(w: int, h: int, seed: int) -> Image.Image:
    """tests/helpers.py's ``random_image``: uniform RGB noise."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def images() -> dict[str, Image.Image]:
    return {"scene": synthetic_scene(), "noise 40x40": noise(40, 40, 5), "noise 50x30": noise(50, 30, 3),
            "noise 48x48": noise(48, 48, 21)}


# (case, question, image names); a case named "... repeat" is sent right after its twin
CASES = [
    ("one image: scene", WHAT, ["scene"]),
    ("one image: noise 40x40", WHAT, ["noise 40x40"]),
    ("one image: noise 50x30", WHAT, ["noise 50x30"]),
    ("two images", BRIGHTER, ["scene", "noise 40x40"]),
    ("two images, repeat", BRIGHTER, ["scene", "noise 40x40"]),
    ("noise 48x48", WHAT, ["noise 48x48"]),
    ("noise 48x48, repeat", WHAT, ["noise 48x48"]),
    ("noise 48x48, second question", COLORS, ["noise 48x48"]),
]


# HF's answers stock is compared with: as HF computes Gemma 3 (each image one block), with the
# images attended causally, and each of those with SigLIP's MLP activation replaced by QuickGELU
# (x * sigmoid(1.702 x)), which stock's gemma3_mm builds its tower with (siglip.SiglipVisionModel's
# default act_layer) where the checkpoint says gelu_pytorch_tanh
REFERENCES = {"HF": (False, False), "HF causal images": (True, False),
              "HF QuickGELU tower": (False, True), "HF causal + QuickGELU": (True, True)}


@dataclass
class Row:
    server: str
    case: str
    image_blocks: str  # the images' prompt positions [start, end), and whether a chunk cuts one
    prompt: str  # stock's prompt tokens / HF's, and stock's cached tokens
    # per reference: "yes" or "no at i (HF's top-2 gap there)", and the largest |logprob diff|
    # over the chosen tokens before the first divergence
    versus: dict[str, str]
    stock: list[int] | str  # output ids, or what stock said instead


class QuickGELU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


@contextmanager
def quick_gelu_tower(model, on: bool):
    """HF's model with its SigLIP MLPs on QuickGELU while inside (``on``), restored after."""
    tower = model.model.vision_tower
    layers = getattr(tower, "vision_model", tower).encoder.layers
    saved = [layer.mlp.activation_fn for layer in layers]
    try:
        if on:
            for layer in layers:
                layer.mlp.activation_fn = QuickGELU()
        yield
    finally:
        for layer, act in zip(layers, saved):
            layer.mlp.activation_fn = act


def chat(checkpoint: Path, question: str, n_images: int) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
    return render_chat(checkpoint, [{"role": "user", "content": content}])


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def divergence(ours: list[int], theirs: list[int]) -> int | None:
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return None if n == len(ours) == len(theirs) else n


def logprob_diff(ours: list[float], reference: ref.Greedy, upto: int | None) -> float:
    """Largest |stock - HF| over the chosen tokens' logprobs before the first divergence."""
    n = len(ours) if upto is None else upto
    return max((abs(a - b) for a, b in zip(ours[:n], reference.logprobs[:n])), default=float("nan"))


def blocks(inputs: dict) -> list[tuple[int, int]]:
    """The images' soft-token runs in HF's prompt (token_type_ids 1)."""
    types, out = inputs["token_type_ids"][0].tolist(), []
    for i, t in enumerate(types):
        if t and (i == 0 or not types[i - 1]):
            out.append([i, i + 1])
        elif t:
            out[-1][1] = i + 1
    return [tuple(b) for b in out]


def versus(ids: list[int], lps: list[float], reference: ref.Greedy) -> str:
    d = divergence(ids, reference.tokens)
    if d is None:
        said = "yes"
    else:
        gap = f", gap {reference.gaps[d]:.1e}" if d < len(reference.gaps) else ""
        said = f"no at {d}{gap}"
    return f"{said}; {logprob_diff(lps, reference, d):.1e}"


def compare(server: str, case: str, out: dict | str, references: dict[str, ref.Greedy],
            inputs: dict, chunk: int | None) -> Row:
    spans = blocks(inputs)
    cut = chunk is not None and any(s // chunk != (e - 1) // chunk for s, e in spans)
    where = " ".join(f"[{s},{e})" for s, e in spans) + (", cut by a chunk" if cut else "")
    hf_len = inputs["input_ids"].shape[1]
    if isinstance(out, str):
        return Row(server, case, where, f"- / {hf_len}", {name: "no answer" for name in references}, out)
    meta = out["meta_info"]
    ids, lps = out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]
    return Row(server, case, where, f"{meta['prompt_tokens']} / {hf_len}, cached {meta.get('cached_tokens')}",
               {name: versus(ids, lps, greedy) for name, greedy in references.items()}, ids)


def last_error(log: str) -> str:
    """The last exception line of a log (``KeyError: ...``), or its last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return (errors or lines or ["(empty log)"])[-1]


def ask(url: str, body: dict) -> dict | str:
    """Stock's answer, or what it said instead (status and body, or the connection error)."""
    try:
        r = requests.post(url + "/generate", json=body, timeout=300)
    except requests.RequestException as e:
        return f"request failed: {e}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:500]}"
    return r.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10, help="new tokens per answer")
    parser.add_argument("--layout", choices=("released", "saved"), default="released",
                        help="the checkpoint stock serves: the released key layout, or "
                             "transformers' saved one")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="launch stock with no plugin at all (without the sgl_kernel stand-ins)")
    args = parser.parse_args()
    checkpoint, pictures = tiny_gemma3_dir(), images()

    model = ref.hf_gemma3(str(checkpoint))[0]
    hf = {}  # case -> (text, pixels, HF's inputs, {reference: Greedy}); HF first, no server beside it
    for case, question, names in CASES:
        text, pixels = chat(checkpoint, question, len(names)), [pictures[n] for n in names]
        greedy = {}
        for name, (causal, quick_gelu) in REFERENCES.items():
            with quick_gelu_tower(model, quick_gelu):
                greedy[name] = ref.gemma3_greedy(checkpoint, text, pixels, args.tokens, causal_images=causal)
        hf[case] = (text, pixels, ref.gemma3_inputs(checkpoint, text, pixels), greedy)
        print(f"{case}: " + "; ".join(f"{n} {g.tokens}" for n, g in greedy.items()), flush=True)

    env = NO_CPU_KERNELS_ENV if args.no_cpu_kernels else STOCK_ENV
    served = released_layout(checkpoint) if args.layout == "released" else checkpoint
    rows, logs = [], {}
    for name, extra in SERVERS.items():
        chunk = CHUNK if extra else None
        server = Server(served, extra_args=MM_ARGS + extra, env=env)
        try:
            server.start()
        except ServerStartError as e:
            logs[name] = f"did not start: {e}"
            print(f"[{name}] {logs[name]}", flush=True)
            rows.append(Row(name, "(every case)", "-", "-", {n: "no answer" for n in REFERENCES},
                            f"the server did not start: {last_error(str(e))}"))
            continue
        try:
            for case, _, _ in CASES:
                text, pixels, inputs, greedy = hf[case]
                body = {"text": text, "image_data": [data_url(p) for p in pixels],
                        "sampling_params": {"temperature": 0.0, "max_new_tokens": args.tokens},
                        "return_logprob": True}
                out = ask(server.url, body)
                if isinstance(out, str) and not server.alive():
                    out += f" (server exited)\n{server.log_tail(30)}"
                rows.append(compare(name, case, out, greedy, inputs, chunk))
                print(f"[{name}] {case}: {rows[-1].stock}", flush=True)
                if not server.alive():
                    break
        finally:
            logs[name] = server.log_tail(60)
            server.stop()

    header = ["server", "case", "images at", "prompt tokens stock / HF",
              *(f"stock == {n}; max abs logprob diff" for n in REFERENCES)]
    title = f"Stock SGLang (sgl_embeds off) vs HF Gemma3ForConditionalGeneration, {args.tokens} greedy tokens"
    text = table(title,
                 header, [[r.server, r.case, r.image_blocks, r.prompt, *r.versus.values()] for r in rows])
    text = f"{provenance()}\n{text}"
    failures = [f"- {r.server} / {r.case}: {r.stock}" for r in rows if isinstance(r.stock, str)]
    if failures:
        text += "\n\nWhat stock said instead of an answer:\n" + "\n".join(failures)
        print("\n".join(failures))
    save("stock_gemma3_vs_hf" + ("_saved_layout" if args.layout == "saved" else "")
         + ("_no_cpu_kernels" if args.no_cpu_kernels else ""),
         {"provenance": provenance(), "rows": [asdict(r) for r in rows], "logs": logs}, text)

if __name__ == "__main__":
    sys.exit(main())
