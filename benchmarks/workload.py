"""A closed-loop multi-turn VLM chat workload (issue #35), replayed alike by every arm.

``plan_turns`` draws, from a seed, the turns of N users: each user is one chat, each turn an image
item (an image of a shared pool, or a box or a mask of one) and a question. Turns are planned in
the order "turn 0 of every user, then turn 1, ...": exactly ``round(reuse * turns)`` of them
(never the first) ask about an item seen before, drawn by a Zipf law over the items seen so far
(rank = order of first appearance, weight ``1 / rank**zipf_s``); every other turn brings a new item:
a fresh image of the pool, or (``NEW_REGION_SHARE`` of them, once an image was seen) a box or a
mask of a seen image, which is new pixels to a tower. The plan is plain data (``Turn``), recorded
with the results, so that every arm replays the same turns.

``run_episode`` replays a plan against one server with one arm's client (``ARMS``): each user a
thread that sends its turns one after the other (closed loop), every turn a streamed ``/generate``
request with the whole chat so far (the earlier answers as the server gave them) and
``answer_tokens`` new tokens; the episode ends when every user is done.

* ``stock raw image``: the chat as text with one image pad per item and ``image_data`` (PNG,
  base64; SGLang's processor, tower and multimodal cache);
* ``ours inline``: the client's vision half (``vlm.QwenVLEncoder``) through one ``EncoderCache``
  shared by all users, every item's rows inline in ``input_segments`` (base64, JSON);
* ``ours by handle``: the same, written by a ``SpanWriter`` that holds spans (what
  ``EmbedsEndpoint`` does): an item goes inline once, with ``keep_spans``, then by handle.

The client's tower runs inside the turn it serves, so its time counts in the turn's TTFT and in
the episode's requests/s; it runs one image at a time (one lock around the shared cache: a
second user asking for an item being encoded waits for it rather than running the tower again).
Image pixels and PNGs are made before the clock (a client has its images as files).

An ``Arm`` of the benchmark is one of those clients (``client``) and where its requests go
(``workers``): one server, or (issue #35 (d)) that many behind SGLang's model gateway, smg, with
its cache-aware policy. ``route`` sets that up for one episode: every worker's prefix cache
flushed and, for several workers, a fresh gateway (its prefix tree empty); a span by handle that
the gateway sends to a worker that does not hold it is refused (unknown handle) and ``ask`` sends
that turn again with the rows inline (``resent``).

``ideal_hit_rate`` is what a prefix cache of unbounded size could have served of the replayed
prompts: each request's longest token prefix shared with the prompt of a request sent before it
or with the prompt and answer of one that finished before it was sent, at most its prompt less one
token, over all prompt tokens; an image counts as its rows, the same item giving the same rows.
With concurrent users that counts prefixes still being computed when a request went out, which no
cache can serve; ``ideal_hit_rate(..., in_prefill=False)`` counts only what was computed by then:
the prompt of a request whose first token had come back before this one was posted, with its
answer once it had finished. A server's hit rate lies between the two (up to the moments the
client sees: a prefill that ends while a request is on its way can serve it).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Iterator

import numpy as np
import psutil
import requests
import torch
from PIL import Image

from sgl_embeds.sender import error_body, is_unknown_handle
from sgl_embeds_testing.qwen_vl import IMAGE_PAD, VISION_END, VISION_START
from sgl_embeds_testing.server import Gateway
from sgl_embeds.vision import EncoderCache, region_image
from sgl_embeds.writer import HeldSpans, SpanWriter
from sgl_embeds_protocol import segments as seg

ARMS = ("stock raw image", "ours inline", "ours by handle")
# issue #49's further clients: the path VLM developers use today for precomputed rows (the whole
# prompt's embeddings in ``input_embeds``, which stock serves only with its radix cache off), and
# ours without the client's encoder cache (every item's tower pass again on every turn)
INPUT_EMBEDS, NO_ENCODER_CACHE = "stock input_embeds", "ours inline, no encoder cache"
# stock's raw images with each file's SHA-256 (``mm_content_hashes``): a server started with
# ``--trust-mm-content-hashes`` and its preprocess cache skips reading, decoding and processing an
# image it holds
HASHED_IMAGE = "stock raw image, content hashes"
CLIENTS = (*ARMS, INPUT_EMBEDS, NO_ENCODER_CACHE, HASHED_IMAGE)
RAW_IMAGE_CLIENTS = (ARMS[0], HASHED_IMAGE)  # the clients that send pixels, not rows
QUESTIONS = ("what is in this picture?", "which colors are there?", "describe the top left corner.",
             "is there any text?", "how many objects do you see?", "what stands out here?")
NEW_REGION_SHARE = 0.3  # of new items, once an image was seen: a box (2/3) or a mask (1/3) of one
MIN_REGION = 0.4  # a region's sides are at least this share of the image's


@dataclass(frozen=True)
class Arm:
    """An arm of the benchmark: what its client sends (``client``, one of ``ARMS``) and to how
    many workers (``workers``: one server, or that many behind smg's cache-aware policy)."""

    client: str
    workers: int = 1

    def __post_init__(self) -> None:
        if self.client not in ARMS:
            raise ValueError(f"client must be one of {ARMS}, got {self.client!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")

    @property
    def name(self) -> str:
        return self.client if self.workers == 1 else f"{self.client}, smg x{self.workers}"


# issue #35 (d): stock raw image and ours by handle, each with two workers behind smg
SMG_ARMS = (Arm("stock raw image", 2), Arm("ours by handle", 2))


@dataclass
class Route:
    """Where one episode's requests go (``url``), the processes whose memory counts as the
    server's (``pids``: every worker's, and the gateway's), and the gateway (None: one server)."""

    url: str
    pids: list[int]
    gateway: Gateway | None = None


@contextmanager
def route(worker_urls: list[str], worker_pids: list[int]) -> Iterator[Route]:
    """An episode's ``Route`` to its workers: with more than one worker, a fresh smg (cache-aware
    policy) in front of them, stopped afterwards; then every worker's prefix cache flushed (after
    the gateway's start: its health probes are requests, ``input_ids`` [0], which a worker caches)."""
    pids = list(dict.fromkeys(worker_pids))  # one process under two addresses counts once
    # stopped when the episode is over, nothing in flight: no grace period (smg's takes ~5 s)
    gateway = (Gateway(list(worker_urls), ["--policy", "cache_aware", "--shutdown-grace-period-secs", "0"]).start()
               if len(worker_urls) > 1 else None)
    try:
        for url in worker_urls:  # once the worker is idle (a probe may be running), within 30 s
            requests.post(url + "/flush_cache", params={"timeout": 30}, timeout=60).raise_for_status()
        if gateway is None:
            yield Route(worker_urls[0], pids)
        else:
            yield Route(gateway.url, [*pids, gateway.proc.pid], gateway)
    finally:
        if gateway is not None:
            gateway.stop()


@dataclass(frozen=True)
class Item:
    """What a turn shows: image ``image`` of the pool (its seed), whole (``region`` None), a box
    ``("box", x0, y0, x1, y1)`` or an elliptic mask ``("mask", cx, cy, rx, ry)``, in pixels."""

    image: int
    region: tuple | None = None


@dataclass(frozen=True)
class Turn:
    user: int
    index: int  # the turn's place in its user's chat
    item: Item
    question: str
    reuse: bool  # the item was seen before, in the planned order


def plan_turns(users: int, turns: int, reuse: float, seed: int, image_side: int,
               zipf_s: float = 1.0, region_share: float = NEW_REGION_SHARE) -> list[Turn]:
    """The turns of ``users`` chats of ``turns`` turns, in the planned order (see the module
    docstring); the same arguments give the same list. ``region_share``: of new items once an
    image was seen, the share that are a box or a mask of one (0: whole images only)."""
    if not 0.0 <= reuse < 1.0:
        raise ValueError(f"reuse is a share of turns in [0, 1), got {reuse}")
    rng = np.random.default_rng(seed)
    total = users * turns
    reused = set(rng.choice(np.arange(1, total), size=round(reuse * total), replace=False).tolist()
                 if total > 1 else [])
    seen: list[Item] = []
    images: list[int] = []
    plan = []
    for k in range(total):
        index, user = divmod(k, users)
        if k in reused:
            item = seen[_zipf(rng, len(seen), zipf_s)]
        else:
            if images and rng.random() < region_share:
                item = Item(images[_zipf(rng, len(images), zipf_s)], _region(rng, image_side))
            else:
                item = Item(seed * 100_000 + len(images))
                images.append(item.image)
            seen.append(item)
        plan.append(Turn(user, index, item, QUESTIONS[int(rng.integers(len(QUESTIONS)))], k in reused))
    return plan


def plan_agent_chat(turns: int, seed: int) -> list[Turn]:
    """Issue #49 (a), an agent's chat: one user, ``turns`` turns, each a new whole image (a
    screenshot), every earlier one kept in the chat."""
    return plan_turns(1, turns, 0.0, seed, image_side=0, region_share=0.0)


def plan_shared_qa(requests_: int, pool: int, seed: int, zipf_s: float = 1.0) -> list[Turn]:
    """Issue #49 (b), shared-image Q&A: ``requests_`` one-turn chats, each from its own user (a
    request's ``user`` is its place in the plan, its arrival order), about a whole image of a
    pool of ``pool`` drawn by a Zipf law over the pool (rank k with weight ``1 / k**zipf_s``),
    with a question of ``QUESTIONS``; ``reuse``: the image was asked about before."""
    if pool < 1 or requests_ < 1:
        raise ValueError(f"pool and requests must be at least 1, got {pool} and {requests_}")
    rng = np.random.default_rng(seed)
    seen: set[Item] = set()
    plan = []
    for k in range(requests_):
        item = Item(seed * 100_000 + _zipf(rng, pool, zipf_s))
        plan.append(Turn(k, 0, item, QUESTIONS[int(rng.integers(len(QUESTIONS)))], item in seen))
        seen.add(item)
    return plan


def _zipf(rng: np.random.Generator, n: int, s: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=weights / weights.sum()))


