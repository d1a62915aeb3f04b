"""SGLang's children started by fork on a CPU server (``sgl_embeds_cpu.children``): only on CPU
and only in a single-threaded process at its first launch; elsewhere SGLang's spawn stands."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import multiprocessing, sys, threading, types
    from sgl_embeds_cpu.children import set_envs_and_config

    def sglangs(server_args):  # what SGLang's _set_envs_and_config does to the start method
        multiprocessing.set_start_method("spawn", force=True)

    device, threads, launches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()
    for _ in range(threads - 1):
        threading.Thread(target=stop.wait, daemon=True).start()
    for _ in range(launches - 1):  # an Engine launched before this one
        set_envs_and_config(sglangs, types.SimpleNamespace(device=device))
    set_envs_and_config(sglangs, types.SimpleNamespace(device=device))
    print(multiprocessing.get_start_method())
    stop.set()
""")


@pytest.mark.parametrize("device, threads, launches, method",
                         [("cpu", 1, 1, "fork"), ("cpu", 2, 1, "spawn"), ("cpu", 1, 2, "spawn"), ("cuda", 1, 1, "spawn")])
def test_children_are_forked_only_by_a_single_threaded_cpu_server(device, threads, launches, method):
    out = subprocess.run([sys.executable, "-c", PROBE, device, str(threads), str(launches)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == method
