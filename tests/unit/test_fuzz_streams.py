"""A seeded Hypothesis stream is the same whatever else the process has imported (tests/conftest.py
takes out Hypothesis's pool of literals from local modules): the fuzzers' fixed examples in CI are
the ones a developer runs alone."""

from __future__ import annotations

import importlib.util
import sys

from hypothesis import given, seed, settings
from hypothesis import strategies as st


def _drawn(seed_value: int) -> list:
    values = []

    @settings(max_examples=200, database=None, deadline=None)
    @seed(seed_value)
    @given(st.lists(st.integers(0, 2**20), max_size=4), st.floats(0, 20), st.text(max_size=3))
    def draw(numbers, number, text):
        values.append((numbers, number, text))

    draw()
    return values


def test_a_seeded_stream_ignores_the_literals_of_modules_imported_since(tmp_path):
    before = _drawn(3)
    source = tmp_path / "fresh_literals.py"  # a local module full of literals the strategies allow
    source.write_text("LITERALS = (" + ", ".join(str(31337 + 97 * i) for i in range(200))
                      + ", 13.25, 7.5, 'q!z', 'zz')\n")
    spec = importlib.util.spec_from_file_location("fresh_literals", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fresh_literals"] = module
    try:
        spec.loader.exec_module(module)
        after = _drawn(3)
    finally:
        del sys.modules["fresh_literals"]
    assert len(before) == 200 and len({repr(v) for v in before}) > 150, before[:5]  # a stream, not one value
    assert after == before
    assert _drawn(4) != before  # the seed does choose the stream
