"""Questions about one image: vision-tower runs and wall time with and without the client's
encoder cache, for the vision halves of LLaVA-1.5, LLaVA-NeXT and LLaVA-OneVision.

The LLM is the demo model (SmolLM2-135M-Instruct) served with the plugin; each vision half has
its family's real geometry and random weights, so it costs what the real one costs:

* LLaVA-1.5: a ``LlavaEncoder`` (CLIP ViT-L/14 at 336 px, second-to-last layer, class token
  dropped: 576 rows; GELU MLP projector to the LLM's 576), one 336 px crop per image;
* LLaVA-NeXT: an ``AnyresEncoder`` (the same tower, LLaVA-1.6's pinpoints): a base tile and the
  tiles of the best pinpoint, each through the tower;
* LLaVA-OneVision: an ``AnyresEncoder`` (SigLIP so400m-patch14-384, 26 layers, ``anyres_max_9``
  and its pinpoints).

The any-resolution halves come from random checkpoints (``testing.llava_next.bench_*_dir``: the
real tower, a tiny language model of the demo model's width) split once into the cache and loaded
with ``load_encoder``. For each family both sides send the same program to the same server; the
only difference is ``EmbedsEndpoint(encoder_cache_bytes=...)``: 0 (off) or 256 MiB (on, cleared
before each session). One session of the same questions (cache on) first warms the server's
prefix cache with the image's rows and the prompts, so the difference is the tower. Sessions
alternate A/B, round by round. LLaVA-1.5 asks ten questions per session, two rounds; the tiled
families (5 tiles of a 640x480 image) ask fewer, one round by default, to bound the run on a CPU.

    python benchmarks/bench_encoder_cache.py [--rounds 2] [--anyres-questions 2]
        [--anyres-rounds 1] [--max-new-tokens 8] [--families llava15 llava_next llava_onevision]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import sglang as sgl
import torch
from PIL import Image

import sgl_embeds  # noqa: F401
from common import commit, demo_dir, machine, p50, provenance, save, server, table
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds_testing.encoders import synthetic_scene
from sgl_embeds_testing.llava_next import bench_llava_next_dir, bench_llava_onevision_dir, split_dir
from sgl_embeds.vlm import AnyresEncoder, load_encoder
from sgl_embeds.vlm.pixels import ImageProcessing
from sgl_embeds.vlm.tower import LlavaEncoder, Projector, TowerGeometry, VisionConfig, build_tower

QUESTIONS = ["What is in the image?", "What colour is the sky?", "Is there a dog?", "What is on the left?",
             "How many objects are there?", "What is at the bottom?", "Is it day or night?",
             "What shape is the red object?", "Describe the image briefly.", "Is there water?"]
IMAGE_SIZE = (640, 480)
OFF, ON = "no encoder cache", "encoder cache"
CACHE_BYTES = {OFF: 0, ON: 256 << 20}


class CountingEncoder:
    """Delegates to the encoder, counting and timing its runs (keeps its identity for the cache);
    ``rows``: how many rows its last image became."""

    def __init__(self, inner: LlavaEncoder | AnyresEncoder):
        self.inner, self.runs, self.seconds, self.rows = inner, 0, [], 0
        self.identity, self.mean_color = inner.identity, inner.mean_color

    def __call__(self, image: Image.Image) -> torch.Tensor:
        t = time.perf_counter()
        rows = self.inner(image)
        self.seconds.append(time.perf_counter() - t)
        self.runs, self.rows = self.runs + 1, len(rows)
        return rows


def llava15_encoder(llm_hidden: int) -> LlavaEncoder:
    geometry = TowerGeometry(image_size=336, patch_size=14, width=1024, layers=24, heads=16, mlp_width=4096,
                             act="quick_gelu", layer_norm_eps=1e-5)
    config = VisionConfig(tower=geometry, feature_layers=(-2,), select_strategy="default", projector_act="gelu",
                          projector_bias=True, llm_hidden_size=llm_hidden, processing=ImageProcessing(),
                          image_token="<image>", image_token_id=0)
    torch.manual_seed(0)
    weights = {f"tower.{k}": v for k, v in build_tower(geometry).state_dict().items()}
    projector = Projector(config)
    for p in projector.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weights.update({f"projector.{k}": v for k, v in projector.state_dict().items()})
    return LlavaEncoder(config, weights, identity="bench-llava15-random", device="cpu")


def anyres_encoder(checkpoint: Path) -> AnyresEncoder:
    return load_encoder(split_dir(checkpoint) / "vision", device="cpu")


# family -> (what its vision half is, its encoder for an LLM of this width)
FAMILIES = {
    "llava15": ("LLaVA-1.5: CLIP ViT-L/14-336", llava15_encoder),
    "llava_next": ("LLaVA-NeXT: CLIP ViT-L/14-336, LLaVA-1.6 pinpoints",
                   lambda llm_hidden: anyres_encoder(bench_llava_next_dir(llm_hidden))),
    "llava_onevision": ("LLaVA-OneVision: SigLIP so400m-14-384, anyres_max_9",
                        lambda llm_hidden: anyres_encoder(bench_llava_onevision_dir(llm_hidden))),
}


def tiles_per_image(encoder: LlavaEncoder | AnyresEncoder, image: Image.Image) -> int:
    """The tower's inputs per image: LLaVA-1.5's one crop, or the base tile and the tiles."""
    if isinstance(encoder, AnyresEncoder):
        return 1 + math.prod(encoder.tiling.tiles(image.height, image.width))
    return 1


@sgl.function
def ask(s, image, question, max_tokens):
    s += sgl.user(sgl.image(image) + "\n" + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


def session(backend: EmbedsEndpoint, image: Image.Image, questions: list[str],
            max_tokens: int) -> tuple[float, list[float]]:
    per_question = []
    t0 = time.perf_counter()
    for q in questions:
        t = time.perf_counter()
        ask.run(image=image, question=q, max_tokens=max_tokens, backend=backend)["answer"]  # waits for it
        per_question.append(time.perf_counter() - t)
    return time.perf_counter() - t0, per_question


def cache_hits(backend: EmbedsEndpoint) -> int:
    """The backend's encoder-cache hits so far (none without a cache)."""
    return backend.encoder_cache.hits if backend.encoder_cache is not None else 0


