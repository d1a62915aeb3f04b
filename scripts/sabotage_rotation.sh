#!/usr/bin/env bash
# CI's check that the tests still catch a deliberate break: one sabotage patch per run, in
# rotation (chosen by the commit under test, so successive commits try different ones), applied
# and its tests run (scripts/sabotage.sh NAME); red unless they fail. SABOTAGE=NAME picks one.
set -u
cd "$(dirname "$0")/.."
patches=($(ls tests/sabotage/*.patch | sort))
if [ -n "${SABOTAGE:-}" ]; then
  name="$SABOTAGE"
else
  index=$(( 16#$(git rev-parse --short=8 HEAD) % ${#patches[@]} ))
  name=$(basename "${patches[$index]}" .patch)
fi
echo "[sabotage] this run's deliberate break: $name (tests: $(sed -n '1s/^tests: //p' "tests/sabotage/$name.patch"))"
bash scripts/sabotage.sh "$name"
