"""The verdict on one run of a sabotage patch's tests, read from pytest's JUnit report (never from
its exit code): ``python scripts/sabotage_verdict.py REPORT broken|control``.

* ``broken`` (the patch applied): caught (exit 0) only when the named tests ran and at least one
  failed on an assertion (``AssertionError``, or pytest's ``Failed``: ``pytest.raises`` that did not
  raise, ``pytest.fail``); a run where nothing ran, everything was skipped, or the tests only errored
  (a fixture, a server that did not start, a collection error) is inconclusive (exit 3), not caught.
* ``control`` (the same tests without the patch): every test ran and passed (exit 0), else 1.
  ``--only NODEIDS``: the report is the whole suite's run of this commit, read for the tests named
  in the file NODEIDS (pytest ``--collect-only -q``): each must be there and have passed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

CAUGHT, NOT_CAUGHT, INCONCLUSIVE = 0, 1, 3
ASSERTION_KINDS = ("AssertionError", "Failed")  # pytest's own Failed: DID NOT RAISE, pytest.fail


@dataclass(frozen=True)
class Outcome:
    ran: int  # test cases that ran (not skipped)
    passed: int
    asserted: int  # failed on an assertion
    other_failures: int  # failed on another exception
    errors: int  # setup, teardown or collection errors

    @classmethod
    def of_report(cls, xml_text: str, only: set[tuple[str, str]] | None = None) -> Outcome:
        """The counts of the report's test cases (of those in ``only`` by node id, if given; one
        of ``only`` absent from the report counts as an error)."""
        cases = list(ET.fromstring(xml_text).iter("testcase"))
        if only is not None:
            by_id = {_node_id(case): case for case in cases}
            cases = [by_id[node] for node in sorted(only) if node in by_id]
        missing = 0 if only is None else len(only) - len(cases)
        ran, passed, asserted, other, errors = missing, 0, 0, 0, missing
        for case in cases:
            if case.find("skipped") is not None:
                continue
            ran += 1
            failure, error = case.find("failure"), case.find("error")
            if error is not None:
                errors += 1
            elif failure is not None:
                kind = (failure.get("message") or "").split(":", 1)[0].strip()
                on_assertion = kind in ASSERTION_KINDS or kind.startswith("assert ")
                asserted += on_assertion
                other += not on_assertion
            else:
                passed += 1
        return cls(ran, passed, asserted, other, errors)


def _node_id(case: ET.Element) -> tuple[str, str]:
    """A JUnit test case's (dotted module and classes, name), as ``node_key`` makes them."""
    return case.get("classname", ""), case.get("name", "")


def node_key(node_id: str) -> tuple[str, str]:
    """pytest's ``tests/a/test_b.py::TestC::test_d[x]`` as its JUnit case names it:
    (``tests.a.test_b.TestC``, ``test_d[x]``)."""
    path, *scopes = node_id.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *scopes[:-1]]), scopes[-1]


def verdict(outcome: Outcome, run: str) -> tuple[int, str]:
    counts = (f"{outcome.ran} ran, {outcome.passed} passed, {outcome.asserted} failed on an assertion, "
              f"{outcome.other_failures} on another exception, {outcome.errors} errored")
    if run == "control":
        ok = outcome.ran > 0 and outcome.passed == outcome.ran
        return (0 if ok else 1), f"control (no patch): {counts}"
    if outcome.asserted:
        return CAUGHT, f"caught: {counts}"
    if outcome.ran and outcome.passed == outcome.ran:
        return NOT_CAUGHT, f"NOT caught, the tests passed: {counts}"
    return INCONCLUSIVE, f"inconclusive (no test failed on an assertion): {counts}"


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or argv[1] not in ("broken", "control") or argv[2:3] not in ([], ["--only"]):
        raise SystemExit("usage: sabotage_verdict.py REPORT broken|control [--only NODEIDS]")
    path, run = argv[:2]
    try:
        only = None
        if len(argv) == 4:
            with open(argv[3]) as f:
                only = {node_key(line.strip()) for line in f if "::" in line}
        with open(path) as f:
            outcome = Outcome.of_report(f.read(), only)
    except (OSError, ET.ParseError) as e:
        print(f"[sabotage] no readable report ({e}): inconclusive")
        return INCONCLUSIVE
    code, text = verdict(outcome, run)
    print(f"[sabotage] {text}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