def compare(url: str, encoder: LlavaEncoder | AnyresEncoder, image: Image.Image, questions: list[str],
            rounds: int, max_tokens: int) -> dict:
    """Sessions of ``questions`` about ``image`` with the encoder cache off and on, alternated A/B
    for ``rounds`` after the warm-up session; per side: wall times, times of questions 2.., tower
    runs and cache hits per session, and the time of every tower run of both sides."""
    sides = {name: CountingEncoder(encoder) for name in CACHE_BYTES}
    backends = {name: EmbedsEndpoint(url, vision_encoder=sides[name], chat_template_name="chatml",
                                     encoder_cache_bytes=size) for name, size in CACHE_BYTES.items()}
    session(backends[ON], image, questions, max_tokens)  # warm the server's prefix cache
    sides[ON].runs = 0
    walls = {name: [] for name in sides}
    per_q = {name: [] for name in sides}
    hits = {name: 0 for name in sides}
    for _ in range(rounds):
        for name in sides:  # A/B alternation, round by round
            if backends[name].encoder_cache is not None:
                backends[name].encoder_cache.clear()  # each session starts cold
            hits_before = cache_hits(backends[name])
            wall, qs = session(backends[name], image, questions, max_tokens)
            walls[name].append(wall)
            per_q[name].extend(qs[1:])
            hits[name] += cache_hits(backends[name]) - hits_before
    return {"questions": len(questions), "rounds": rounds, "walls": walls, "per_question": per_q,
            "tower_runs": {name: enc.runs / rounds for name, enc in sides.items()},
            "cache_hits": {name: n / rounds for name, n in hits.items()},
            "tower_seconds": sides[OFF].seconds + sides[ON].seconds,
            "tiles_per_image": tiles_per_image(encoder, image), "rows_per_image": sides[ON].rows}


