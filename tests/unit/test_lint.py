"""The linter: ``ruff check`` over the checkout passes, with the rules of pyproject.toml's
``[tool.ruff]`` (``make lint`` runs the same). Ruff is a test tool of requirements/dev.txt.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    assert importlib.util.find_spec("ruff"), f"ruff is not installed in {sys.prefix}: `make setup` installs requirements/dev.txt"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"`ruff check` (exit {out.returncode}; `make lint`):\n{out.stdout}{out.stderr}"
