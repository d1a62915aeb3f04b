"""The module map: no import circle inside sgl_embeds/, and each side of the wire owns its code.

Every import counts, including those inside functions (a lazy import is still a dependency).
The server side (``srt/``, ``cpu/``) never imports client modules; client modules import from
the server side only ``srt.targets`` (the one list of SGLang pins, which the frontend's hooks
use too). Shared modules (``segments``, ``wire``, ``lru``, ``keys``) import neither side.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_embeds"
SHARED = {"sgl_embeds.segments", "sgl_embeds.wire", "sgl_embeds.lru", "sgl_embeds.keys"}
CLIENT_PREFIXES = ("sgl_embeds.lang", "sgl_embeds.backend", "sgl_embeds.vision", "sgl_embeds.vlm", "sgl_embeds.demo")
SERVER_PREFIXES = ("sgl_embeds.srt", "sgl_embeds.cpu")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
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
                if t in modules and t != name and t != "sgl_embeds":  # the package __init__ is not a module edge
                    graph[name].add(t)
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
    assert "sgl_embeds.srt.openai" in graph["sgl_embeds.srt.http"]  # the graph sees real edges
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_circle_would_be_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_each_side_of_the_wire_owns_its_code():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith(SERVER_PREFIXES) or module in SHARED:
            client = sorted(d for d in deps if d.startswith(CLIENT_PREFIXES))
            assert not client, f"{module} imports client modules {client}"
        if module.startswith(CLIENT_PREFIXES) or module in SHARED:
            server = sorted(d for d in deps if d.startswith(SERVER_PREFIXES) and d != "sgl_embeds.srt.targets")
            assert not server, f"{module} imports server modules {server}"


def test_every_module_and_function_named_in_the_architecture_doc_exists():
    import importlib
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    modules = {_module_name(p).rsplit(".", 1)[-1]: _module_name(p) for p in PACKAGE.rglob("*.py")
               if not p.name.startswith("__")}
    named = set(re.findall(r"`(?:srt/|cpu/)?(\w+)(?:\.py)?[.:] ?(\w+)", doc))
    checked = 0
    for module, attr in named:
        if module not in modules or attr in ("py",):
            continue
        obj = importlib.import_module(modules[module])
        assert hasattr(obj, attr) or any(hasattr(v, attr) for v in vars(obj).values() if isinstance(v, type)), \
            f"docs/architecture.md names {module}.{attr}, which does not exist"
        checked += 1
    assert checked >= 30, checked
