"""Shared fixtures: test models built once per run, one real SGLang server per configuration.

Shared servers live in one session pool (``servers``): each starts when a test first needs it,
those a test needs together start together, at most ``MAX_RUNNING`` run at once (the one needed
again last stops to make room, and restarts on the same port when needed again), and all stop
together at the end, by their own pids. The tests that use them run in the order that starts
them fewest times (``_fewest_launches``). Before each test, the pooled servers its fixtures name
(``<name>_server``, ``gateway``) are made to run. Tests live in folders by what they need
(``unit/``: no server; ``server/``: a real SGLang server; ``vlm/``: the vision model families, with
or without one; ``examples/``: the tutorials). Tests that use a server, and every test under
``server/``, are marked ``server``; the quick edit-test loop is ``pytest -m "not server"``. Shared
test code lives beside this file: ``helpers.py`` (request builders, HF references),
``fake_server.py`` (a fake plugin worker over HTTP), ``strategies.py`` (the fuzzers' strategies),
``llava_harness.py`` (the LLaVA families against their servers), ``qwen_vl_harness.py`` (image
spans on a Qwen-VL server), ``engine_probe.py``.
"""

from __future__ import annotations

import bisect
import os
import functools
import math

import pytest
import torch
from hypothesis.internal.conjecture import providers as hypothesis_providers

if not torch.cuda.is_available():
    # this process imports SGLang's CPU path (unit tests, test helpers that start an Engine), and
    # the servers and children it starts inherit the opt-in: the CPU kernels on, before SGLang's
    # first import (sgl_embeds_cpu/plugin.py)
    from sgl_embeds_cpu import plugin as cpu_plugin

    cpu_plugin.turn_on()

from sgl_embeds_testing.llava_next import tiny_llava_next_dir, tiny_llava_onevision_dir
from sgl_embeds.demo import demo_model_dir
from sgl_embeds_testing.models import tiny_llava_dir, tiny_model_dir
from sgl_embeds_testing.gemma3 import tiny_gemma3_dir
from sgl_embeds_testing.gemma4 import tiny_gemma4_dir
from sgl_embeds_testing.florence2 import tiny_florence2_dir
from sgl_embeds_testing.paligemma import tiny_paligemma_dir
from sgl_embeds_testing.qwen_vl import (
    poisoned_vision_dir, tiny_qwen2_5_vl_dir, tiny_qwen2_vl_dir, tiny_qwen3_5_dir, tiny_qwen3_5_moe_dir,
    tiny_qwen3_vl_dir,
)
from sgl_embeds_testing.reference import at_most_one_forgiven_near_tie_per_test  # noqa: F401 (autouse)
from sgl_embeds_testing import notebook_kernels, zygote
from sgl_embeds_testing.server import Gateway, Server, ServerPool, cpu_env, free_port

def pytest_configure(config):
    # Hypothesis draws some values from the literals of every local module imported so far
    # (providers._get_local_constants), so a seeded stream changed with the tests collected beside
    # it and with any edit anywhere: the fuzzers' fixed examples reached a check in one run and
    # missed it in CI's. Without that pool a seed's stream depends on the seed and the strategies
    # alone (tests/unit/test_fuzz_streams.py).
    assert callable(getattr(hypothesis_providers, "_get_local_constants", None)), \
        "hypothesis moved _get_local_constants: the fuzzers' seeded streams are no longer fixed (tests/conftest.py)"
    hypothesis_providers._get_local_constants = hypothesis_providers.Constants
    hypothesis_providers.CONSTANTS_CACHE.cache.clear()


