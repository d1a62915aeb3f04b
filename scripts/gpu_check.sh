#!/usr/bin/env bash
# Run the project's tests on a CUDA machine (e.g. a lent GPU): the real sgl_kernel runs (the CPU
# kernels stay off: nothing opts in on a GPU, and a real sgl_kernel wins over them even where they
# are on), servers get CUDA launch flags, and the GPU-only tests in gpu/
# run where the machine allows (the TP test needs two GPUs).
# Usage: bash scripts/gpu_check.sh [pytest args]
# Every skipped test is listed with its reason. Exit status: pytest's own when it fails; 5 when
# nothing ran at all (everything skipped or deselected), so a silent no-op never looks like a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=1 bash scripts/setup.sh || exit 1   # SGLang with its CUDA dependencies (make setup GPU=1)
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || {
  echo "!!! [gpu_check] no CUDA device: nothing ran" >&2; exit 5; }
REPORT=$(mktemp --suffix=.xml)
.venv/bin/python -m pytest -q -rs --junitxml="$REPORT" "$@" tests gpu
status=$?
.venv/bin/python - "$REPORT" "$status" <<'PY'
import sys
import xml.etree.ElementTree as ET

suites = ET.parse(sys.argv[1]).getroot()
suites = [suites] if suites.tag == "testsuite" else list(suites)
total = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"[gpu_check] {total - skipped} tests ran, {skipped} skipped (reasons above), pytest exit {sys.argv[2]}")
for s in suites:
    for case in s.iter("testcase"):
        for skip in case.iter("skipped"):
            print(f"[gpu_check] SKIPPED {case.get('classname')}.{case.get('name')}: {skip.get('message')}")
sys.exit(5 if total - skipped == 0 else 0)
PY
ran=$?
rm -f "$REPORT"
[ "$status" -ne 0 ] && exit "$status"
exit "$ran"
