#!/usr/bin/env bash
# Run the project's tests on a CUDA machine (e.g. a lent GPU): the real sgl_kernel replaces the CPU
# fallback (the finder defers to it), servers get CUDA launch flags, and the TP test runs when two
# GPUs are present. Usage: bash scripts/gpu_check.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q "sglang==0.5.23"   # with its CUDA dependencies this time
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
.venv/bin/python -m pytest -q "$@" tests gpu
