"""The zygote the test servers are forked from: a child gets its own arguments, environment,
directory, random state and exit code; an ``exec`` of this Python runs in place only while the
child is as single-threaded as the zygote; a launch whose environment differs in what an import
reads starts a fresh interpreter."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from sgl_embeds_testing import zygote
from sgl_embeds_testing.server import cpu_env

pytestmark = pytest.mark.server  # the shared zygote imports SGLang

REPORT = textwrap.dedent("""
    import json, os, random, sys
    import numpy
    print(json.dumps({"argv": sys.argv[1:], "cache": os.environ.get("SGLANG_EMBEDS_CACHE"),
                      "cwd": os.getcwd(), "pid": os.getpid(),
                      "random": [random.random(), float(numpy.random.random())],
                      "preloaded": "sglang.srt.entrypoints.http_server" in sys.modules}))
    """)


@pytest.fixture(scope="module")
def forker():
    if not zygote.enabled():
        pytest.skip(f"{zygote.SWITCH}=0: the servers start fresh interpreters")
    return zygote.shared(cpu_env())


def _spawned(forker, tmp_path, argv, env, name="out"):
    out, err = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
    child = forker.spawn(argv, env, out, cwd=str(tmp_path), err_path=err)
    code = child.wait(120)
    return code, out.read_text(), err.read_text()


def test_a_child_runs_with_its_own_arguments_environment_directory_and_random_state(forker, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT + "sys.exit(3)\n")
    env = {**cpu_env(), "SGLANG_EMBEDS_CACHE": str(tmp_path / "cache")}
    reports = []
    for name in ("first", "second"):
        code, out, err = _spawned(forker, tmp_path, [str(script), "a", name], env, name)
        assert code == 3, err
        reports.append(json.loads(out))
    first, second = reports
    assert first["argv"] == ["a", "first"] and second["argv"] == ["a", "second"]
    assert first["cache"] == str(tmp_path / "cache") and first["cwd"] == str(tmp_path)
    assert first["preloaded"] and second["preloaded"]  # forked from the zygote, not a fresh Python
    assert first["pid"] != second["pid"]
    assert all(a != b for a, b in zip(first["random"], second["random"]))  # Python's and numpy's


def test_an_exec_of_this_python_runs_in_place_only_while_single_threaded(forker, tmp_path):
    (tmp_path / "report_module.py").write_text(REPORT)
    execs = textwrap.dedent("""
        import os, sys, threading, time
        if sys.argv[1] == "threaded":
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print(os.getpid(), flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "report_module", "x"], dict(os.environ))
        """)
    (tmp_path / "execs.py").write_text(execs)
    for mode, in_place in (("single", True), ("threaded", False)):
        code, out, err = _spawned(forker, tmp_path, [str(tmp_path / "execs.py"), mode], cpu_env(), mode)
        assert code == 0, err
        pid_before, report = out.splitlines()
        report = json.loads(report)
        assert report["pid"] == int(pid_before) and report["argv"] == ["x"]
        assert report["preloaded"] is in_place, (mode, err)


def test_only_launch_time_differences_are_forked(forker):
    env = cpu_env()
    assert forker.takes({**env, "SGLANG_EMBEDS_CACHE": "/elsewhere"})
    assert not forker.takes({**env, "OMP_NUM_THREADS": "7"})
    assert not forker.takes({k: v for k, v in env.items() if k != "SGLANG_EMBEDS_CPU_KERNELS"})


def test_a_script_run_through_it_returns_what_subprocess_run_would(forker, tmp_path):
    script = tmp_path / "speaks.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(sys.argv[1])\n")
    done = zygote.run([str(script), "bad argument"], cpu_env(), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (1, "out\n", "err\nbad argument\n")
    assert done.args == [sys.executable, str(script), "bad argument"]


def test_a_shared_log_keeps_every_line_of_both_streams_in_order(forker, tmp_path):
    script = tmp_path / "both.py"
    script.write_text("import sys\nfor i in range(50):\n"
                      "    print(f'out {i}', flush=True)\n    print(f'err {i}', file=sys.stderr, flush=True)\n")
    log = tmp_path / "shared.log"
    assert forker.spawn([str(script)], cpu_env(), log).wait(60) == 0
    assert log.read_text().splitlines() == [f"{stream} {i}" for i in range(50) for stream in ("out", "err")]


def test_a_zygote_that_died_leaves_the_launch_to_a_fresh_interpreter(tmp_path, capsys):
    shadow = tmp_path / "shadow" / "sglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("import time\ntime.sleep(2)\nraise ImportError('no SGLang here')\n")
    env = {**cpu_env(), "PYTHONPATH": str(shadow.parent)}
    dying = zygote.Zygote(env)
    try:
        assert dying.takes(env)  # still importing
        assert zygote.spawn_or_none(dying, ["-c", "pass"], env, tmp_path / "log") is None
        assert "no SGLang here" in capsys.readouterr().err
        dying._proc.wait(timeout=30)
        assert not dying.alive() and not dying.takes(env)
    finally:
        dying.stop()


def test_the_preload_is_what_launch_server_imports_before_and_after_its_plugins():
    """The zygote stands in for `python -m sglang.launch_server` only while it imports what that
    module imports before `load_plugins()` (at its top) and its HTTP server after (in run_server)."""
    import ast
    import importlib.util

    source = ast.parse(open(importlib.util.find_spec("sglang.launch_server").origin).read())
    at_top = {node.module for node in source.body if isinstance(node, ast.ImportFrom) and node.module.startswith("sglang")}
    assert at_top == set(zygote.BEFORE_PLUGINS)
    [run_server] = [node for node in source.body if isinstance(node, ast.FunctionDef) and node.name == "run_server"]
    later = {node.module for node in ast.walk(run_server) if isinstance(node, ast.ImportFrom)}
    assert set(zygote.AFTER_PLUGINS) <= later
