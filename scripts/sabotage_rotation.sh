#!/usr/bin/env bash
# CI's check that the tests still catch a deliberate break: one sabotage patch per run, applied
# and its tests run with a control run before it (scripts/sabotage.sh NAME); red unless caught.
# The patch is the commit's first-parent count modulo the number of patches, so any run of that
# many consecutive commits draws every patch once (the window: as many commits as there are patches).
# SABOTAGE=NAME picks one.
set -u
cd "$(dirname "$0")/.."
patches=($(ls tests/sabotage/*.patch | sort))
if [ -n "${SABOTAGE:-}" ]; then
  name="$SABOTAGE"
else
  index=$(( $(git rev-list --count --first-parent HEAD) % ${#patches[@]} ))
  name=$(basename "${patches[$index]}" .patch)
fi
echo "[sabotage] this run's deliberate break: $name, patch $(( ${index:-0} + 1 )) of ${#patches[@]} (tests: $(sed -n '1s/^tests: //p' "tests/sabotage/$name.patch"))"
bash scripts/sabotage.sh "$name"
