"""A changed SGLang internal refuses a real launch: ``python -m sglang.launch_server`` and
``sglang.Engine(...)`` run in a child process after one internal there is replaced (a function of
the same signature and another body), so the refusal is seen where a user would see it: exit
status and message, not a mocked check."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

import helpers
from sgl_embeds_testing.server import cpu_launch_args, free_port

# A child's first lines: replace one internal by a function of the same signature and another
# body (defined in a file, as SGLang's are, so its source can be read), as a changed SGLang would.
CHANGE_PREPARE_FOR_EXTEND = """
from sglang.srt.managers import schedule_batch
_stock = schedule_batch.ScheduleBatch.prepare_for_extend
def prepare_for_extend(self, *args, **kwargs):
    return _stock(self, *args, **kwargs)
schedule_batch.ScheduleBatch.prepare_for_extend = prepare_for_extend
"""


MISSING_SET_FINISH_WITH_ABORT = "from sglang.srt.managers import schedule_batch\ndel schedule_batch.Req.set_finish_with_abort\n"


@pytest.fixture(scope="module")
def refused(tmp_path_factory, llama_dir) -> dict:
    """Both refusals' child processes, run at once (each mostly imports SGLang, on one core)."""
    argv = ["sglang.launch_server", "--model-path", str(llama_dir), "--host", "127.0.0.1",
            "--port", str(free_port()), *cpu_launch_args()]
    launch_server = f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('sglang.launch_server', run_name='__main__')"
    engine = (f"import sglang\n"
              f"try:\n"
              f"    sglang.Engine(model_path={str(llama_dir)!r}, device='cpu', attention_backend='torch_native',\n"
              f"                  disable_cuda_graph=True, disable_overlap_schedule=True)\n"
              f"except SystemExit as e:\n"
              f"    print('REFUSED', e)\n"
              f"    sys.exit(3)\n")
    children = {"launch_server": (CHANGE_PREPARE_FOR_EXTEND, launch_server),
                "engine": (MISSING_SET_FINISH_WITH_ABORT, engine)}
    with concurrent.futures.ThreadPoolExecutor(len(children)) as pool:
        done = {name: pool.submit(helpers.run_with_changed_sglang, tmp_path_factory.mktemp(name), *child)
                for name, child in children.items()}
        return {name: future.result() for name, future in done.items()}


@pytest.mark.server
def test_a_changed_target_refuses_launch_server(refused):
    out = refused["launch_server"]
    assert out.returncode == 1, out.stderr[-3000:]
    assert "sgl_embeds refuses to start" in out.stderr
    assert "ScheduleBatch.prepare_for_extend: its source changed" in out.stderr
    assert "no longer mentions ['prefill_input_ids_cpu'" in out.stderr
    assert "fired up and ready" not in out.stderr + out.stdout


@pytest.mark.server
def test_a_missing_target_makes_engine_raise(refused):
    out = refused["engine"]
    assert out.returncode == 3, out.stderr[-3000:]
    assert "REFUSED sgl_embeds refuses to start" in out.stdout
    assert "Req.set_finish_with_abort: cannot be resolved" in out.stdout


def _launch_in_this_child(model_dir: str, port: int, change_dir: str | None) -> None:
    """A multiprocessing child's target: ``launch_server`` here, as an orchestrator or a notebook
    helper starts it, after importing ``changed_sglang`` from ``change_dir`` (when given)."""
    import runpy
    import sys

    if change_dir is not None:
        sys.path.insert(0, change_dir)
        import changed_sglang  # noqa: F401  (replaces an internal, as a changed SGLang would)
    sys.argv = ["sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1", "--port", str(port),
                *cpu_launch_args()]
    runpy.run_module("sglang.launch_server", run_name="__main__")


def _stop_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for p in [*parent.children(recursive=True), parent]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _launched_in_a_child(llama_dir, change_dir: str | None) -> dict:
    """A server started in a spawned multiprocessing child (after ``change_dir``'s change, if
    given): whether the plugin's route answered, a span prompt's answer, the child's exit code."""
    import multiprocessing
    import time

    import requests

    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_launch_in_this_child,
                                                         args=(str(llama_dir), port, change_dir))
    child.start()
    try:
        deadline, info = time.monotonic() + 180, None
        while time.monotonic() < deadline and child.is_alive() and info is None:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/sgl_embeds/info", timeout=2)
                info = r if r.status_code == 200 else None
            except requests.RequestException:
                time.sleep(0.5)
        if info is None:
            child.join(timeout=60)
            return {"info": None, "exitcode": child.exitcode}
        out = requests.post(f"http://127.0.0.1:{port}/generate", timeout=120, json=helpers.body(
            [helpers.text("the"), helpers.span(helpers.seeded_rows(3, 4)), helpers.text(" is")], 4)).json()
        return {"info": info.json(), "out": out}
    finally:
        _stop_tree(child.pid)
        child.join(timeout=30)


@pytest.fixture(scope="module")
def launched_in_children(llama_dir, tmp_path_factory) -> dict:
    """Both launches from a multiprocessing child, at once: as installed and with a changed internal."""
    from sgl_embeds_testing.server import cpu_env
    from sgl_embeds_srt.plugin import LOADED_BY_VAR

    assert LOADED_BY_VAR not in os.environ  # this test process never loaded the plugin
    change_dir = tmp_path_factory.mktemp("changed")
    (change_dir / "changed_sglang.py").write_text(CHANGE_PREPARE_FOR_EXTEND)
    with pytest.MonkeyPatch.context() as env:
        for name, value in cpu_env().items():
            env.setenv(name, value)  # what a spawned child inherits
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = {changed: pool.submit(_launched_in_a_child, llama_dir, str(change_dir) if changed else None)
                    for changed in (False, True)}
            return {changed: run.result() for changed, run in runs.items()}


@pytest.mark.parametrize("changed", [False, True], ids=["as installed", "with a changed internal"])
def test_a_server_launched_in_a_multiprocessing_child_is_checked_and_serves_spans(launched_in_children, changed):
    """The plugin tells a server's main process from the processes SGLang starts by who loaded it,
    not by having a multiprocessing parent: a server started in such a child runs the launch
    guard (refuses a changed SGLang) and serves spans and the plugin's routes."""
    launched = launched_in_children[changed]
    if changed:
        assert launched["info"] is None and launched["exitcode"] == 1, "a changed SGLang must stop the launch"
        return
    assert launched["info"] is not None and launched["info"]["hidden_size"] == 64, "the plugin's routes must answer"
    out = launched["out"]
    assert len(out["output_ids"]) == 4 and out["meta_info"]["prompt_tokens"] > 4