# Each server holds ~1.5 GB (its three processes, children forked: a tiny Llama's PSS 1.47 GB; 1.96
# GB by `free` when they were spawned) and a test may start more of its own, inside this cap
# (``ServerPool.make_room``). Eight: 27 launches for the run's 22 servers (29 with six, 35 with
# four; each launch is ~17 s of CPU, most of it SGLang's own import)
MAX_RUNNING = 8
POOL_KEY = pytest.StashKey[ServerPool]()
# the pool's Llama server and a second one like it: one launch fewer than two of the gateway's own
# (the gateway tests measure each worker's counts as differences, so what the first one served
# before does not matter). The second serves HTTP with granian (SGLang's --enable-http2), the
# first with uvicorn: the gateway's tests and test_binary_body_http.py hold the plugin to the same
# answers under both servers SGLang runs, without a launch of its own
GATEWAY_WORKERS = ("llama", "gateway_worker")
GRANIAN_ARGS = ["--enable-http2"]

# A small chunk and KV pool: spans get split across chunks, and decode runs out of KV and retracts.
CONSTRAINED_ARGS = ["--chunked-prefill-size", "16", "--max-total-tokens", "256", "--max-running-requests", "8",
                    "--schedule-conservativeness", "0.01",
                    "--page-size", "1"]
# A natively served Qwen2.5-VL: SGLang's multimodal path, the vision tower's attention in sdpa on CPU
QWEN_VL_ARGS = ["--enable-multimodal", "--mm-attention-backend", "sdpa", "--enable-cache-report"]
QWEN_VL_SPANS_ARGS = ["--skip-server-warmup", "--chunked-prefill-size", "8", "--max-total-tokens", "256",
                      "--max-running-requests", "8", "--schedule-conservativeness", "0.01"]
QWEN3_5_ARGS = ["--skip-server-warmup", "--chunked-prefill-size", "16", "--max-mamba-cache-size", "64",
                "--max-total-tokens", "256", "--max-running-requests", "8", "--schedule-conservativeness", "0.01"]


@pytest.fixture(scope="session")
def llama_dir():
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def qwen_dir():
    return tiny_model_dir("qwen2")


def _qwen_with_events() -> Server:
    """Also publishes metrics and radix-cache events (ZMQ on loopback, ``kv_events_port``):
    tests/server/test_compat_metrics.py reads them."""
    port = free_port()
    events = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:%d", "bind": true, "topic": "kv"}' % port
    server = Server(tiny_model_dir("qwen2"), extra_args=["--enable-metrics", "--enable-cache-report", "--kv-events-config", events])
    server.kv_events_port = port
    return server


@pytest.fixture(scope="session")
def qwen_vl_dir():
    return tiny_qwen2_5_vl_dir()


# The tiny LLaVA-style checkpoints by name: LLaVA-1.5 by its language model, then the families
LLAVA_CHECKPOINTS = {"llama": lambda: tiny_llava_dir("llama"), "qwen2": lambda: tiny_llava_dir("qwen2"),
                     "llava_next": tiny_llava_next_dir, "llava_onevision": tiny_llava_onevision_dir}


@pytest.fixture(scope="session")
def llava_dirs(tmp_path_factory):
    """``llava_dirs(name)``: (checkpoint dir, split dir) of the tiny LLaVA ``name`` of
    ``LLAVA_CHECKPOINTS`` (LLaVA-1.5 with the ``"llama"`` or ``"qwen2"`` language model,
    ``"llava_next"``, ``"llava_onevision"``), split on first use."""
    from sgl_embeds.vlm import split

    made = {}

    def dirs(name: str):
        if name not in made:
            src, dst = LLAVA_CHECKPOINTS[name](), tmp_path_factory.mktemp(f"llava-{name}-split")
            split(src, dst, log=lambda message: None)
            made[name] = (src, dst)
        return made[name]

    return dirs


