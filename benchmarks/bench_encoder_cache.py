"""Ten questions about one image: vision-tower runs and wall time with and without the client's
encoder cache.

The LLM is the demo model (SmolLM2-135M-Instruct) served with the plugin; the vision half is a
``LlavaEncoder`` of LLaVA-1.5's geometry (CLIP ViT-L/14 at 336 px, second-to-last layer, class
token dropped: 576 rows; GELU MLP projector to the LLM's 576) with random weights, which costs
what the real tower costs. Both sides send the same program to the same server; the only
difference is ``EmbedsEndpoint(encoder_cache_bytes=...)``: 0 (off) or the default. Sessions
alternate A/B; each session asks the ten questions in order with ``max_new_tokens`` tokens.
The server's prefix cache is warm for both sides after the first session (the image's rows are
identical), so the difference is the tower.

    python benchmarks/bench_encoder_cache.py [--rounds 2] [--max-new-tokens 8]
"""

from __future__ import annotations

import argparse
import time

import sglang as sgl
import torch
from PIL import Image

import sgl_embeds  # noqa: F401
from common import demo_dir, commit, machine, provenance, p50, save, server, table
from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.testing.encoders import synthetic_scene
from sgl_embeds.vlm.pixels import ImageProcessing
from sgl_embeds.vlm.tower import LlavaEncoder, Projector, TowerGeometry, VisionConfig, build_tower

QUESTIONS = ["What is in the image?", "What colour is the sky?", "Is there a dog?", "What is on the left?",
             "How many objects are there?", "What is at the bottom?", "Is it day or night?",
             "What shape is the red object?", "Describe the image briefly.", "Is there water?"]


class CountingEncoder:
    """Delegates to the encoder and counts tower runs (keeps its identity for the cache)."""

    def __init__(self, inner: LlavaEncoder):
        self.inner, self.runs = inner, 0
        self.identity, self.mean_color = inner.identity, inner.mean_color

    def __call__(self, image: Image.Image) -> torch.Tensor:
        self.runs += 1
        return self.inner(image)


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


@sgl.function
def ask(s, image, question, max_tokens):
    s += sgl.user(sgl.image(image) + "\n" + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))


def session(backend: EmbedsEndpoint, image: Image.Image, max_tokens: int) -> tuple[float, list[float]]:
    per_question = []
    t0 = time.perf_counter()
    for q in QUESTIONS:
        t = time.perf_counter()
        ask.run(image=image, question=q, max_tokens=max_tokens, backend=backend)["answer"]  # waits for it
        per_question.append(time.perf_counter() - t)
    return time.perf_counter() - t0, per_question


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    image = synthetic_scene(640, 480)
    with server(demo_dir(), True) as s:
        probe = EmbedsEndpoint(s.url, chat_template_name="chatml")
        encoder = llava15_encoder(probe.hidden_size)
        sides = {
            "no encoder cache": CountingEncoder(encoder),
            "encoder cache": CountingEncoder(encoder),
        }
        backends = {
            name: EmbedsEndpoint(s.url, vision_encoder=enc, chat_template_name="chatml",
                                 encoder_cache_bytes=0 if name == "no encoder cache" else 256 << 20)
            for name, enc in sides.items()
        }
        session(backends["encoder cache"], image, args.max_new_tokens)  # warm the server's prefix cache
        sides["encoder cache"].runs = 0
        walls = {name: [] for name in sides}
        per_q = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name in sides:  # A/B alternation, round by round
                if backends[name].encoder_cache is not None:
                    backends[name].encoder_cache.clear()  # each session starts cold
                wall, qs = session(backends[name], image, args.max_new_tokens)
                walls[name].append(wall)
                per_q[name].extend(qs[1:])
    runs = {name: enc.runs / args.rounds for name, enc in sides.items()}
    rows = [
        ["tower runs per 10 questions", runs["no encoder cache"], runs["encoder cache"], "-"],
        ["wall time per 10 questions (s), median", p50(walls["no encoder cache"]), p50(walls["encoder cache"]),
         p50(walls["no encoder cache"]) / p50(walls["encoder cache"])],
        ["time per question 2-10 (s), median", p50(per_q["no encoder cache"]), p50(per_q["encoder cache"]),
         p50(per_q["no encoder cache"]) / p50(per_q["encoder cache"])],
    ]
    header = (f"{provenance()}\n"
              "LLM: SmolLM2-135M-Instruct float32 (plugin, prefix cache warm for both sides); vision: "
              "LLaVA-1.5 geometry (ViT-L/14-336, 576 rows), random weights, on the client's CPU")
    text = header + table("10 questions about one 640x480 image, each session's encoder cache cold",
                          ["metric", "no encoder cache", "encoder cache", "ratio"], rows)
    save("encoder_cache", {"commit": commit(), "machine": machine(), "walls": walls, "per_question": per_q,
                           "tower_runs": runs, "rounds": args.rounds}, text)


if __name__ == "__main__":
    main()
