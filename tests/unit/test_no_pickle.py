"""No code path of sgl_embeds (or programs/) can unpickle client data, checked on the syntax tree:
no pickle-family import, no ``torch.load`` / ``torch.jit.load`` / ``numpy.load`` under any
alias or ``from ... import``, no ``allow_pickle=``, no bare ``eval`` / ``exec``."""

from __future__ import annotations

import ast
from pathlib import Path

import sgl_embeds

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
FORBIDDEN_CALLS = {"torch.load", "torch.jit.load", "torch.serialization.load", "numpy.load", "eval", "exec"}
ROOTS = [Path(sgl_embeds.__file__).parent, Path(__file__).resolve().parents[2] / "programs"]


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a call's function, or None for anything else (``obj().m``, subscripts)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> what it stands for (import ... as ..., from ... import ...)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"from {node.module} import")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is not None:
            root, _, rest = name.partition(".")
            if root in aliases:
                name = aliases[root] + ("." + rest if rest else "")
            elif "." in name and root not in ("torch", "numpy"):  # obj.method(), e.g. model.eval()
                name = None
            if name is not None and name.replace("np.", "numpy.", 1) in FORBIDDEN_CALLS:
                found.append(f"call {name}")
        if any(k.arg == "allow_pickle" for k in node.keywords):
            found.append("allow_pickle=")
    return [f"{path}:{v}" for v in found]


def test_package_and_programs_have_no_unpickling_code_path():
    files = sorted(f for root in ROOTS for f in root.rglob("*.py"))
    assert len(files) > 20 and any("programs" in f.parts for f in files)
    problems = [v for f in files for v in _violations(f)]
    assert not problems, problems


def test_the_checker_catches_each_forbidden_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\n"
        "import torch\ntorch.load('x')\n"
        "import torch as T\nT.jit.load('x')\n"
        "from torch import load\nload('x')\n"
        "from torch.serialization import load as L\nL('x')\n"
        "import numpy as np\nnp.load('f', allow_pickle=True)\n"
        "from numpy import load as npload\nnpload('f')\n"
        "import joblib\nfrom dill import loads\n"
        "eval('1')\n"
        "model.eval()\nresult.load()\n"
    )
    found = [v.split(":", 1)[1] for v in _violations(bad)]
    expected = ["import pickle", "import joblib", "from dill import", "call torch.load", "call torch.jit.load",
                "call torch.load", "call torch.serialization.load", "call numpy.load", "allow_pickle=",
                "call numpy.load", "call eval"]
    assert sorted(found) == sorted(expected), found  # model.eval() and result.load() are methods