@pytest.fixture(scope="session")
def servers(llava_dirs, pytestconfig, tmp_path_factory, request):
    """The session's pool of servers by name (``servers.get(*names)``)."""
    # the servers a user would start: `python -m sgl_embeds serve CHECKPOINT` (its splits here),
    # one of each family at least: LLaVA-1.5, -NeXT, -OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5
    served = dict(via_serve=True, env={"SGLANG_EMBEDS_CACHE": str(tmp_path_factory.mktemp("serve-cache"))})
    zygote.shared(cpu_env())  # it imports SGLang while the first tests run
    if any(item.path.parent.name == "examples" for item in request.session.items):
        notebook_kernels.start(dict(os.environ))  # the tutorials' kernels' zygote imports the client
    pool = ServerPool({
        # JSON-schema decoding without free whitespace: a random-weight model otherwise fills any
        # allowed whitespace until max_new_tokens (tests/server/test_compat_constrained.py)
        "llama": lambda: Server(tiny_model_dir("llama"), extra_args=["--enable-cache-report", "--constrained-json-disable-any-whitespace"]),
        "qwen": _qwen_with_events,
        "constrained": lambda: Server(tiny_model_dir("llama"), extra_args=CONSTRAINED_ARGS),
        # the demo model (SmolLM2-135M-Instruct, float32): for tutorials whose answers must be right
        "demo": lambda: Server(demo_model_dir()),
        "llava_llama": lambda: Server(llava_dirs("llama")[0], extra_args=["--enable-cache-report"], **served),
        "llava_qwen": lambda: Server(llava_dirs("qwen2")[1] / "llm", extra_args=["--enable-cache-report"]),
        # the any-resolution families (Llama and Qwen2 language models), split by serve
        "llava_next": lambda: Server(llava_dirs("llava_next")[0], extra_args=["--enable-cache-report"], **served),
        "llava_onevision": lambda: Server(llava_dirs("llava_onevision")[0], extra_args=["--enable-cache-report"],
                                          **served),
        "gateway_worker": lambda: Server(tiny_model_dir("llama"), extra_args=["--enable-cache-report",
                                                                              *GRANIAN_ARGS]),
        # with SGLang's metrics: the workload test reads its stage timings
        "qwen_vl": lambda: Server(tiny_qwen2_5_vl_dir(), extra_args=["--enable-cache-report", "--enable-metrics"],
                                  **served),
        # Qwen3-VL with its working tower, served by `sgl_embeds serve`: raw images beside spans
        "qwen3_vl": lambda: Server(tiny_qwen3_vl_dir(), extra_args=["--enable-cache-report"], **served),
        # image spans: NaN vision weights (the tower must never run on spans; no warm-up request,
        # whose image would run the NaN tower, and SGLang then answers every later request with
        # token 0, ours or not), prefill chunks of 8 positions, so every image is cut, and a KV
        # pool of 256 positions, so that concurrent requests retract
        "qwen_vl_spans": lambda: Server(poisoned_vision_dir(tiny_qwen2_5_vl_dir()),
                                        extra_args=[*QWEN_VL_ARGS, *QWEN_VL_SPANS_ARGS]),
        # the other Qwen-VL families, likewise: Qwen3-VL (deepstack) and Qwen2-VL
        "qwen3_vl_spans": lambda: Server(poisoned_vision_dir(tiny_qwen3_vl_dir()),
                                         extra_args=[*QWEN_VL_ARGS, *QWEN_VL_SPANS_ARGS]),
        "qwen2_vl_spans": lambda: Server(poisoned_vision_dir(tiny_qwen2_vl_dir()),
                                         extra_args=[*QWEN_VL_ARGS, *QWEN_VL_SPANS_ARGS], **served),
        # Qwen3.5 (hybrid: Gated DeltaNet + full attention; tests/vlm/test_qwen3_5.py): NaN vision
        # weights as above; prefill chunks of 16 positions, so the recurrent state crosses chunks
        # and spans are cut; a small state pool, and a KV pool of 256 positions, so that concurrent
        # requests retract; the conv state in float32 as serve sets it for a float32 model
        # (serve.hybrid_env: SGLang's default bfloat16 moved logprobs by up to 4e-3 from HF's); the
        # checkpoints are as transformers saves them, and serve writes the config fields SGLang
        # reads that they lack (serve.hybrid_config_fixes)
        "qwen3_5": lambda: Server(poisoned_vision_dir(tiny_qwen3_5_dir()), via_serve=True,
                                  env=served["env"],
                                  extra_args=[*QWEN_VL_ARGS, *QWEN3_5_ARGS]),
        # Qwen3.5-MoE (its LLM's MLPs mixtures of experts), likewise: one parity test
        "qwen3_5_moe": lambda: Server(poisoned_vision_dir(tiny_qwen3_5_moe_dir()), via_serve=True,
                                      env=served["env"], extra_args=[*QWEN_VL_ARGS, *QWEN3_5_ARGS]),
        # a Gemma 3 LLM: sliding-window layers (a window of 8) beside full ones, 16-position chunks
        # (tests/server/test_bidirectional_spans.py)
        "gemma3": lambda: Server(tiny_model_dir("gemma3"), extra_args=["--enable-cache-report",
                                                                       "--chunked-prefill-size", "16"]),
        # Gemma 3, split by serve (tests/vlm/test_gemma3_parity.py): each image one block; its
        # sliding-window layers see 8 positions; 10-position prefill chunks cut images
        "gemma3_vlm": lambda: Server(tiny_gemma3_dir(), via_serve=True, env=served["env"],
                                     extra_args=["--enable-cache-report", "--chunked-prefill-size", "10"]),
        # Gemma 4 (E2B / E4B layout), split by serve (tests/vlm/test_gemma4_parity.py): images
        # causal, per-layer inputs at the span rows by the pad id; 16-position prefill chunks cut
        # images (63 to 70 rows)
        "gemma4_vlm": lambda: Server(tiny_gemma4_dir("e2b"), via_serve=True, env=served["env"],
                                     extra_args=["--enable-cache-report", "--chunked-prefill-size", "16"]),
        # Gemma 4 (26B / 31B layout), split by serve (tests/vlm/test_gemma4_31b_parity.py): each
        # image one block on the sliding layers only; 16-position prefill chunks
        "gemma4_31b_vlm": lambda: Server(tiny_gemma4_dir("31b"), via_serve=True, env=served["env"],
                                         extra_args=["--enable-cache-report", "--chunked-prefill-size", "16"]),
        # PaliGemma and PaliGemma 2, split by serve (tests/vlm/test_paligemma_parity.py): each
        # prompt one bidirectional block; PaliGemma 1's cut by 8-position prefill chunks
        "paligemma": lambda: Server(tiny_paligemma_dir(1), via_serve=True, env=served["env"],
                                    extra_args=["--enable-cache-report", "--chunked-prefill-size", "8"]),
        "paligemma2": lambda: Server(tiny_paligemma_dir(2), via_serve=True, env=served["env"],
                                     extra_args=["--enable-cache-report"]),
        # Florence-2, served whole by serve (tests/vlm/test_florence2.py): an encoder-decoder whose
        # encoder regions (30 to 42 positions) 16-position prefill chunks would cut
        "florence2": lambda: Server(tiny_florence2_dir(), via_serve=True, env=served["env"],
                                    extra_args=["--enable-cache-report", "--chunked-prefill-size", "16"]),
        # stock SGLang (the plugin off) tuned as benchmarks/bench_vlm_wins.py tunes it
        # (tests/server/test_vlm_wins.py); a fresh interpreter's launch, which the pool starts early
        "qwen_vl_stock_tuned": _tuned_stock,
    }, max_running=MAX_RUNNING)
    pytestconfig.stash[POOL_KEY] = pool
    yield pool
    pool.stop()
    zygote.stop_shared()
    notebook_kernels.stop()


