#!/usr/bin/env bash
# The HTTP and id fuzzers (tests/server/test_fuzz_http.py, test_fuzz_ids.py) on a server of every
# family, with N random examples per fuzzer and server instead of CI's fixed, derandomized few:
# `scripts/fuzz_long.sh [N] [pytest args...]` (N: 500 by default; e.g. `-k qwen3_vl_spans` for one
# family). Prints each family's counted outcomes ("fuzz <server>: ..."), which docs/reliability.md
# records; a failing example is printed by hypothesis, shrunk, for a regression test.
set -euo pipefail
cd "$(dirname "$0")/.."
examples=${1:-500}
shift || true
SGLANG_EMBEDS_FUZZ_EXAMPLES=$examples .venv/bin/python -m pytest -q -s -p no:cacheprovider \
  tests/server/test_fuzz_http.py tests/server/test_fuzz_ids.py "$@" | grep -E "^fuzz |passed|failed|Error|Falsifying" 
