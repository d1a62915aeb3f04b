#!/usr/bin/env bash
# The exactness-sensitive tests (marker `exactness`: numbers of two code paths compared without a
# server) run again with AVX2 kernels, where this processor has AVX-512: the suite must pass on
# processors of both kinds (an AMD EPYC with AVX2 only, an Intel Xeon with AVX-512), and a test
# that demands bit equality across a batching change holds on one of them only. The variables
# below are what torch 2.14's ATen, its MKL and its oneDNN honour; the check after them makes
# sure ATen and MKL took them, so the run cannot silently test the AVX-512 kernels twice.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "[portable] no AVX-512 on this processor: the main run already used AVX2 kernels"
  exit 0
fi
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
capability=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
mkl=$(MKL_VERBOSE=1 "$PY" -c "import torch; torch.randn(8, 8) @ torch.randn(8, 8)" 2>&1 | grep -m1 "oneMKL" || true)
# MKL names the instruction set it dispatched to on Intel processors only ("(Intel(R) AVX2)
# enabled"); on an AMD EPYC its line names none, so there only ATen's capability is checkable
if [[ "$mkl" == *" enabled processors"* ]]; then
  mkl_isa=$([[ "$mkl" == *"(Intel(R) AVX2) enabled"* ]] && echo AVX2 || echo "not AVX2")
else
  mkl_isa="unreported (not an Intel processor)"
fi
if [ "$capability" != "AVX2" ] || [ "$mkl_isa" = "not AVX2" ]; then
  echo "[portable] the AVX2 settings did not take: ATen uses $capability; MKL says: $mkl" >&2
  exit 1
fi
echo "[portable] the exactness-sensitive tests again with AVX2 kernels (ATen $capability, MKL $mkl_isa)"
"$PY" -m pytest -q -p no:cacheprovider -m "exactness and not server" "$@"
