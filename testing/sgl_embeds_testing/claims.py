"""What a tutorial shows, checked where it shows it.

``shows(claim, holds)`` prints ``✓ claim`` or raises ``AssertionError``; ``with showing(claim):``
does the same for a block of checks (it prints the mark when the block raised nothing). The
notebooks in ``examples/`` are committed with their outputs, and ``tests/examples/test_notebooks.py``
requires a fresh run to print the same ✓ lines as the committed one: so a claim's text holds only
what is stable across machines (counts, shapes, verdicts), never generated text or timings.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

MARK = "✓ "


def shows(claim: str, holds: bool, detail: object = "") -> None:
    if not holds:
        raise AssertionError(f"does not hold: {claim} {detail}".rstrip())
    print(MARK + claim)


@contextlib.contextmanager
def showing(claim: str) -> Iterator[None]:
    try:
        yield
    except AssertionError as error:
        raise AssertionError(f"does not hold: {claim}: {error}") from error
    print(MARK + claim)


def claims_in(texts: Iterable[str]) -> list[str]:
    """The claims shown in printed ``texts`` (a notebook's stream outputs), in order."""
    return [line[len(MARK):] for text in texts for line in text.splitlines() if line.startswith(MARK)]
