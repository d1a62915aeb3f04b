#!/usr/bin/env bash
# Runs tests on a deliberately broken build, to see that they catch the break:
#   scripts/sabotage.sh NAME [pytest arguments]
# runs the tests (default: those its first line names, "tests: <pytest arguments>") without the patch
# (the control: they must pass; or SABOTAGE_CONTROL, below), applies tests/sabotage/NAME.patch, runs them again and takes the
# patch out whatever happens; scripts/sabotage_verdict.py reads each run's JUnit report. Exit 0 when
# a test failed on an assertion (caught), 1 when they passed (not caught), 2 when the patch does not
# apply, 3 when the control failed or the broken run proved nothing (no test ran, errors only).
# Patches (tests/sabotage/): rows_bf16 (span rows rounded through bfloat16 on the float32 server),
# rows_scaled_1pct, spans_zeroed (every span all zeros: tests/examples/test_notebooks.py must fail on each
# notebook), images_reversed (a program's images in reverse order), ids_unplaced (an id refusal
# that does not say where the id stands), and breaks of the LLaVA-NeXT / OneVision vision half
# (anyres_*, siglip_*), and of Qwen3-VL spans: deepstack_layers_swapped (each deepstack layer's rows
# added one layer off), mrope_not_interleaved (the tiny Qwen3-VL's config: SGLang then applies M-RoPE
# unlike HF); of clip spans: clip_time_dropped (a Qwen2.5-VL clip's steps spaced without its
# seconds), clip_frames_reversed (a clip's temporal steps in reverse order); and of what keeps
# spans apart or counted: route_hint_without_grid (the grid left out of the gateway's routing hint), image_digest_without_size (the encoder cache's image digest without the
# image's size), vision_ids_unchecked (image_spans.check_vision_ids a no-op), logprob_start_ignored
# (span rows nulled in input logprobs as if they started at position 0), rows_cross_every_time
# (a kept span's rows sent to the scheduler with every request, not once per HTTP worker); and of
# Qwen3.5's recurrent state: mamba_state_not_restored (a prefix-cache hit's state not copied into the
# request's slot), conv_state_off_by_one (the conv state kept one position early); of Qwen3.5-MoE:
# shared_expert_gate_ungated (the shared expert's gate without its sigmoid); of the client's regions:
# region_ignored (sgl.region encodes the whole image, not the box); of the workload's smg arms:
# smg_route_bypassed (workload.route hands out a worker's URL, not its gateway's); of a split LLM's
# weights: split_weights_unrenamed (read under the checkpoint's names: SGLang keeps its initial values).
set -u
cd "$(dirname "$0")/.."
patch="tests/sabotage/$1.patch"
shift
git apply --check "$patch" || exit 2
if [ $# -eq 0 ]; then
    # the patch's first line names the tests that must catch it ("tests: <pytest arguments>")
    eval "set -- $(sed -n '1s/^tests: //p' "$patch")"
fi
report=$(mktemp -d)
run() { .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml="$report/$1.xml" "${@:2}" >"$report/$1.log" 2>&1; }
# the control: the same tests without the patch must run and pass, or a failure below means nothing.
# SABOTAGE_CONTROL=REPORT (make test: the JUnit report of the whole suite's run of this commit, just
# before): the named tests are collected and each must have passed there, instead of running again
if [ -n "${SABOTAGE_CONTROL:-}" ]; then
    .venv/bin/python -m pytest -q -p no:cacheprovider --collect-only "$@" >"$report/control.log" 2>&1
    control=(scripts/sabotage_verdict.py "$SABOTAGE_CONTROL" control --only "$report/control.log")
else
    run control "$@"
    control=(scripts/sabotage_verdict.py "$report/control.xml" control)
fi
if ! .venv/bin/python "${control[@]}"; then
    tail -n 30 "$report/control.log"; rm -rf "$report"; exit 3
fi
git apply "$patch"
trap 'git apply -R "$patch"; rm -rf "$report"' EXIT
run broken "$@"
.venv/bin/python scripts/sabotage_verdict.py "$report/broken.xml" broken
verdict=$?
[ $verdict -eq 0 ] || tail -n 30 "$report/broken.log"
echo "sabotage $patch: $([ $verdict -eq 0 ] && echo caught || echo 'not caught')"
exit $verdict