def _tuned_stock() -> Server:
    import bench_vlm_wins
    from common import make_server

    return make_server(tiny_qwen2_5_vl_dir(), plugin=False, extra=[*bench_vlm_wins.MM_ARGS, *bench_vlm_wins.TUNED_ARGS],
                       env=bench_vlm_wins.TUNED_ENV)


def _pooled(name: str):
    """The session fixture ``<name>_server``: the pool's server ``name`` (the same object all
    session; ``pytest_runtest_setup`` has it running for each test that names it)."""

    @pytest.fixture(scope="session", name=f"{name}_server")
    def server(servers):
        return servers.get(name)[0]

    return server


POOLED = ["llama", "qwen", "constrained", "demo", "llava_llama", "llava_qwen", "llava_next", "llava_onevision",
          "qwen_vl", "qwen_vl_spans", "qwen3_vl", "qwen3_vl_spans", "qwen2_vl_spans", "qwen3_5", "qwen3_5_moe",
          "qwen_vl_stock_tuned"]
(llama_server, qwen_server, constrained_server, demo_server, llava_llama_server, llava_qwen_server,
 llava_next_server, llava_onevision_server, qwen_vl_server, qwen_vl_spans_server, qwen3_vl_server,
 qwen3_vl_spans_server, qwen2_vl_spans_server, qwen3_5_server, qwen3_5_moe_server,
 qwen_vl_stock_tuned_server) = map(_pooled, POOLED)


