"""The settings read from the environment: each ``SGLANG_EMBEDS_<NAME>`` (the prefix SGLang asks
for: it rewrites any ``SGL_`` name and warns), the older ``SGL_EMBEDS_<NAME>`` still honoured."""

from __future__ import annotations

import pytest

from sgl_embeds_cpu import plugin
from sgl_embeds_protocol.environment import OLD_PREFIX, setting


def test_a_setting_is_read_by_its_name_then_by_its_old_spelling_then_its_default():
    assert setting("SGLANG_EMBEDS_MAX_BYTES", "7", {}) == "7"
    assert setting("SGLANG_EMBEDS_MAX_BYTES", "7", {OLD_PREFIX + "MAX_BYTES": "5"}) == "5"
    assert setting("SGLANG_EMBEDS_MAX_BYTES", "7", {OLD_PREFIX + "MAX_BYTES": "5", "SGLANG_EMBEDS_MAX_BYTES": "9"}) == "9"
    with pytest.raises(ValueError, match="not one of sgl_embeds' settings"):
        setting(OLD_PREFIX + "MAX_BYTES")


def test_the_cpu_kernels_opt_in_is_read_by_either_spelling():
    assert plugin.opted_in({"SGLANG_EMBEDS_CPU_KERNELS": "1"}) and plugin.opted_in({OLD_PREFIX + "CPU_KERNELS": "1"})
    assert not plugin.opted_in({}) and not plugin.opted_in({"SGLANG_EMBEDS_CPU_KERNELS": "0", OLD_PREFIX + "CPU_KERNELS": "1"})


def test_the_server_side_budgets_honour_the_old_spelling(monkeypatch):
    from sgl_embeds_srt import handles, parse

    monkeypatch.delenv("SGLANG_EMBEDS_MAX_BYTES", raising=False)
    monkeypatch.delenv("SGLANG_EMBEDS_HANDLE_BYTES", raising=False)
    monkeypatch.setenv(OLD_PREFIX + "MAX_BYTES", "1234")
    monkeypatch.setenv(OLD_PREFIX + "HANDLE_BYTES", "4321")
    assert parse.max_span_bytes(0) == 1234
    assert handles.budget_bytes() == 4321
