"""The sabotage rotation's verdict (scripts/sabotage_verdict.py) on real pytest JUnit reports: a
break counts as caught only when a named test failed on an assertion, never on an exit code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sabotage_verdict", ROOT / "scripts" / "sabotage_verdict.py")
sabotage_verdict = sys.modules["sabotage_verdict"] = importlib.util.module_from_spec(_spec)  # for its dataclass
_spec.loader.exec_module(sabotage_verdict)

TESTS = '''
import pytest

@pytest.fixture
def server():
    raise RuntimeError("the server did not start")

def test_equal():
    assert 1 + 1 == 2

def test_unequal():
    assert 1 + 1 == 3

def test_raises_nothing():
    with pytest.raises(ValueError):
        pass

def test_crashes():
    {}["missing"]

def test_needs_a_server(server):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    assert False
'''


BREAK_CASES = [
    ("unequal", "broken", sabotage_verdict.CAUGHT),
    ("raises_nothing", "broken", sabotage_verdict.CAUGHT),  # pytest's Failed: DID NOT RAISE
    ("unequal or crashes or server", "broken", sabotage_verdict.CAUGHT),
    ("equal and not unequal", "broken", sabotage_verdict.NOT_CAUGHT),
    ("crashes", "broken", sabotage_verdict.INCONCLUSIVE),  # a KeyError, not an assertion
    ("server", "broken", sabotage_verdict.INCONCLUSIVE),  # a fixture's error: nothing was tested
    ("skipped", "broken", sabotage_verdict.INCONCLUSIVE),  # all skipped
    ("no_such_test", "broken", sabotage_verdict.INCONCLUSIVE),  # pytest exits 5: nothing ran
    ("equal and not unequal", "control", 0),
    ("equal or server", "control", 1),
    ("no_such_test", "control", 1),
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, str]:
    """The JUnit report of a pytest run of the sample tests for each selection (``-k``; "": every
    test, as the suite runs them all), the runs started at once (each is ~2 s of pytest's start)."""
    folder = tmp_path_factory.mktemp("samples")
    (folder / "test_sample.py").write_text(TESTS)
    selections = sorted({select for select, _, _ in BREAK_CASES} | {""})
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py",
                              "-k", select, f"--junitxml={folder / f'{i}.xml'}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder)
            for i, select in enumerate(selections)]
    for run in runs:
        run.wait(timeout=120)
    return {select: (folder / f"{i}.xml").read_text() for i, select in enumerate(selections)}


@pytest.mark.parametrize("select, run, code", BREAK_CASES)
def test_a_break_is_caught_only_by_a_failed_assertion(reports, select, run, code):
    outcome = sabotage_verdict.Outcome.of_report(reports[select])
    assert sabotage_verdict.verdict(outcome, run)[0] == code, outcome


@pytest.mark.parametrize("select, code", [
    ("equal and not unequal", 0),
    ("equal or raises_nothing", 1),  # one of them failed in the suite's run
    ("(equal and not unequal) or skipped", 0),  # skipped there and here alike
])
def test_the_suites_report_serves_as_the_control_for_the_tests_collected(tmp_path, reports, select, code):
    """``make test``'s control: the named tests, collected by pytest, each passed in the whole
    run's report; one the report lacks fails the control."""
    suite = tmp_path / "suite.xml"
    suite.write_text(reports[""])
    (tmp_path / "test_sample.py").write_text(TESTS)
    collected = tmp_path / "collected.txt"
    collected.write_text(subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "test_sample.py", "-k", select],
        capture_output=True, text=True, timeout=120, cwd=tmp_path).stdout)
    assert "test_sample.py::test_equal" in collected.read_text()
    assert sabotage_verdict.main([str(suite), "control", "--only", str(collected)]) == code
    with collected.open("a") as f:
        f.write("test_sample.py::test_not_in_the_suite\n")
    assert sabotage_verdict.main([str(suite), "control", "--only", str(collected)]) == 1


def test_node_ids_name_their_junit_cases():
    assert sabotage_verdict.node_key("tests/vlm/test_a.py::test_b[x-y]") == ("tests.vlm.test_a", "test_b[x-y]")
    assert sabotage_verdict.node_key("tests/test_a.py::TestC::test_d") == ("tests.test_a.TestC", "test_d")


def test_the_rotation_draws_every_patch_in_a_window_of_that_many_commits():
    """scripts/sabotage_rotation.sh: patch = first-parent commit count modulo the patch count."""
    rotation = (ROOT / "scripts" / "sabotage_rotation.sh").read_text()
    assert "git rev-list --count --first-parent HEAD) % ${#patches[@]}" in rotation
    n = len(list((ROOT / "tests" / "sabotage").glob("*.patch")))
    for start in range(240, 240 + n):
        assert {count % n for count in range(start, start + n)} == set(range(n))
