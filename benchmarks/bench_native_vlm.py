"""Image and clip spans vs SGLang's own image and video paths on a natively served Qwen-VL
(issues #22, #32).

One random-weight Qwen2.5-VL or Qwen3-VL (``--family``) sized so that prefill and the vision
tower take visible time on a CPU (``testing.qwen_vl.bench_qwen2_5_vl_dir`` / ``bench_qwen3_vl_dir``:
LM hidden 1024 x 8 layers, tower 512 x 8 blocks; an image of 16 x 16 merged patches is 256 rows,
448x448 px on Qwen2.5-VL, 512x512 on Qwen3-VL, whose rows carry 3 deepstack layers: 4096 wide),
float32, the plugin loaded, SGLang's multimodal path on. Each request is a chat turn with one
image (a fresh noise image per request, so its first question misses the cache) or one clip, and
a question; it generates one token, streamed, so its time is its time to first token (TTFT). Then
a second question about the same image or clip: its KV is cached.

A clip is 8 frames of 448x448 at 2 fps (a square moving over a background, its colours fresh per
request), written losslessly (FFV1 in Matroska, PyAV) and read back with decord, SGLang's video
decoder here: the frames ours encode are the ones stock decodes. Stock samples the 8 frames at
its default 2 fps and keeps their size; both sides' frames then go through the checkpoint's video
processor.

Sides, alternated request by request (the order rotated every round), each on its own images:

* over HTTP to one server (``/generate``, the same client, stream):
  * ``stock raw image``: ``image_data`` as a PNG; SGLang's processor and its vision tower;
  * ``ours inline``: ``input_segments`` with the image's rows (base64 float32) and grid; the
    rows come from the client's vision half (``vlm.QwenVLEncoder``), computed before the clock
    (its time per image is reported apart);
  * ``ours by handle``: the same rows uploaded before the clock (``POST /sgl_embeds/spans``),
    then sent by handle;
  * ``stock raw video``, ``ours clip inline``, ``ours clip by handle``: the same for a clip
    (``video_data`` as the file in base64; the clip's rows with its video grid and time);
* in process (``sglang.Engine``, a child process with the same settings; its own wire, so its
  numbers compare with each other, not with HTTP's), Qwen2.5-VL only (measured: stock's Qwen3-VL runs
  its tower on a precomputed item, fails on its shape, and its scheduler exits):
  * ``stock precomputed item``: ``image_data=[{"format": "precomputed_embedding", ...}]``;
  * ``ours tensors``: ``input_segments`` with the rows as a tensor and the grid.

A second table (Qwen2.5-VL) times the server-side hashing that gives each image its cache identity, per
request, at 1, 4 and 16 images of 256 rows, by calling in this process the code the server runs:
stock's ``resolve_multimodal_item_hash`` on a precomputed item (one item holds all of a request's
images: SGLang takes one precomputed item per modality), and our ``prompts.build_ids`` with the
spans inline (one content key per span: BLAKE3 per row, the handle from the digests) or by
handle (the handle is the key: no hashing at all, counted).

    python benchmarks/bench_native_vlm.py [--family qwen2_5_vl|qwen3_vl] [--rounds 8] [--engine-child]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image

from common import p50, pct, provenance, save, server, table
from sgl_embeds_protocol import keys, wire
from sgl_embeds_srt import prompts
from sgl_embeds_srt.image_spans import VisionSpec
from sgl_embeds_protocol.segments import Grid, Span, Text
from sgl_embeds_testing.qwen_vl import (
    IMAGE_PAD, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, VISION_END, VISION_START, bench_qwen2_5_vl_dir,
    bench_qwen3_vl_dir, sample_clip)
from sgl_embeds.vision import VisionRows
from sgl_embeds.vlm import QwenVLEncoder

MM_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report"]
FAMILIES = {"qwen2_5_vl": bench_qwen2_5_vl_dir, "qwen3_vl": bench_qwen3_vl_dir}
IMAGE_SIDES = ["stock raw image", "ours inline", "ours by handle"]
CLIP_SIDES = ["stock raw video", "ours clip inline", "ours clip by handle"]
HTTP_SIDES = IMAGE_SIDES + CLIP_SIDES
ENGINE_SIDES = ["stock precomputed item", "ours tensors"]
QUESTIONS = ("what is in this picture", "which colors are there")
MERGED_SIDE = 16  # an image of 16 x 16 merged patches: 256 rows
CLIP_FRAMES, CLIP_SIDE, CLIP_FPS = 8, 448, 2.0  # 448 px: a multiple of both families' 28 and 32


def image_side(model_dir: Path) -> int:
    """Pixels per side of a 256-row image: 448 (patch 14) or 512 (patch 16)."""
    from transformers import AutoConfig

    vision = AutoConfig.from_pretrained(model_dir).vision_config
    return MERGED_SIDE * vision.patch_size * vision.spatial_merge_size


def noise_image(seed: int, side: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def clip_file(seed: int) -> tuple[bytes, np.ndarray]:
    """A fresh clip as a lossless video file (FFV1 in Matroska) and the frames SGLang's decoder
    (decord) reads back from it: the ones both sides are asked about."""
    import av
    import decord

    frames = sample_clip(CLIP_FRAMES, CLIP_SIDE, CLIP_SIDE, seed=seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=int(CLIP_FPS))
        stream.width, stream.height, stream.pix_fmt = CLIP_SIDE, CLIP_SIDE, "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    data = buf.getvalue()
    reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0))
    decoded = reader.get_batch(list(range(len(reader)))).asnumpy()
    assert reader.get_avg_fps() == CLIP_FPS and np.array_equal(decoded, frames), "the clip file is not lossless"
    return data, decoded


def chat_text(question: str, placeholder: str = IMAGE_PLACEHOLDER) -> str:
    return f"<|im_start|>user\n{placeholder}{question}<|im_end|>\n<|im_start|>assistant\n"


def span_segments(question: str, span: dict, placeholder: str = IMAGE_PLACEHOLDER) -> list[dict]:
    before, after = chat_text(question, placeholder).split(placeholder)
    return [{"type": "text", "text": before + VISION_START}, span, {"type": "text", "text": VISION_END + after}]


def ttft(url: str, body: dict) -> tuple[float, dict]:
    """Seconds from sending ``body`` (stream, one new token) to its first streamed chunk, and the
    last chunk's ``meta_info``."""
    body = {**body, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    t0 = time.perf_counter()
    chunks = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():  # read to the end: the request is done before the next starts
            if line.startswith(b"data:") and line != b"data: [DONE]":
                if not chunks:
                    elapsed = time.perf_counter() - t0
                chunks.append(line)
    return elapsed, json.loads(chunks[-1][len(b"data:"):])["meta_info"]


@dataclass
class Media:
    """One request's image (a PIL image) or clip (its file's bytes), and its rows from the
    client's vision half with the seconds they took."""

    source: Image.Image | bytes
    encoded: VisionRows
    encode_s: float


def encode_all(encoder: QwenVLEncoder, plan: list[tuple[int, str, int]], side: int) -> dict[int, Media]:
    """Every image and clip of a phase and its rows, computed before the phase's clocks start
    (encoding right before a timed request would leave this process's compute threads spinning
    beside the server's)."""
    out = {}
    for _, name, seed in plan:
        if name in CLIP_SIDES:
            data, frames = clip_file(seed)
            t0 = time.perf_counter()
            encoded = encoder.clip(frames, CLIP_FPS)
            out[seed] = Media(data, encoded, time.perf_counter() - t0)
        else:
            image = noise_image(seed, side)
            t0 = time.perf_counter()
            encoded = encoder(image)
            out[seed] = Media(image, encoded, time.perf_counter() - t0)
    return out


def http_bodies(side: str, media: Media, url: str) -> list[dict]:
    """The two questions' bodies for one image or clip on ``side`` (a by-handle span is uploaded
    here, before the clock)."""
    if side == "stock raw image":
        buf = io.BytesIO()
        media.source.save(buf, format="PNG")
        data = base64.b64encode(buf.getvalue()).decode()
        return [{"text": chat_text(q), "image_data": data} for q in QUESTIONS]
    if side == "stock raw video":
        data = base64.b64encode(media.source).decode()
        return [{"text": chat_text(q, VIDEO_PLACEHOLDER), "video_data": data} for q in QUESTIONS]
    rows, grid = media.encoded.rows, media.encoded.grid.fields()
    placeholder = VIDEO_PLACEHOLDER if media.encoded.grid.video else IMAGE_PLACEHOLDER
    inline = {"type": "embeds", "embeds": wire.encode_tensor(rows), **grid}
    if side.endswith("inline"):
        return [{"input_segments": span_segments(q, inline, placeholder)} for q in QUESTIONS]
    upload = requests.post(url + "/sgl_embeds/spans", json={"embeds": inline["embeds"]}, timeout=600)
    upload.raise_for_status()
    by_handle = {"type": "embeds", "embeds": {"handle": keys.content_key(rows)}, **grid}
    return [{"input_segments": span_segments(q, by_handle, placeholder)} for q in QUESTIONS]


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
    media = encode_all(encoder, plan, image_side(model_dir))
    times = {side: {"first": [], "repeat": [], "encode": [], "prompt_tokens": [], "repeat_cached": []}
             for side in HTTP_SIDES}
    with server(model_dir, plugin=True, extra=MM_ARGS) as s:
        for r, side, seed in plan:
            (first, meta), (repeat, again) = (ttft(s.url, b) for b in http_bodies(side, media[seed], s.url))
            if r >= 0:
                t = times[side]
                t["first"].append(first)
                t["repeat"].append(repeat)
                t["encode"].append(0.0 if side.startswith("stock") else media[seed].encode_s)
                t["prompt_tokens"].append(meta["prompt_tokens"])
                t["repeat_cached"].append(again["cached_tokens"])
    return times


def engine_child(model_dir: Path, rounds: int) -> dict:
    """The in-process sides, in this (child) process: ``Engine.shutdown`` kills its caller's
    children, and the engine must not share the CPU with the HTTP server."""
    from sgl_embeds_testing.server import engine as make_engine

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
    media = encode_all(encoder, plan, image_side(model_dir))
    times = {side: {"first": [], "repeat": []} for side in ENGINE_SIDES}
    try:
        for r, side, seed in plan:
            rows = media[seed].encoded
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
    grid = (1, 2 * MERGED_SIDE, 2 * MERGED_SIDE)
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
    ap.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = FAMILIES[args.family]()
    if args.engine_child:
        print(json.dumps(engine_child(model_dir, args.rounds)))
        return

    qwen2_5 = args.family == "qwen2_5_vl"  # stock's Engine and its hashing: Qwen2.5-VL only (module docstring)
    hash_ms = hashing(model_dir) if qwen2_5 else {}
    http = run_http(model_dir, args.rounds)
    engine = {}
    if qwen2_5:
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
            prompt = "/".join(map(str, sorted(set(t["prompt_tokens"])))) if t.get("prompt_tokens") else "-"
            cached = f"{p50(t['repeat_cached']):.0f}" if t.get("repeat_cached") else "-"
            rows.append([wire_name, side, prompt, ms(t["first"], 0.5), ms(t["first"], 0.9), ms(t["repeat"], 0.5),
                         ms(t["repeat"], 0.9), cached, encode])
    side = image_side(model_dir)
    text = f"Measured: {provenance()}; family {args.family}\n"
    text += table(f"TTFT (ms) of a question about a fresh {side}x{side} image (256 rows) or a fresh clip of "
                  f"{CLIP_FRAMES} frames of {CLIP_SIDE}x{CLIP_SIDE} at {CLIP_FPS:g} fps, then of a second "
                  f"question about it; {args.rounds} rounds, sides alternated",
                  ["wire", "side", "prompt tokens", "first p50", "first p90", "repeat p50", "repeat p90",
                   "repeat cached tokens p50", "client encode p50 (ms)"], rows)
    if hash_ms:
        text += "\n" + table("Server-side identity hashing per request (ms, p50 of 21), 256 rows x 1024 float32 per image",
                             ["images", "stock precomputed item", "ours inline", "ours by handle",
                              "hash calls inline / by handle"],
                             [[n, v["stock precomputed item"], v["ours inline"], v["ours by handle"],
                               f"{v['ours inline hash calls']} / {v['ours by handle hash calls']}"]
                              for n, v in hash_ms.items()])
    name = "native_vlm" if qwen2_5 else f"native_vlm_{args.family}"
    save(name, {"http": http, "engine": engine, "hashing_ms": hash_ms, "provenance": provenance(),
                "family": args.family}, text)


if __name__ == "__main__":
    main()