@pytest.fixture(scope="session")
def gateway(servers):
    """SGLang's gateway (smg, cache-aware policy) in front of two Llama plugin workers
    (``GATEWAY_WORKERS``): the gateway's ``url`` and its ``workers`` (``Server`` objects)."""
    workers = servers.get(*GATEWAY_WORKERS)
    gw = Gateway([w.url for w in workers]).start()
    gw.workers = workers
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def llava_llama(llava_dirs):
    """(checkpoint dir, split dir) of the tiny LLaVA with the Llama language model."""
    return llava_dirs("llama")


@pytest.fixture(scope="session")
def llava_qwen(llava_dirs):
    return llava_dirs("qwen2")


def _pooled_names(item) -> list[str]:
    """The pool's servers a test asks for: by fixture (``<name>_server``, ``gateway``), or by a
    ``pooled`` mark (a parameter naming the server: ``helpers.pooled``)."""
    fixtures = getattr(item, "fixturenames", ())
    names = [name.removesuffix("_server") for name in fixtures if name.endswith("_server")]
    marked = [name for mark in item.iter_markers("pooled") for name in mark.args]
    return list(dict.fromkeys([name for name in names if name in POOLED] + marked
                              + (list(GATEWAY_WORKERS) if "gateway" in fixtures else [])))


@pytest.fixture(scope="session", autouse=True)
def _pool_when_a_test_needs_it(request):
    """The pool exists from the first test on when any selected test needs a pooled server, so
    the first servers start while the tests before them run (``_prefetch_ahead``)."""
    if any(_pooled_names(item) for item in request.session.items):
        request.getfixturevalue("servers")


# How far ahead (in tests) a server is launched early: far enough to overlap its start with the
# tests before it, near enough that it does not stop a running server that is still needed
PREFETCH_HORIZON = 400


def _prefetch_ahead(pool: ServerPool, items: list, index: int) -> None:
    """Launch the first pooled server a later test asks for that is not running, keeping the
    servers the tests until then ask for (``ServerPool.prefetch``)."""
    needed_before: set[str] = set()
    for later in items[index + 1:index + 1 + PREFETCH_HORIZON]:
        names = _pooled_names(later)
        absent = [name for name in names if name not in pool.running and name not in pool.launched]
        if absent:
            pool.prefetch(absent[0], keep=needed_before | set(names))
            return
        needed_before |= set(names)


def _next_use(items: list, index: int, name: str) -> float:
    """The index of the first test after ``items[index]`` that asks for ``name`` (inf: none)."""
    uses = _uses_of(tuple(items))
    later = uses.get(name, [])
    position = bisect.bisect_right(later, index)
    return later[position] if position < len(later) else math.inf


