"""Shared pieces of the benchmarks: the two servers (same SGLang build, plugin on / off), the demo
model's embedding table, timing helpers and the report table.

The stock side is the same installed SGLang with the sgl_embeds plugin not loaded (``STOCK_ENV``:
only the CPU kernels' plugin, which SGLang's CPU path needs to start, with SGLang's own attention),
so both sides run identical engine code.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import requests
import torch

from sgl_embeds.demo import demo_model_dir
from sgl_embeds_testing.server import Server

RESULTS = Path(__file__).with_name("results")
# Stock: ``SGLANG_PLUGINS`` filters the platform entry points too, so it names the CPU kernels'
# plugin (its sgl_kernel stand-ins: without them a CPU server exits at startup, as it did here from
# 4bb38f2 on) and not the span plugin; SGLANG_EMBEDS_CPU_ATTENTION=0 keeps SGLang's own attention.
# On a GPU the CPU kernels' plugin does nothing.
STOCK_ENV = {"SGLANG_PLUGINS": "sgl_embeds_cpu", "SGLANG_EMBEDS_CPU_ATTENTION": "0"}


def make_server(model_dir: Path, plugin: bool, extra: list[str] = (), dtype: str = "float32",
                env: dict[str, str] | None = None) -> Server:
    """A server (not started) on 127.0.0.1; ``env``: extra variables for it alone."""
    env = dict(env or {})
    if not plugin:
        env.update(STOCK_ENV)
    return Server(model_dir, extra_args=list(extra), dtype=dtype, env=env)


@contextmanager
def server(model_dir: Path, plugin: bool, extra: list[str] = (), dtype: str = "float32", env: dict[str, str] | None = None):
    """A started ``make_server``, stopped on exit."""
    s = make_server(model_dir, plugin, extra, dtype, env).start()
    try:
        yield s
    finally:
        s.stop()


def embedding_table(model_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    shard = next(model_dir.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def post(url: str, body: dict, timeout: float = 600) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), dt


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def p50(values: list[float]) -> float:
    return statistics.median(values)


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    out = [f"\n### {title}", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    text = "\n".join(out)
    print(text, flush=True)
    return text


def save(name: str, data: dict, text: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
    (RESULTS / f"{name}.md").write_text(text + "\n")


def machine() -> str:
    """The CPU by model and vector extensions (bfloat16 speed on CPU hangs on them), cores, GPU."""
    import platform

    import sglang

    cpu, flags = platform.machine(), set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    except OSError:
        pass
    simd = "+".join(f for f in ["avx2", "avx512f", "avx512_bf16", "amx_bf16"] if f in flags) or "no AVX2"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu} ({simd}), {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, sglang {sglang.__version__}"


def commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def provenance() -> str:
    """What a table was measured on: commit, machine and the exact command."""
    import shlex
    import sys

    command = "python benchmarks/" + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]])
    return f"commit {commit()}; machine: {machine()}; command: {command}"


def demo_dir() -> Path:
    return demo_model_dir()
