"""Florence-2 at Florence-2-base's sizes: what a repeated (image, task) costs against a new one.

The checkpoint is ``testing.florence2.published_florence2_dir`` (the published sizes, random
weights: timings, not answers), served as users serve it (``python -m sgl_embeds serve``), the
client's vision half loaded by ``sgl_embeds.connect``. Each round sends, one request at a time over
the same wire, A: a new image under ``<OD>`` (its encoder region is computed: 577 image rows and
the task prompt), then B: the image of the round before under the same task (its encoder region
is a prefix-cache hit: neither the encoder nor the cross layers' keys and values run again). The
rows are computed on the client before the clock starts, so both sides time the server alone:
request sent to its one token back (``max_new_tokens=1``: the prefill, where a repeat saves; the
decode steps after it cost the same on both sides). The client's tower time per image is
reported beside them (what a repeat saves on top when the client caches its rows:
``EmbedsEndpoint(encoder_cache_bytes=...)``).

    python benchmarks/florence2_repeat.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from PIL import Image

import sgl_embeds
from common import commit, machine, p50, provenance, save, table
from sgl_embeds_testing.florence2 import PUBLISHED_BASE, published_florence2_dir
from sgl_embeds_testing.server import Server

TASK = "<OD>"


def image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8))


def timed(backend, segments) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = backend.run(input_segments=segments, sampling_params={"temperature": 0, "max_new_tokens": 1})
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    checkpoint = published_florence2_dir()
    server = Server(checkpoint, via_serve=True, extra_args=["--enable-cache-report"])
    t0 = time.perf_counter()
    server.start(timeout=900)
    load_s = time.perf_counter() - t0
    try:
        backend = sgl_embeds.connect(server.url)
        encoder = backend.vision_encoder
        tower_s, rows = [], {}
        for seed in range(args.rounds + 1):
            t = time.perf_counter()
            rows[seed] = encoder(image(seed))
            tower_s.append(time.perf_counter() - t)
        prompts = {seed: encoder.prompt_segments(r, TASK) for seed, r in rows.items()}
        timed(backend, prompts[0])  # the first request of a server (allocation, first calls)
        results = {"new": {"seconds": [], "cached": []}, "repeat": {"seconds": [], "cached": []}}
        for r in range(1, args.rounds + 1):
            # A: a new image (first seen this round), then B: last round's image again
            for side, seed in (("new", r), ("repeat", r - 1)):
                seconds, out = timed(backend, prompts[seed])
                results[side]["seconds"].append(seconds)
                results[side]["cached"].append(out["meta_info"]["cached_tokens"])
        encoder_len = out["meta_info"]["prompt_tokens"] - 2
    finally:
        server.stop()
    rows_out = [[side, p50(v["seconds"]), min(v["seconds"]), max(v["seconds"]),
                 f"{min(v['cached'])}-{max(v['cached'])}"] for side, v in results.items()]
    ratio = p50(results["repeat"]["seconds"]) / p50(results["new"]["seconds"])
    name, image_size, text, vision = PUBLISHED_BASE
    text_out = table(f"Florence-2 at {name}'s sizes ({image_size} px, {encoder_len} encoder positions), "
                     f"{args.rounds} rounds, seconds from request to its one token", ["request", "p50", "min", "max",
                                                                                   "cached tokens"], rows_out)
    text_out += (f"\n\nrepeat / new, p50: {ratio:.2f}x. The client's tower: {p50(tower_s):.2f} s an "
                 f"image (p50 of {len(tower_s)}). Server load: {load_s:.0f} s.\n\n{provenance()}\n")
    print(text_out)
    save("florence2_repeat", {"commit": commit(), "machine": machine(), "load_s": load_s, "tower_s": tower_s,
                              "encoder_len": encoder_len, "results": results}, text_out)


if __name__ == "__main__":
    main()