def _region(rng: np.random.Generator, side: int) -> tuple:
    w, h = (int(rng.integers(int(MIN_REGION * side), side + 1)) for _ in range(2))
    x0, y0 = int(rng.integers(0, side - w + 1)), int(rng.integers(0, side - h + 1))
    if rng.random() < 2 / 3:
        return ("box", x0, y0, x0 + w, y0 + h)
    return ("mask", x0 + w // 2, y0 + h // 2, w // 2, h // 2)


def plan_record(plan: list[Turn]) -> list[dict]:
    return [asdict(t) for t in plan]


@lru_cache(maxsize=512)
def pool_image(seed: int, side: int | tuple[int, int]) -> Image.Image:
    """Image ``seed`` of the pool, ``side`` pixels square (or ``(width, height)``): a smooth random
    picture (a 12x12 grid of colours, upscaled), which a PNG stores in about a third of its raw
    bytes."""
    small = np.random.default_rng(seed).integers(0, 256, (12, 12, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((side, side) if isinstance(side, int) else side, Image.BICUBIC)


def region_of(item: Item, side: int) -> Any:
    """The item's region as ``vision`` takes it: None, a pixel box, or a boolean mask."""
    if item.region is None:
        return None
    kind, *v = item.region
    if kind == "box":
        return tuple(v)
    cx, cy, rx, ry = v
    y, x = np.ogrid[:side, :side]
    return ((x - cx) / max(rx, 1)) ** 2 + ((y - cy) / max(ry, 1)) ** 2 <= 1.0


@dataclass
class Answer:
    """One replayed turn, as the client saw it."""

    user: int
    index: int
    item: Item
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    prompt_atoms: list  # token ids, an image as its rows ("row", item, i): for ideal_hit_rate
    sent: float  # perf_counter at the turn's start (before the client's tower)
    posted: float  # ... when its (last) request was posted, its body made
    first: float  # ... at the first streamed chunk
    done: float
    request_bytes: int
    response_bytes: int
    resent: bool = False  # a handle the server did not hold: sent again inline
    tower_s: float = 0.0  # the client's tower time in this turn (its cache misses)


@dataclass
class ArmClient:
    """One arm's client, shared by its users: the server, the vision half and its cache, the
    span writer, the tokenizer (for the ideal hit rate) and what was made before the clock.
    ``image_side``: the pool's images are this many pixels square, or ``(width, height)``;
    ``system``: a system prompt opening every chat; ``embed_tokens``: the language model's token
    embedding table (``INPUT_EMBEDS``' client makes the prompt's text rows with it)."""

    arm: str
    url: str
    encoder: Any  # vlm.QwenVLEncoder
    tokenizer: Any
    image_side: int | tuple[int, int]
    answer_tokens: int = 8
    system: str | None = None
    embed_tokens: torch.Tensor | None = None
    cache: EncoderCache = field(default_factory=EncoderCache)
    tower_s: float = 0.0  # the client's tower time (cache misses)
    tower_rows: int = 0  # ... and the rows it made
    tower_passes: int = 0  # ... and its passes
    lock: threading.Lock = field(default_factory=threading.Lock)
    _turn: threading.local = field(default_factory=threading.local)  # the asking thread's tower time
    _pixels: dict = field(default_factory=dict)
    _png: dict = field(default_factory=dict)
    _hash: dict = field(default_factory=dict)  # item -> its PNG's content hash (HASHED_IMAGE)
    _rows: dict = field(default_factory=dict)  # item -> rows of the prompt (for the ideal)

    def __post_init__(self) -> None:
        if self.arm not in CLIENTS:
            raise ValueError(f"arm must be one of {CLIENTS}, got {self.arm!r}")
        if (self.arm == INPUT_EMBEDS) != (self.embed_tokens is not None):
            raise ValueError(f"{INPUT_EMBEDS!r}, and only it, needs embed_tokens")
        held = HeldSpans() if self.arm == "ours by handle" else None
        self.writer = SpanWriter(self.encoder.span_width, "base64", None, held)

    def prepare(self, plan: list[Turn]) -> None:
        """Every item's pixels (and, for stock, PNG) before the clock."""
        for item in {t.item for t in plan}:
            image = pool_image(item.image, self.image_side)
            pixels = region_image(image, region_of(item, self.image_side), self.encoder)
            self._pixels[item] = pixels
            self._rows[item] = self.encoder.rows_for(*pixels.size)
            if self.arm in RAW_IMAGE_CLIENTS:
                buf = io.BytesIO()
                pixels.save(buf, format="PNG")
                self._png[item] = base64.b64encode(buf.getvalue()).decode()
                self._hash[item] = "sha256:" + hashlib.sha256(buf.getvalue()).hexdigest()

    def encode(self, item: Item) -> seg.Span:
        """The item's rows through the shared cache (one tower pass at a time; without the cache,
        ``NO_ENCODER_CACHE``, a pass every time), as a span."""
        with self.lock:
            cache = self.cache if self.arm != NO_ENCODER_CACHE else EncoderCache()
            misses = cache.misses
            t0 = time.perf_counter()
            image = pool_image(item.image, self.image_side)
            out = cache.encode(self.encoder, image, region_of(item, self.image_side))
            if cache.misses > misses:
                self.tower_s += time.perf_counter() - t0
                self._turn.tower_s = getattr(self._turn, "tower_s", 0.0) + time.perf_counter() - t0
                self.tower_rows += out.rows.shape[0]
                self.tower_passes += 1
        return seg.Span(out.rows, grid=out.grid)

    def body(self, pieces: list) -> tuple[dict, list[torch.Tensor]]:
        """The ``/generate`` body (less its sampling) of a prompt of text pieces and items, and
        the rows of its spans."""
        if self.arm in RAW_IMAGE_CLIENTS:
            text = "".join(p if isinstance(p, str) else IMAGE_PAD for p in pieces)
            items = [p for p in pieces if isinstance(p, Item)]
            body = {"text": text, "image_data": [self._png[p] for p in items]}
            if self.arm == HASHED_IMAGE:
                body["mm_content_hashes"] = [self._hash[p] for p in items]
            return body, []
        if self.arm == INPUT_EMBEDS:  # the whole prompt's rows, as JSON lists (stock's only form)
            rows = [self.embed_tokens[self._ids(p)] if isinstance(p, str) else self.encode(p).rows
                    for p in pieces]
            return {"input_embeds": torch.cat(rows).tolist()}, []
        segments = [seg.Text(p) if isinstance(p, str) else self.encode(p) for p in pieces]
        with self.lock:  # the held spans are one LRU
            fields = self.writer.fields("input_segments", [segments], False, check_values=False)
        return fields, [s.rows for s in segments if isinstance(s, seg.Span)]

    def forget_prepared(self) -> None:
        """Drop what ``prepare`` made (a long run's harness memory, not a client's)."""
        for made in (self._pixels, self._png, self._hash, self._rows):
            made.clear()

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def atoms(self, pieces: list) -> list:
        """The prompt as the server counts it: its tokens (with what the tokenizer puts first,
        as the server tokenizes text), an item as its rows."""
        out: list = [] if self.arm == INPUT_EMBEDS else self.tokenizer.encode("", add_special_tokens=True)
        for p in pieces:
            out += self._ids(p) if isinstance(p, str) else [("row", p, i) for i in range(self._rows[p])]
        return out

    def ask(self, turn: Turn, history: list[tuple[Turn, str]]) -> Answer:
        pieces = chat_pieces(history, turn, self.system)
        self._turn.tower_s = 0.0
        sent = time.perf_counter()
        body, spans = self.body(pieces)
        resent = False
        sampling = {"temperature": 0, "max_new_tokens": self.answer_tokens, "ignore_eos": True}
        while True:
            payload = json.dumps({**body, "sampling_params": sampling, "stream": True}).encode()
            posted = time.perf_counter()
            r = requests.post(self.url + "/generate", data=payload, stream=True, timeout=600,
                              headers={"Content-Type": "application/json"})
            if r.status_code == 200:
                break
            error = error_body(r)
            if resent or not is_unknown_handle(error):
                raise RuntimeError(f"{self.arm}: turn {turn.user}/{turn.index}: {r.status_code} {error}")
            with self.lock:  # a span another user's request was to leave on the server: inline
                self.writer.forget(spans)
            (body, spans), resent = self.body(pieces), True
        first, last, received = None, None, 0
        with r:
            for line in r.iter_lines():
                received += len(line) + 1
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                first = first or time.perf_counter()
                last = json.loads(line[5:])
        done = time.perf_counter()
        meta = last["meta_info"]
        return Answer(turn.user, turn.index, turn.item, last["text"], list(last["output_ids"]),
                      meta["prompt_tokens"], meta.get("cached_tokens", 0), self.atoms(pieces), sent,
                      posted, first, done, len(payload), received, resent, self._turn.tower_s)


def chat_pieces(history: list[tuple[Turn, str]], turn: Turn, system: str | None = None) -> list:
    """The chat so far and ``turn``'s question in Qwen's chat format, after the ``system`` prompt
    if any: text pieces and items."""
    pieces: list = [] if system is None else [f"<|im_start|>system\n{system}<|im_end|>\n"]
    for t, answer in [*history, (turn, None)]:
        pieces += [f"<|im_start|>user\n{VISION_START}", t.item,
                   f"{VISION_END}{t.question}<|im_end|>\n<|im_start|>assistant\n"]
        if answer is not None:
            pieces.append(f"{answer}<|im_end|>\n")
    merged: list = []
    for p in pieces:  # adjacent text pieces as one
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    return merged


def process_rss(pid: int, children: bool = True) -> dict[str, int]:
    """The resident memory (bytes) of a process now and, with ``children``, of each of its
    children, by name and pid (SGLang names its scheduler and detokenizer processes); a process
    gone meanwhile is left out."""
    out: dict[str, int] = {}
    try:
        root = psutil.Process(pid)
        processes = [root, *(root.children(recursive=True) if children else [])]
    except psutil.Error:
        return out
    for p in processes:
        try:
            out[f"{p.name()} ({p.pid})"] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def rss(pids: list[int], children: bool = True) -> int:
    """The resident memory (bytes) of processes now and, with ``children``, theirs."""
    return sum(sum(process_rss(pid, children).values()) for pid in pids)


class RssPeak:
    """The peak resident memory (bytes) of processes and, with ``children``, theirs, sampled
    every ``interval`` s while in use."""

    def __init__(self, pids: list[int], interval: float = 0.1, children: bool = True) -> None:
        self.pids, self.interval, self.children, self.peak = pids, interval, children, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        return rss(self.pids, self.children)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def run_episode(client: ArmClient, plan: list[Turn], server_pids: list[int] = (),
                users_pool: ThreadPoolExecutor | None = None) -> dict:
    """``plan`` replayed by ``client``'s arm, one thread per user (closed loop): the answers and
    the episode's measures. The threads are ``users_pool``'s (at least one per user) when given,
    so that a long run does not start new ones every episode; otherwise the episode's own."""
    client.prepare(plan)
    by_user: dict[int, list[Turn]] = {}
    for t in plan:
        by_user.setdefault(t.user, []).append(t)
    answers: list[Answer] = []
    errors: list[BaseException] = []

    def user(turns: list[Turn]) -> None:
        history: list[tuple[Turn, str]] = []
        try:
            for t in turns:
                a = client.ask(t, history)
                answers.append(a)
                history.append((t, a.text))
        except BaseException as e:  # noqa: BLE001 - reported after the episode
            errors.append(e)

    pool = users_pool or ThreadPoolExecutor(len(by_user))
    with RssPeak(list(server_pids)) as server_rss, RssPeak([psutil.Process().pid], children=False) as client_rss:
        t0 = time.perf_counter()
        for done in [pool.submit(user, turns) for turns in by_user.values()]:
            done.result()
        wall = time.perf_counter() - t0
    if users_pool is None:
        pool.shutdown()
    if errors:
        raise errors[0]
    return _measures(client, plan, answers, t0, wall, server_rss.peak, client_rss.peak)


def run_open_loop(client: ArmClient, plan: list[Turn], rate: float | None, seed: int,
                  server_pids: list[int] = ()) -> dict:
    """``plan``'s one-turn chats (``plan_shared_qa``) sent open loop: request k at the k-th
    arrival of a Poisson process of ``rate`` per second (the gaps drawn from ``seed``, the same
    for every arm), whether or not the earlier ones were answered; ``rate`` None: all at once (the
    server's saturation). The measures of ``run_episode``, and ``offered_per_s``; its
    ``requests_per_s`` is the plan over the time from the first arrival to the last answer."""
    if any(t.index for t in plan):
        raise ValueError("an open-loop plan is of one-turn chats")
    client.prepare(plan)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(plan)) if rate else np.zeros(len(plan))
    arrivals = np.cumsum(gaps) - gaps[0]
    answers: list[Answer] = []
    with RssPeak(list(server_pids)) as server_rss, RssPeak([psutil.Process().pid], children=False) as client_rss, \
            ThreadPoolExecutor(len(plan)) as pool:
        t0 = time.perf_counter()

        def arrive(k: int) -> Answer:
            time.sleep(max(0.0, t0 + arrivals[k] - time.perf_counter()))
            return client.ask(plan[k], [])

        answers = [f.result() for f in [pool.submit(arrive, k) for k in range(len(plan))]]
        wall = time.perf_counter() - t0
    out = _measures(client, plan, answers, t0, wall, server_rss.peak, client_rss.peak)
    return {**out, "offered_per_s": rate}


def _measures(client: ArmClient, plan: list[Turn], answers: list[Answer], t0: float, wall: float,
              server_rss_peak: int, client_rss_peak: int) -> dict:
    """An episode's measures from its answers (``run_episode``)."""
    answers.sort(key=lambda a: (a.user, a.index))
    ttft = [a.first - a.sent for a in answers]
    e2e = [a.done - a.sent for a in answers]
    distinct = len({t.item for t in plan})
    prompt = sum(a.prompt_tokens for a in answers)
    ours = client.arm not in RAW_IMAGE_CLIENTS
    return {
        "arm": client.arm, "turns": len(answers), "wall_s": wall, "requests_per_s": len(answers) / wall,
        "ttft_s": ttft, "e2e_s": e2e,
        "tower_passes_per_item": client.tower_passes / distinct if ours else None,
        "client_tower_s": client.tower_s, "client_tower_rows": client.tower_rows,
        "hit_rate": sum(a.cached_tokens for a in answers) / prompt,
        "ideal_hit_rate": ideal_hit_rate(answers),
        "ideal_hit_rate_prefilled": ideal_hit_rate(answers, in_prefill=False),
        "atoms_match_prompt_tokens": sum(len(a.prompt_atoms) == a.prompt_tokens for a in answers),
        "server_rss_peak": server_rss_peak, "client_rss_peak": client_rss_peak,
        "request_bytes": sum(a.request_bytes for a in answers),
        "response_bytes": sum(a.response_bytes for a in answers),
        "resent": sum(a.resent for a in answers),
        "client_request_s": sum(a.posted - a.sent for a in answers) / len(answers),
        "answers": [{"user": a.user, "index": a.index, "item": asdict(a.item), "text": a.text,
                     "output_tokens": len(a.output_ids), "prompt_tokens": a.prompt_tokens,
                     "cached_tokens": a.cached_tokens, "resent": a.resent, "request_bytes": a.request_bytes,
                     "tower_s": a.tower_s,
                     "sent_s": a.sent - t0, "first_s": a.first - t0} for a in answers],
    }


# The server's stages of a request that SGLang's metrics (``--enable-metrics``) time, each a
# histogram: a metric family and the labels that pick its series.
SERVER_STAGES = {
    "server TTFT": ("sglang:time_to_first_token_seconds", {}),
    "request process": ("sglang:per_stage_req_latency_seconds", {"stage": "request_process"}),
    "queue": ("sglang:queue_time_seconds", {}),
    "prefill forward": ("sglang:per_stage_req_latency_seconds", {"stage": "prefill_forward"}),
}


def _metric_families(url: str) -> Iterator:
    """The metric families of the SGLang server at ``url`` (``--enable-metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text)


def prompt_tokens_taken(urls: list[str]) -> list[float]:
    """Each server's prompt tokens so far (``sglang:prompt_tokens_total``): behind a gateway, the
    difference over an episode says how its policy spread the turns (a health probe adds one)."""
    return [sum(sample.value for family in _metric_families(url) if family.name == "sglang:prompt_tokens"
                for sample in family.samples if sample.name.endswith("_total"))
            for url in urls]


def server_stage_totals(urls: list[str]) -> dict[str, tuple[float, float]]:
    """Each of ``SERVER_STAGES``'s (seconds, requests) so far, summed over the servers at ``urls``."""
    totals = {stage: [0.0, 0.0] for stage in SERVER_STAGES}
    for url in urls:
        for family in _metric_families(url):
            for stage, (name, labels) in SERVER_STAGES.items():
                if family.name != name:
                    continue
                for sample in family.samples:
                    if all(sample.labels.get(k) == v for k, v in labels.items()):
                        if sample.name.endswith("_sum"):
                            totals[stage][0] += sample.value
                        elif sample.name.endswith("_count"):
                            totals[stage][1] += sample.value
    return {stage: tuple(v) for stage, v in totals.items()}


def turn_stages(episode: dict, before: dict, after: dict) -> dict[str, float]:
    """Where an episode's mean time to first token went (seconds a turn): the client's stages
    (its tower, the rest of making the request), the trip to SGLang's route (sending, HTTP, body
    parsing), and the server's stages from the difference of its metrics ``before`` and ``after``
    the episode (``server_stage_totals``); "tokenize and return" is what the server's TTFT leaves
    after the scheduler's stages (the tokenizer manager: stock's image processor, our spans'
    placeholders; dispatch; the first token's way back). The stages add up to the mean TTFT."""
    server = {}
    for stage in SERVER_STAGES:
        seconds = after[stage][0] - before[stage][0]
        count = after[stage][1] - before[stage][1]
        if count != episode["turns"]:
            raise ValueError(f"{stage}: the servers counted {count:g} requests for {episode['turns']} turns")
        server[stage] = seconds / count
    tower = episode["client_tower_s"] / episode["turns"]
    ttft = sum(episode["ttft_s"]) / episode["turns"]
    scheduler = server["request process"] + server["queue"] + server["prefill forward"]
    return {
        "client tower": tower,
        "client request, less the tower": episode["client_request_s"] - tower,
        "to the route": ttft - episode["client_request_s"] - server["server TTFT"],
        "tokenize and return": server["server TTFT"] - scheduler,
        "request process": server["request process"],
        "queue": server["queue"],
        "prefill forward": server["prefill forward"],
    }


def ideal_hit_rate(answers: list[Answer], in_prefill: bool = True) -> float:
    """See the module docstring: prefixes shared with requests sent before each (``in_prefill``)
    or prefilled before it was posted, with their answers once done."""
    cached = 0
    for a in answers:
        best = 0
        start = a.sent if in_prefill else a.posted
        for b in answers:
            if in_prefill:
                prompt_counts = (b.sent, b.user) < (a.sent, a.user)  # sent before, maybe in prefill
            else:
                prompt_counts = b.first <= start  # its prefill done when ``a`` was posted
            if b.done <= start:
                best = max(best, _common_prefix(a.prompt_atoms, b.prompt_atoms + b.output_ids[:-1]))
            elif prompt_counts:
                best = max(best, _common_prefix(a.prompt_atoms, b.prompt_atoms))
        cached += min(best, len(a.prompt_atoms) - 1)
    return cached / sum(len(a.prompt_atoms) for a in answers)


def _common_prefix(x: list, y: list) -> int:
    n = min(len(x), len(y))
    for i in range(n):
        if x[i] != y[i]:
            return i
    return n
