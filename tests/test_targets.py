"""Every guarded SGLang internal is as recorded, and a changed one refuses a real launch.

The launch tests run ``python -m sglang.launch_server`` and ``sglang.Engine(...)`` in a child
process after replacing one internal there (a function of the same signature and another body),
so the refusal is seen where a user would see it: exit status and message, not a mocked check.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from importlib.metadata import entry_points
from unittest import mock

import pytest

from sgl_embeds import hooks
from sgl_embeds.testing.server import cpu_env, cpu_launch_args, free_port
from sgl_embeds_srt import plugin, targets

CHILD_TIMEOUT_S = 180


def test_pinned_sglang_version_is_installed():
    assert targets.installed_version() == targets.SGLANG_VERSION


def test_every_guarded_internal_is_as_recorded():
    found = targets.problems()
    assert not found, "SGLang internals changed; see sgl_embeds_srt/targets.py:\n" + "\n".join(found)


def test_every_patched_or_called_function_has_a_fingerprint():
    """Only values (an app, a constant) and places we read by name (a module, a model class) go
    without one."""
    for target, guard in targets.TARGETS.items():
        if guard.fingerprint is None:
            assert not inspect.isfunction(targets._resolve(target)), target
        else:
            assert len(guard.fingerprint) == 16, target
    assert all(guard.fingerprint for guard in targets.PATCHED.values())


def test_a_moved_target_is_reported_by_path(monkeypatch):
    monkeypatch.setitem(targets.TARGETS, f"{targets._SB}.Req.no_such_method", targets.server())
    assert any("Req.no_such_method: cannot be resolved" in p for p in targets.problems("server"))


STOCK_SOURCE = '''
    def f(self, a, b):
        """Docstring."""
        return a + b  # a comment
'''


def _fingerprint_of(source: str) -> str:
    with mock.patch.object(inspect, "getsource", lambda obj: source):  # fingerprint reads only this
        return targets.fingerprint(object())


def test_the_fingerprint_sees_code_not_words():
    stock = _fingerprint_of(STOCK_SOURCE)
    reworded = STOCK_SOURCE.replace("Docstring.", "Other words.").replace("# a comment", "")
    assert _fingerprint_of(reworded) == stock
    assert _fingerprint_of("\n\n" + STOCK_SOURCE) == stock  # moved lines
    assert _fingerprint_of(STOCK_SOURCE.replace("a + b", "a + b + 0")) != stock
    assert _fingerprint_of(STOCK_SOURCE.replace("a + b", "a - b")) != stock


def test_a_changed_target_is_named_with_what_differed(monkeypatch):
    monkeypatch.setitem(targets.TARGETS, targets.PREPARE_FOR_EXTEND,
                        targets.server("prefill_input_ids_cpu", "no such words", fp="0123456789abcdef"))
    found = [p for p in targets.problems("server") if "prepare_for_extend" in p]
    assert any("no longer mentions ['no such words']" in p for p in found)
    assert any("source changed" in p and "recorded 0123456789abcdef" in p for p in found)


def test_the_hook_tables_patch_exactly_the_listed_targets():
    hooked = set(plugin.hook_table(http=True)) | set(hooks.hook_table())
    assert hooked == set(targets.PATCHED)
    assert all(callable(hook) for _, hook in [*plugin.hook_table(http=True).values(), *hooks.hook_table().values()])
    sides = {t: g.side for t, g in targets.PATCHED.items()}
    assert {sides[t] for t in hooks.hook_table()} == {"client"}
    assert {sides[t] for t in plugin.hook_table(http=True)} == {"server"}


def test_plugin_entry_point_is_declared():
    names = {ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert "sgl_embeds_srt.plugin:register" in names


# A child's first lines: replace one internal by a function of the same signature and another
# body (defined in a file, as SGLang's are, so its source can be read), as a changed SGLang would.
CHANGE_PREPARE_FOR_EXTEND = """
from sglang.srt.managers import schedule_batch
_stock = schedule_batch.ScheduleBatch.prepare_for_extend
def prepare_for_extend(self, *args, **kwargs):
    return _stock(self, *args, **kwargs)
schedule_batch.ScheduleBatch.prepare_for_extend = prepare_for_extend
"""


def _run_child(tmp_path, change: str, then: str) -> subprocess.CompletedProcess:
    (tmp_path / "changed_sglang.py").write_text(change)
    script = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport changed_sglang\n{then}"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cpu_env(),
                          timeout=CHILD_TIMEOUT_S, start_new_session=True)


@pytest.mark.server
def test_a_changed_target_refuses_launch_server(tmp_path, llama_dir):
    argv = ["sglang.launch_server", "--model-path", str(llama_dir), "--host", "127.0.0.1",
            "--port", str(free_port()), *cpu_launch_args()]
    out = _run_child(tmp_path, CHANGE_PREPARE_FOR_EXTEND,
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
    out = _run_child(tmp_path, change, engine)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "REFUSED sgl_embeds refuses to start" in out.stdout
    assert "Req.set_finish_with_abort: cannot be resolved" in out.stdout


def test_a_changed_frontend_target_fails_the_client_import(tmp_path):
    change = ("from sglang.lang import interpreter\n"
              "_stock = interpreter.StreamExecutor.fork\n"
              "def fork(self, *args, **kwargs):\n"
              "    return _stock(self, *args, **kwargs)\n"
              "interpreter.StreamExecutor.fork = fork\n")
    then = ("from sgl_embeds_srt.targets import ChangedSGLang\n"
            "try:\n    import sgl_embeds\nexcept ChangedSGLang as e:\n    print('REFUSED', e)\n    sys.exit(3)\n")
    out = _run_child(tmp_path, change, then)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "StreamExecutor.fork: its source changed" in out.stdout
