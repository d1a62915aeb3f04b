#!/usr/bin/env bash
# `pip install .` as a user does it, checked without a network: a fresh venv that sees .venv's
# packages (SGLang, torch, ...) after its own, this checkout installed into it (not editable), then,
# from outside the checkout, the package and the plugin import from that venv, the console script
# `sgl_embeds serve` serves the demo model with the plugin, and `sgl_embeds.connect` gets an answer
# to a prompt with a span. Also `python -m build --wheel` (no isolation: no network), and what the
# wheel holds (the entry points, the console script, the C extension where a compiler is; no .pth),
# and that the CPU kernels load in the installed package only with their opt-in.
# Usage: bash scripts/check_install.sh   (after `make setup`; ~1-2 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT=$PWD
PY=$CHECKOUT/.venv/bin/python
TMP=$(mktemp -d)
SERVER_PID=
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
step() { echo "==> [check_install] $1"; }

step "python -m build --wheel"
"$PY" -m build --wheel --no-isolation --outdir "$TMP/dist" . >"$TMP/build.log" 2>&1 \
  || { tail -n 30 "$TMP/build.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/*.whl)
"$PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert not [n for n in names if n.endswith(".pth")], "the wheel has a .pth: it would run in every interpreter"
assert "sgl_embeds_cpu/kernels.py" in names, "the wheel lacks the CPU kernels"
assert "sgl_embeds_protocol/wire.py" in names, "the wheel lacks the shared protocol package"
assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))], "the wheel carries tests or benchmarks"
points = next(n for n in names if n.endswith("entry_points.txt"))
text = zipfile.ZipFile(sys.argv[1]).read(points).decode()
for line in ("sgl_embeds = sgl_embeds.__main__:main", "[sglang.srt.plugins]", "sgl_embeds = sgl_embeds_srt.plugin:register",
             "sgl_embeds_cpu = sgl_embeds_cpu.plugin:register", "[sglang.srt.platforms]",
             "sgl_embeds_cpu = sgl_embeds_cpu.plugin:activate"):
    assert line in text, (line, text)
native = any("_row_digests" in n for n in names)
print(f"    {sys.argv[1].rsplit('/', 1)[-1]}: plugin, CPU kernels' entry points, console script, no .pth; C extension: {native}")
PY

step "a fresh venv that sees .venv's packages (pip and setuptools too) after its own"
BASE=$("$PY" -c 'import sys; print(sys._base_executable)')
"$BASE" -m venv --without-pip "$TMP/venv"  # pip and setuptools: .venv's
SITE=$("$TMP/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zzz_base_venv.pth"

step "pip install . (no deps, no network)"
"$TMP/venv/bin/python" -m pip install -q --no-deps --ignore-installed --no-build-isolation --no-index "$CHECKOUT" \
  >"$TMP/pip.log" 2>&1 || { tail -n 30 "$TMP/pip.log"; exit 1; }

DEMO=$("$PY" -c 'from sgl_embeds.demo import demo_model_dir; print(demo_model_dir())')
cd "$TMP"  # nothing of the checkout on sys.path from here on
export -n PYTHONPATH 2>/dev/null || true
unset PYTHONPATH
env -u SGLANG_EMBEDS_CPU_KERNELS "$TMP/venv/bin/python" - "$TMP/venv" <<'PY'
import sys
from importlib.metadata import entry_points
import sgl_embeds, sgl_embeds_srt.plugin
import sglang.srt.utils.common  # SGLang resolves its platform: the CPU kernels' entry point runs
for module in (sgl_embeds, sgl_embeds_srt.plugin, sys.modules["sgl_embeds_cpu.plugin"]):
    assert module.__file__.startswith(sys.argv[1]), f"{module.__name__} from {module.__file__}"
plugin = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "sgl_embeds"]
assert plugin and plugin[0].load().__module__ == "sgl_embeds_srt.plugin", plugin
assert not [f for f in sys.meta_path if getattr(f, "sgl_embeds_fallback", False)], sys.meta_path
loaded = [m for m in sys.modules if m.startswith(("sgl_kernel", "sgl_embeds_cpu."))]
assert loaded == ["sgl_embeds_cpu.plugin"], loaded
print(f"    sgl_embeds and its plugin import from {sys.argv[1]}; without the opt-in no CPU kernel loads")
PY
# with the opt-in (what `sgl_embeds serve` sets on CPU), SGLang turns the installed kernels on
SGLANG_USE_CPU_ENGINE=1 SGLANG_EMBEDS_CPU_KERNELS=1 "$TMP/venv/bin/python" - "$TMP/venv" <<'PY'
import sys
import torch
import sglang.srt.utils.common  # noqa: F401
import sgl_kernel
if not torch.cuda.is_available():
    assert sgl_kernel.__file__.startswith(sys.argv[1]), f"sgl_kernel from {sgl_kernel.__file__}"
print(f"    with SGLANG_EMBEDS_CPU_KERNELS=1: sgl_kernel from {sgl_kernel.__file__}")
PY

step "sgl_embeds serve DEMO (the console script), then connect + a span"
PORT=$("$TMP/venv/bin/python" -c 'from sgl_embeds_testing.server import free_port; print(free_port())')
HF_HUB_OFFLINE=1 "$TMP/venv/bin/sgl_embeds" serve "$DEMO" --host 127.0.0.1 --port "$PORT" \
  >"$TMP/server.log" 2>&1 &
SERVER_PID=$!
"$TMP/venv/bin/python" - "http://127.0.0.1:$PORT" "$TMP/server.log" <<'PY'
import sys, time
import requests
url, log = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 240
while "fired up and ready to roll" not in open(log, errors="replace").read():
    if time.monotonic() > deadline:
        sys.exit("the server did not start:\n" + open(log, errors="replace").read()[-3000:])
    time.sleep(1)
import torch
import sgl_embeds
from sgl_embeds import Span, Text
backend = sgl_embeds.connect(url)
assert backend.server_info.model.served_as == "text" and backend.vision_encoder is None
rows = torch.randn(4, backend.span_width)
out = backend.run(input_segments=[Text("Here: "), Span(rows), Text(" What is the capital of France?")],
                  sampling_params={"max_new_tokens": 8, "temperature": 0})
assert out["meta_info"]["completion_tokens"] > 0, out
print("    " + next(line for line in open(log) if line.startswith("[serve]"))[:110] + "...")
print(f"    served with the plugin; answer to a span prompt: {out['text']!r}")
PY
step "ok"
