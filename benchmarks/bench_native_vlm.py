"""Image spans vs SGLang's own image paths on a natively served Qwen2.5-VL (issue #22).

One random-weight Qwen2.5-VL sized so that prefill and the vision tower take visible time on a
CPU (``testing.qwen_vl.bench_qwen2_5_vl_dir``: LM hidden 1024 x 8 layers, tower 512 x 8 blocks;
a 448x448 image is 256 rows), float32, the plugin loaded, SGLang's multimodal path on. Each
request is a chat turn with one image (a fresh noise image per request, so its first question
misses the cache) and a question; it generates one token, streamed, so its time is its time to
first token (TTFT). Then a second question about the same image: the image's KV is cached.

Sides, alternated request by request (the order rotated every round), each on its own images:

* over HTTP to one server (``/generate``, the same client, stream):
  * ``stock raw image``: ``image_data`` as a PNG; SGLang's processor and its vision tower;
  * ``ours inline``: ``input_segments`` with the image's rows (base64 float32) and grid; the
    rows come from the client's vision half (``vlm.QwenVLEncoder``), computed before the clock
    (its time per image is reported apart);
  * ``ours by handle``: the same rows uploaded before the clock (``POST /sgl_embeds/spans``),
    then sent by handle;
* in process (``sglang.Engine``, a child process with the same settings; its own wire, so its
  numbers compare with each other, not with HTTP's):
  * ``stock precomputed item``: ``image_data=[{"format": "precomputed_embedding", ...}]``;
  * ``ours tensors``: ``input_segments`` with the rows as a tensor and the grid.

A second table times the server-side hashing that gives each image its cache identity, per
request, at 1, 4 and 16 images of 256 rows, by calling in this process the code the server runs:
stock's ``resolve_multimodal_item_hash`` on a precomputed item (one item holds all of a request's
images: SGLang takes one precomputed item per modality), and our ``prompts.build_ids`` with the
spans inline (one content key per span: BLAKE3 per row, the handle from the digests) or by
handle (the handle is the key: no hashing at all, counted).

    python benchmarks/bench_native_vlm.py [--rounds 8] [--engine-child]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image

from common import p50, pct, provenance, save, server, table
from sgl_embeds_srt import keys, prompts, wire
from sgl_embeds_srt.image_spans import VisionSpec
from sgl_embeds_srt.segments import Grid, Span, Text
from sgl_embeds.testing.qwen_vl import (
    IMAGE_PAD, IMAGE_PLACEHOLDER, VISION_END, VISION_START, bench_qwen2_5_vl_dir)
from sgl_embeds.vision import VisionRows
from sgl_embeds.vlm import QwenVLEncoder

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report"]
HTTP_SIDES = ["stock raw image", "ours inline", "ours by handle"]
ENGINE_SIDES = ["stock precomputed item", "ours tensors"]
QUESTIONS = ("what is in this picture", "which colors are there")
IMAGE_SIDE = 448  # px: 32x32 patches, 256 rows after the 2x2 merge


def noise_image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))


def chat_text(question: str) -> str:
    return f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{question}<|im_end|>\n<|im_start|>assistant\n"


def span_segments(question: str, span: dict) -> list[dict]:
    before, after = chat_text(question).split(IMAGE_PLACEHOLDER)
    return [{"type": "text", "text": before + VISION_START}, span, {"type": "text", "text": VISION_END + after}]


def ttft(url: str, body: dict) -> float:
    """Seconds from sending ``body`` (stream, one new token) to its first streamed chunk."""
    body = {**body, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    t0 = time.perf_counter()
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                elapsed = time.perf_counter() - t0
                break
        for _ in r.iter_lines():  # read to the end: the request is done before the next starts
            pass
    return elapsed


def encode_all(encoder: QwenVLEncoder, seeds: list[int]) -> dict[int, tuple[Image.Image, VisionRows, float]]:
    """Every image of a phase and its rows, computed before the phase's clocks start (encoding
    right before a timed request would leave this process's compute threads spinning beside the
    server's), with each encode time."""
    out = {}
    for seed in seeds:
        image = noise_image(seed)
        t0 = time.perf_counter()
        encoded = encoder(image)
        out[seed] = (image, encoded, time.perf_counter() - t0)
    return out