def llava15_table(result: dict) -> str:
    """The first table: LLaVA-1.5's sessions, question by question."""
    walls, per_q, runs = result["walls"], result["per_question"], result["tower_runs"]
    n = result["questions"]
    rows = [
        [f"tower runs per {n} questions", runs[OFF], runs[ON], "-"],
        [f"wall time per {n} questions (s), median", p50(walls[OFF]), p50(walls[ON]),
         p50(walls[OFF]) / p50(walls[ON])],
        [f"time per question 2-{n} (s), median", p50(per_q[OFF]), p50(per_q[ON]),
         p50(per_q[OFF]) / p50(per_q[ON])],
    ]
    return table(f"LLaVA-1.5: {n} questions about one {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} image, each "
                 "session's encoder cache cold", ["metric", OFF, ON, "ratio"], rows)


def families_table(results: dict[str, dict]) -> str:
    """The second table: one row per family, its session without the cache vs with it."""
    rows = []
    for family, r in results.items():
        wall_off, wall_on = p50(r["walls"][OFF]), p50(r["walls"][ON])
        rows.append([FAMILIES[family][0], f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}", r["tiles_per_image"],
                     r["rows_per_image"], p50(r["tower_seconds"]), f"{r['questions']} x {r['rounds']}",
                     r["tower_runs"][OFF], r["tower_runs"][ON], wall_off, wall_on, wall_off / wall_on,
                     r["cache_hits"][ON]])
    header = ["vision half", "image", "tiles per image (base + tiles)", "rows per image",
              "tower s per image (median of all runs)", "questions x rounds", "tower runs, no cache",
              "tower runs, cache", "wall s, no cache", "wall s, cache", "no cache / cache",
              "cache hits, cache"]
    return table("Per family: one session of N questions about the image, encoder cache off vs on "
                 "(medians over rounds; runs and hits per session)", header, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="rounds of LLaVA-1.5's 10-question sessions")
    ap.add_argument("--anyres-questions", type=int, default=2, choices=range(1, len(QUESTIONS) + 1),
                    metavar=f"1..{len(QUESTIONS)}", help="questions per session of the tiled families")
    ap.add_argument("--anyres-rounds", type=int, default=1, help="rounds of the tiled families")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    args = ap.parse_args()
    image = synthetic_scene(*IMAGE_SIZE)
    results = {}
    with server(demo_dir(), True) as s:
        llm_hidden = EmbedsEndpoint(s.url, chat_template_name="chatml").hidden_size
        for family in args.families:
            encoder = FAMILIES[family][1](llm_hidden)
            if family == "llava15":
                questions, rounds = QUESTIONS, args.rounds
            else:
                questions, rounds = QUESTIONS[:args.anyres_questions], args.anyres_rounds
            results[family] = compare(s.url, encoder, image, questions, rounds, args.max_new_tokens)
            del encoder  # one tower in memory at a time
    header = (f"{provenance()}\n"
              "LLM: SmolLM2-135M-Instruct float32 (plugin, prefix cache warm for both sides); vision "
              "halves of the families' real geometry, random weights, on the client's CPU; each row "
              "compares the same program sent to the same server with EmbedsEndpoint's encoder cache "
              "off (encoder_cache_bytes=0) and on (cleared before each session)")
    text = header
    if "llava15" in results:
        text += llava15_table(results["llava15"])
    text += families_table(results)
    save("encoder_cache", {"commit": commit(), "machine": machine(), "families": results}, text)


if __name__ == "__main__":
    main()
