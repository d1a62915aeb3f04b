"""A changed SGLang internal refuses a real launch: ``python -m sglang.launch_server`` and
``sglang.Engine(...)`` run in a child process after one internal there is replaced (a function of
the same signature and another body), so the refusal is seen where a user would see it: exit
status and message, not a mocked check."""

from __future__ import annotations

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


@pytest.mark.server
def test_a_changed_target_refuses_launch_server(tmp_path, llama_dir):
    argv = ["sglang.launch_server", "--model-path", str(llama_dir), "--host", "127.0.0.1",
            "--port", str(free_port()), *cpu_launch_args()]
    out = helpers.run_with_changed_sglang(tmp_path, CHANGE_PREPARE_FOR_EXTEND,
                     f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('sglang.launch_server', run_name='__main__')")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "sgl_embeds refuses to start" in out.stderr
    assert "ScheduleBatch.prepare_for_extend: its source changed" in out.stderr
    assert "no longer mentions ['prefill_input_ids_cpu'" in out.stderr
    assert "fired up and ready" not in out.stderr + out.stdout


@pytest.mark.server
def test_a_missing_target_makes_engine_raise(tmp_path, llama_dir):
    change = "from sglang.srt.managers import schedule_batch\ndel schedule_batch.Req.set_finish_with_abort\n"
    engine = (f"import sglang\n"
              f"try:\n"
              f"    sglang.Engine(model_path={str(llama_dir)!r}, device='cpu', attention_backend='torch_native',\n"
              f"                  disable_cuda_graph=True, disable_overlap_schedule=True)\n"
              f"except SystemExit as e:\n"
              f"    print('REFUSED', e)\n"
              f"    sys.exit(3)\n")
    out = helpers.run_with_changed_sglang(tmp_path, change, engine)
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


@pytest.mark.parametrize("changed", [False, True], ids=["as installed", "with a changed internal"])
def test_a_server_launched_in_a_multiprocessing_child_is_checked_and_serves_spans(llama_dir, monkeypatch, tmp_path,
                                                                                   changed):
    """The plugin tells a server's main process from the processes SGLang starts by who loaded it,
    not by having a multiprocessing parent: a server started in such a child runs the launch
    guard (refuses a changed SGLang) and serves spans and the plugin's routes."""
    import multiprocessing
    import time

    import requests

    from sgl_embeds_testing.server import cpu_env
    from sgl_embeds_srt.plugin import LOADED_BY_VAR

    assert LOADED_BY_VAR not in os.environ  # this test process never loaded the plugin
    for name, value in cpu_env().items():
        monkeypatch.setenv(name, value)
    port = free_port()
    (tmp_path / "changed_sglang.py").write_text(CHANGE_PREPARE_FOR_EXTEND)
    child = multiprocessing.get_context("spawn").Process(
        target=_launch_in_this_child, args=(str(llama_dir), port, str(tmp_path) if changed else None))
    child.start()
    try:
        deadline, info = time.monotonic() + 180, None
        while time.monotonic() < deadline and child.is_alive() and info is None:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/sgl_embeds/info", timeout=2)
                info = r if r.status_code == 200 else None
            except requests.RequestException:
                time.sleep(0.5)
        if changed:
            child.join(timeout=60)
            assert info is None and child.exitcode == 1, "a changed SGLang must stop the launch"
            return
        assert info is not None and info.json()["hidden_size"] == 64, "the plugin's routes must answer"
        out = requests.post(f"http://127.0.0.1:{port}/generate", timeout=120, json=helpers.body(
            [helpers.text("the"), helpers.span(helpers.seeded_rows(3, 4)), helpers.text(" is")], 4)).json()
        assert len(out["output_ids"]) == 4 and out["meta_info"]["prompt_tokens"] > 4
    finally:
        _stop_tree(child.pid)
        child.join(timeout=30)
