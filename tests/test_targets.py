"""Every patched SGLang target resolves and still mentions what the hooks rely on (no server)."""

from __future__ import annotations

from sgl_embeds import lang
from sgl_embeds_srt import plugin, targets


def test_pinned_sglang_version_is_installed():
    assert targets.installed_version() == targets.SGLANG_VERSION


def test_every_patch_target_is_present_in_the_installed_sglang():
    missing = targets.missing_targets()
    assert not missing, "SGLang internals moved; update sgl_embeds_srt/targets.py:\n" + "\n".join(missing)


def test_a_moved_target_is_reported_by_path(monkeypatch):
    monkeypatch.setitem(targets.TARGETS, "sglang.srt.managers.schedule_batch.Req.no_such_method", ())
    assert any("Req.no_such_method" in p for p in targets.missing_targets())


def test_the_hook_tables_patch_exactly_the_listed_targets():
    hooked = set(plugin.hook_table(http=True)) | set(lang.hook_table())
    assert hooked == set(targets.PATCHED)
    assert all(callable(hook) for _, hook in [*plugin.hook_table(http=True).values(), *lang.hook_table().values()])


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert "sgl_embeds_srt.plugin:register" in names
