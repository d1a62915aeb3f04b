"""The module map: no import circle, and each side of the wire owns its code.

Two top-level packages: ``sgl_embeds`` (the client) and ``sgl_embeds_srt`` (the server plugin and
the modules both sides share). Every import counts, including those inside functions (a lazy
import is still a dependency), and the package ``__init__`` counts as a module: importing any
``sgl_embeds.*`` module runs it. The server never imports the client package; the client imports
from ``sgl_embeds_srt`` only the shared modules, which import neither side.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENT, SERVER = "sgl_embeds", "sgl_embeds_srt"
SHARED = {f"{SERVER}.{m}" for m in ("segments", "wire", "binary_body", "lru", "keys", "targets")}
SHARED |= {SERVER}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _side(module: str) -> str:
    if module in SHARED:
        return "shared"
    return "server" if module.split(".")[0] == SERVER else "client"


def _files() -> list[Path]:
    return [p for package in (CLIENT, SERVER) for p in (ROOT / package).rglob("*.py")]


def import_graph(packages: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports; with ``packages``, also each package ``__init__`` such an
    import runs first (an edge for the side checks, not a circle: Python runs it once)."""
    modules = {_module_name(p): p for p in _files()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` depends on pkg.mod; ``from mod import name`` on mod
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
                    parts = t.split(".")
                    if packages:  # importing a.b.c runs a/__init__ and a/b/__init__ first
                        graph[name].update(p for i in range(1, len(parts))
                                           if (p := ".".join(parts[:i])) in modules and p != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_there_is_no_import_circle():
    graph = import_graph()
    assert "sgl_embeds_srt.openai" in graph["sgl_embeds_srt.http.middleware"]  # the graph sees real edges

    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_circle_would_be_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_each_side_of_the_wire_owns_its_code():
    """No exemptions: the server and the shared modules never import the client package (its
    ``__init__`` included), and the client and the shared modules never import server modules."""
    graph = import_graph(packages=True)
    assert "sgl_embeds" in graph["sgl_embeds.vlm.tower"]  # the package __init__ a module runs
    assert {_side(m) for m in graph} == {"client", "server", "shared"}
    for module, deps in graph.items():
        side = _side(module)
        if side in ("server", "shared"):
            client = sorted(d for d in deps if _side(d) == "client")
            assert not client, f"{module} imports client modules {client}"
        if side in ("client", "shared"):
            server = sorted(d for d in deps if _side(d) == "server")
            assert not server, f"{module} imports server modules {server}"


def test_a_client_import_by_the_server_would_be_found():
    graph = {"sgl_embeds_srt.plugin": {"sgl_embeds"}, "sgl_embeds": set()}
    assert any(_side(d) == "client" for d in graph["sgl_embeds_srt.plugin"])
    assert _side("sgl_embeds_srt.wire") == "shared" and _side("sgl_embeds_srt.http") == "server"


def test_loading_the_plugin_loads_no_client_module():
    """In a fresh interpreter, as SGLang does it: the entry point loaded, ``register()`` run."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from importlib.metadata import entry_points\n"
            "[ep] = [e for e in entry_points(group='sglang.srt.plugins') if e.name == 'sgl_embeds']\n"
            "ep.load()()\n"
            "print(sorted(m for m in sys.modules if m == 'sgl_embeds' or m.startswith('sgl_embeds.')))\n"
            "print('sglang.embeds' if hasattr(sys.modules['sglang'], 'embeds') else '')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", ""], out.stdout


def test_every_module_and_function_named_in_the_architecture_doc_exists():
    import importlib
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = {_module_name(p).rsplit(".", 1)[-1]: _module_name(p) for p in _files()
               if not p.name.startswith("__")}
    named = set(re.findall(r"`(?:\w+/)*(\w+)(?:\.py)?[.:] ?(\w+)", doc))
    checked = 0
    for module, attr in named:
        if module not in modules or attr in ("py",):
            continue
        obj = importlib.import_module(modules[module])
        assert hasattr(obj, attr) or any(hasattr(v, attr) for v in vars(obj).values() if isinstance(v, type)), \
            f"docs/architecture.md names {module}.{attr}, which does not exist"
        checked += 1
    assert checked >= 30, checked