def http_bodies(side: str, image: Image.Image, encoded: VisionRows, url: str) -> list[dict]:
    """The two questions' bodies for one image on ``side`` (a by-handle span is uploaded here,
    before the clock)."""
    if side == "stock raw image":
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = base64.b64encode(buf.getvalue()).decode()
        return [{"text": chat_text(q), "image_data": data} for q in QUESTIONS]
    inline = {"type": "embeds", "embeds": wire.encode_tensor(encoded.rows), **encoded.grid.fields()}
    if side == "ours inline":
        return [{"input_segments": span_segments(q, inline)} for q in QUESTIONS]
    upload = requests.post(url + "/sgl_embeds/spans", json={"embeds": inline["embeds"]}, timeout=600)
    upload.raise_for_status()
    by_handle = {"type": "embeds", "embeds": {"handle": keys.content_key(encoded.rows)}, "image_grid_thw": grid}
    return [{"input_segments": span_segments(q, by_handle)} for q in QUESTIONS]


def schedule(sides: list[str], rounds: int, first_seed: int) -> list[tuple[int, str, int]]:
    """(round, side, image seed) in the order they run: round -1 warms every side up (unrecorded),
    the order of sides rotates every round, and every request has its own image."""
    plan, seed = [], first_seed
    for r in range(-1, rounds):
        shift = r % len(sides)
        for side in sides[shift:] + sides[:shift]:
            seed += 1
            plan.append((r, side, seed))
    return plan


def run_http(model_dir: Path, rounds: int) -> dict:
    encoder = QwenVLEncoder(model_dir, device="cpu")
    plan = schedule(HTTP_SIDES, rounds, 10_000)
    encoded = encode_all(encoder, [seed for _, _, seed in plan])
    times = {side: {"first": [], "repeat": [], "encode": []} for side in HTTP_SIDES}
    with server(model_dir, plugin=True, extra=MM_ARGS) as s:
        for r, side, seed in plan:
            image, rows, encode_s = encoded[seed]
            first, repeat = (ttft(s.url, b) for b in http_bodies(side, image, rows, s.url))
            if r >= 0:
                times[side]["first"].append(first)
                times[side]["repeat"].append(repeat)
                times[side]["encode"].append(0.0 if side == "stock raw image" else encode_s)
    return times


def engine_child(model_dir: Path, rounds: int) -> dict:
    """The in-process sides, in this (child) process: ``Engine.shutdown`` kills its caller's
    children, and the engine must not share the CPU with the HTTP server."""
    from sgl_embeds.testing.server import engine as make_engine

    encoder = QwenVLEncoder(model_dir, device="cpu")
    eng = make_engine(model_dir, enable_multimodal=True, mm_attention_backend="sdpa", enable_cache_report=True)
    sp = {"temperature": 0, "max_new_tokens": 1}

    def first_chunk(**kwargs) -> float:
        t0 = time.perf_counter()
        chunks = eng.generate(sampling_params=sp, stream=True, **kwargs)
        next(chunks)
        elapsed = time.perf_counter() - t0
        for _ in chunks:
            pass
        return elapsed

    plan = schedule(ENGINE_SIDES, rounds, 20_000)
    encoded = encode_all(encoder, [seed for _, _, seed in plan])
    times = {side: {"first": [], "repeat": []} for side in ENGINE_SIDES}
    try:
        for r, side, seed in plan:
            _, rows, _ = encoded[seed]
            grid = list(rows.grid.thw)
            asked = []
            for q in QUESTIONS:
                if side == "stock precomputed item":
                    item = {"format": "precomputed_embedding", "feature": rows.rows,
                            "image_grid_thw": torch.tensor([grid])}
                    # a precomputed item takes the prompt with its pad already expanded to the rows
                    expanded = chat_text(q).replace(IMAGE_PAD, IMAGE_PAD * len(rows.rows))
                    asked.append(first_chunk(prompt=expanded, image_data=[item]))
                else:
                    span = {"type": "embeds", "embeds": rows.rows, "image_grid_thw": grid}
                    asked.append(first_chunk(input_segments=span_segments(q, span)))
            if r >= 0:
                times[side]["first"].append(asked[0])
                times[side]["repeat"].append(asked[1])
    finally:
        eng.shutdown()
    return times


