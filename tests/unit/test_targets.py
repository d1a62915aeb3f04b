"""Every guarded SGLang internal is as recorded, the hook tables patch exactly those, and a
changed frontend target fails the client's import in a child process (the launches with a changed
server target: ``server/test_targets_launch.py``)."""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from unittest import mock

import helpers
from sgl_embeds import hooks
from sgl_embeds_cpu import plugin as cpu_plugin
from sgl_embeds_protocol import targets
from sgl_embeds_srt import plugin

def test_pinned_sglang_version_is_installed():
    assert targets.installed_version() == targets.SGLANG_VERSION


def test_every_guarded_internal_is_as_recorded():
    found = targets.problems()
    assert not found, "SGLang internals changed; see sgl_embeds_protocol/targets.py:\n" + "\n".join(found)


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
    server, client, cpu = plugin.hook_table(http=True), hooks.hook_table(), cpu_plugin.hook_table()
    assert len(server) + len(client) + len(cpu) == len(targets.PATCHED)  # no target hooked twice
    assert set(server) | set(client) | set(cpu) == set(targets.PATCHED)
    assert all(callable(hook) for _, hook in [*server.values(), *client.values(), *cpu.values()])
    sides = {t: g.side for t, g in targets.PATCHED.items()}
    assert {sides[t] for t in client} == {"client"}
    assert {sides[t] for t in server} == {"server"} == {sides[t] for t in cpu}


def test_the_plugins_register_no_hook_in_a_detokenizer(monkeypatch):
    """SGLang's detokenizer (told by its process title) runs none of our hooks, so neither plugin
    registers one there; a scheduler gets them all."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setenv(plugin.LOADED_BY_VAR, "")  # register() records this process in it
    monkeypatch.setenv(cpu_plugin.OPT_IN, "1")
    registered = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, hook, kind: registered.append(target))
    for title, expected in ((targets.DETOKENIZER_TITLE, set()), ("sglang::scheduler", set(targets.PATCHED) - set(hooks.hook_table()))):
        registered.clear()
        monkeypatch.setattr("setproctitle.getproctitle", lambda: title)
        plugin.register()
        cpu_plugin.register()
        assert set(registered) == expected, title


def test_plugin_entry_points_are_declared():
    names = {ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert {"sgl_embeds_srt.plugin:register", "sgl_embeds_cpu.plugin:register"} <= names
    platforms = {ep.value for ep in entry_points(group="sglang.srt.platforms")}
    assert "sgl_embeds_cpu.plugin:activate" in platforms



def test_a_changed_frontend_target_fails_the_client_import(tmp_path):
    change = ("from sglang.lang import interpreter\n"
              "_stock = interpreter.StreamExecutor.fork\n"
              "def fork(self, *args, **kwargs):\n"
              "    return _stock(self, *args, **kwargs)\n"
              "interpreter.StreamExecutor.fork = fork\n")
    then = ("from sgl_embeds_protocol.targets import ChangedSGLang\n"
            "try:\n    import sgl_embeds\nexcept ChangedSGLang as e:\n    print('REFUSED', e)\n    sys.exit(3)\n")
    out = helpers.run_with_changed_sglang(tmp_path, change, then)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "StreamExecutor.fork: its source changed" in out.stdout
