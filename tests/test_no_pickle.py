"""No code path of sgl_embeds can unpickle client data: no pickle-family import, no torch.load,
no numpy load with pickles, no eval/exec, anywhere in the package (checked on the syntax tree)."""

from __future__ import annotations

import ast
from pathlib import Path

import sgl_embeds

FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
FORBIDDEN_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"), (None, "eval"), (None, "exec")}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):  # a bare eval(...) / exec(...)
                key = (None, f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):  # torch.load(...)
                key = (f.value.id, f.attr)
            else:  # obj.method(...), e.g. module.eval(): not a forbidden call
                continue
            if key in FORBIDDEN_CALLS:
                found.append(f"call {key}")
            if any(k.arg == "allow_pickle" for k in node.keywords):
                found.append("allow_pickle=")
    return [f"{path}:{v}" for v in found]


def test_package_has_no_unpickling_code_path():
    root = Path(sgl_embeds.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5
    problems = [v for f in files for v in _violations(f)]
    assert not problems, problems


def test_the_checker_catches_each_forbidden_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch\ntorch.load('x')\neval('1')\nimport numpy as np\nnp.load('f', allow_pickle=True)\nmodel.eval()\n")
    found = _violations(bad)
    assert len(found) == 5, found  # model.eval() is a method, not eval