def hashing(model_dir: Path, repeats: int = 21) -> dict:
    """Milliseconds of server-side identity hashing per request, by images per request."""
    from sglang.srt.multimodal.cache.identity import resolve_multimodal_item_hash
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    spec = prompts.ModelSpec(config.text_config.hidden_size, torch.float32, config.text_config.vocab_size,
                             1 << 20, AutoTokenizer.from_pretrained(model_dir), VisionSpec.of(config))
    grid = (1, IMAGE_SIDE // 14, IMAGE_SIDE // 14)
    rows_per_image = grid[1] * grid[2] // 4
    hashed = {"seconds": 0.0, "calls": 0}
    real_keyed = prompts.keyed

    def timed_keyed(span: Span) -> Span:
        t0 = time.perf_counter()
        try:
            return real_keyed(span)
        finally:
            hashed["seconds"] += time.perf_counter() - t0
            hashed["calls"] += 1

    prompts.keyed = timed_keyed
    out = {}
    try:
        for n in (1, 4, 16):
            images = [torch.randn(rows_per_image, spec.hidden_size) for _ in range(n)]
            segments_inline, segments_handle = [], []
            for i, rows in enumerate(images):
                text = Text(f"image {i}: {VISION_START}" if i == 0 else f"{VISION_END} image {i}: {VISION_START}")
                segments_inline += [text, Span(rows, grid=Grid(grid))]
                # a span by handle comes out of the server's store keyed (hashed when it was stored)
                segments_handle += [text, keys.keyed(Span(rows, grid=Grid(grid)))]
            stock, ours = [], {"inline": [], "by handle": []}
            for _ in range(repeats):
                feature = torch.cat(images)
                t0 = time.perf_counter()
                resolve_multimodal_item_hash(precomputed_embeddings=feature)
                stock.append(time.perf_counter() - t0)
                for name, segments in (("inline", segments_inline), ("by handle", segments_handle)):
                    hashed.update(seconds=0.0, calls=0)
                    prompts.build_ids([*segments, Text(VISION_END)], spec)
                    ours[name].append((hashed["seconds"], hashed["calls"]))
            out[n] = {"stock precomputed item": p50(stock) * 1e3,
                      **{f"ours {k}": p50([s for s, _ in v]) * 1e3 for k, v in ours.items()},
                      **{f"ours {k} hash calls": v[-1][1] for k, v in ours.items()}}
    finally:
        prompts.keyed = real_keyed
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = bench_qwen2_5_vl_dir()
    if args.engine_child:
        print(json.dumps(engine_child(model_dir, args.rounds)))
        return

    hash_ms = hashing(model_dir)
    http = run_http(model_dir, args.rounds)
    child = subprocess.run([sys.executable, __file__, "--engine-child", "--rounds", str(args.rounds)],
                           capture_output=True, text=True, timeout=3600)
    if child.returncode != 0:
        raise SystemExit(child.stderr[-3000:])
    engine = json.loads(child.stdout.strip().splitlines()[-1])

    ms = lambda v, q: pct(v, q) * 1e3
    rows = []
    for wire_name, results in (("HTTP", http), ("Engine", engine)):
        for side, t in results.items():
            encode = f"{p50(t['encode']) * 1e3:.1f}" if t.get("encode") and any(t["encode"]) else "-"
            rows.append([wire_name, side, ms(t["first"], 0.5), ms(t["first"], 0.9), ms(t["repeat"], 0.5),
                         ms(t["repeat"], 0.9), encode])
    text = f"Measured: {provenance()}\n"
    text += table(f"TTFT (ms) of a question about a fresh 448x448 image (256 rows), then of a second "
                  f"question about it; {args.rounds} rounds, sides alternated",
                  ["wire", "side", "first p50", "first p90", "repeat p50", "repeat p90",
                   "client encode p50 (ms)"], rows)
    text += "\n" + table("Server-side identity hashing per request (ms, p50 of 21), 256 rows x 1024 float32 per image",
                         ["images", "stock precomputed item", "ours inline", "ours by handle",
                          "hash calls inline / by handle"],
                         [[n, v["stock precomputed item"], v["ours inline"], v["ours by handle"],
                           f"{v['ours inline hash calls']} / {v['ours by handle hash calls']}"]
                          for n, v in hash_ms.items()])
    save("native_vlm", {"http": http, "engine": engine, "hashing_ms": hash_ms, "provenance": provenance()}, text)


if __name__ == "__main__":
    main()