@functools.lru_cache(maxsize=1)
def _uses_of(items: tuple) -> dict[str, list[int]]:
    """Each pooled server's tests, by index in ``items``."""
    uses: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        for name in _pooled_names(item):
            uses.setdefault(name, []).append(i)
    return uses


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: the pooled servers it names run (once the pool exists; the
    first test to name one starts the pool through its fixtures), and the next server a later
    test needs is launched early."""
    pool = item.config.stash.get(POOL_KEY, None)
    if pool is not None:
        items = item.session.items
        index = items.index(item)
        pool.next_use = lambda name: _next_use(items, index, name)
        pool.begin_test()
        if names := _pooled_names(item):
            pool.get(*names)
        _prefetch_ahead(pool, items, index)


def pytest_terminal_summary(terminalreporter, config):
    """The pool's launches and the time tests waited for them: where a run's minutes go."""
    pool = config.stash.get(POOL_KEY, None)
    if pool is not None and pool.starts:
        terminalreporter.write_sep("-", "pooled servers: launches and waits")
        for line in pool.start_report():
            terminalreporter.write_line(line)
    import helpers  # (here: it imports SGLang, which the CPU plugin must precede)

    lines = config.stash.get(helpers.SUMMARY_LINES, [])
    if lines:
        terminalreporter.write_sep("-", "what the tests counted")
        for line in lines:
            terminalreporter.write_line(line)


# The folders in the order they run, unit tests first (then ``_fewest_launches`` moves the tests
# that use pooled servers).
FOLDERS = ("unit", "server", "vlm", "examples")


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.parent.name
        uses_a_server = any(name.endswith("_server") or name in ("gateway", "servers")
                            for name in getattr(item, "fixturenames", ()))
        if uses_a_server or folder == "server":  # tests/server/: a pooled server, or its own
            item.add_marker(pytest.mark.server)
        if folder == "vlm":
            item.add_marker(pytest.mark.vlm)
    # stable: file order within a folder
    items.sort(key=lambda item: FOLDERS.index(item.path.parent.name) if item.path.parent.name in FOLDERS else -1)
    items[:] = _fewest_launches(items)


def _launches(unit: list, running: list[str]) -> int:
    """How many pooled servers ``unit``'s tests start, from ``running`` (least recently used
    first, updated in place: the pool's state after them, as ``MAX_RUNNING`` allows)."""
    count = 0
    for item in unit:
        names = _pooled_names(item)
        for name in names:
            if name in running:
                running.remove(name)
            else:
                count += 1
                idle = [n for n in running if n not in names]
                while len(running) >= MAX_RUNNING and idle:
                    running.remove(idle.pop(0))
            running.append(name)
    return count


def _fewest_launches(items: list) -> list:
    """``items`` with the tests that use pooled servers last, in an order that starts each server
    as few times as possible (each start costs ~40 s of this machine's two cores). They run in
    units (a module's tests; in a module marked ``per_server``, its tests of each set of servers:
    the fuzzers, the programs, the tutorials, each on the servers of every family), greedily: next,
    the unit that starts the fewest servers given those running then, ties in file order. The
    tests are independent of their order (issue #48), so only their servers' starts change."""
    pooled = [item for item in items if _pooled_names(item)]
    units: dict[tuple, list] = {}
    for item in pooled:
        servers = tuple(sorted(_pooled_names(item))) if item.get_closest_marker("per_server") else ()
        units.setdefault((item.path, servers), []).append(item)
    left, ordered, running = list(units.values()), [], []
    while left:
        unit = min(left, key=lambda u: _launches(u, list(running)))  # the first of the fewest
        _launches(unit, running)
        left.remove(unit)
        ordered.extend(unit)
    return [item for item in items if not _pooled_names(item)] + ordered
