"""The module map: no import circle, and each side of the wire owns its code.

Four top-level packages: ``sgl_embeds`` (the client), ``sgl_embeds_srt`` (the server plugin),
``sgl_embeds_protocol`` (what both sides share) and ``sgl_embeds_cpu`` (the opt-in CPU kernels).
Every import counts, including those inside functions (a lazy import is still a dependency), and
the package ``__init__`` counts as a module: importing any ``sgl_embeds.*`` module runs it. The
server never imports the client package, nor the client the server's; the shared package imports
neither. The CPU kernels import only shared modules, and neither side imports them (only the test
support that runs an ``sglang.Engine`` in its own process turns them on).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT, SERVER, SHARED, CPU = "sgl_embeds", "sgl_embeds_srt", "sgl_embeds_protocol", "sgl_embeds_cpu"
TESTING = "sgl_embeds_testing"  # the test support: testing/, a distribution the wheel never carries
# the one import of the CPU kernels' switch from outside them: testing.server.engine turns them on
# in a process that may have imported SGLang before the opt-in (an in-process Engine)
CPU_SWITCH_USERS = {"sgl_embeds_testing.server": {CPU, f"{CPU}.plugin"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[1:] if parts[0] == "testing" else parts  # testing/sgl_embeds_testing/...
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _side(module: str) -> str:
    return {SERVER: "server", SHARED: "shared", CPU: "cpu", TESTING: "tests"}.get(module.split(".")[0], "client")


def _files() -> list[Path]:
    folders = [ROOT / package for package in (CLIENT, SERVER, SHARED, CPU)] + [ROOT / "testing" / TESTING]
    return [p for folder in folders for p in folder.rglob("*.py")]


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
    ``__init__`` included), the client and the shared modules never import server modules, and
    nothing the wheel installs imports the test support (the test support may import anything)."""
    graph = import_graph(packages=True)
    assert "sgl_embeds" in graph["sgl_embeds.vlm.tower"]  # the package __init__ a module runs
    assert {_side(m) for m in graph} == {"client", "server", "shared", "cpu", "tests"}
    for module, deps in graph.items():
        side = _side(module)
        if side == "tests":
            continue
        tests = sorted(d for d in deps if _side(d) == "tests")
        assert not tests, f"{module} imports the test support {tests}, which the wheel does not carry"
        if side in ("server", "shared", "cpu"):
            client = sorted(d for d in deps if _side(d) == "client")
            assert not client, f"{module} imports client modules {client}"
        if side in ("client", "shared", "cpu"):
            server = sorted(d for d in deps if _side(d) == "server")
            assert not server, f"{module} imports server modules {server}"
        if side != "cpu":
            cpu = sorted(d for d in deps if _side(d) == "cpu" and d not in CPU_SWITCH_USERS.get(module, ()))
            assert not cpu, f"{module} imports the CPU kernels' modules {cpu}: only SGLang turns them on"


def test_a_client_import_by_the_server_would_be_found():
    graph = {"sgl_embeds_srt.plugin": {"sgl_embeds"}, "sgl_embeds": set()}
    assert any(_side(d) == "client" for d in graph["sgl_embeds_srt.plugin"])
    assert _side("sgl_embeds_protocol.wire") == "shared" and _side("sgl_embeds_srt.http") == "server"
    assert _side("sgl_embeds_cpu.kernels") == "cpu" and _side("sgl_embeds_testing.server") == "tests"


PLUGIN_PROBE = ("import sys\n"
                "from importlib.metadata import entry_points\n"
                "[ep] = [e for e in entry_points(group='sglang.srt.plugins') if e.name == 'sgl_embeds']\n"
                "ep.load()()\n"
                "print(sorted(m for m in sys.modules if m == 'sgl_embeds' or m.startswith('sgl_embeds.')))\n"
                "print('sglang.embeds' if hasattr(sys.modules['sglang'], 'embeds') else '')\n")


def _client_probe() -> str:
    from sgl_embeds_protocol.family import FAMILIES

    # transformers.models.<name>.modeling_* (its image processors are loaded by transformers itself)
    towers = ["clip", "siglip", *(family.name for family in FAMILIES)]
    return ("import sys, sgl_embeds, sgl_embeds.vlm\n"
            f"towers = {towers!r}\n"
            "print('\\n'.join(m for m in sys.modules if m.split('.')[0] == 'open_clip'\n"
            "      or m.startswith('transformers.models.') and m.split('.')[2] in towers and '.modeling_' in m\n"
            "      or m in ('sgl_embeds.vlm.qwen_vl', 'sgl_embeds.vlm.anyres', 'sgl_embeds.vlm.tower',\n"
            "               'sgl_embeds.vlm.paligemma')))\n"
            "from sgl_embeds.vlm import QwenVLEncoder\n"
            "print('asked', 'sgl_embeds.vlm.qwen_vl' in sys.modules)\n")


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, subprocess.CompletedProcess]:
    """The import probes, each in a fresh interpreter (what an import loads is the question),
    started at once: each is mostly SGLang's import, on one core."""
    probes = {"plugin": PLUGIN_PROBE, "client": _client_probe()}
    runs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name, code in probes.items()}
    outputs = {name: run.communicate(timeout=300) for name, run in runs.items()}
    return {name: subprocess.CompletedProcess(run.args, run.returncode, *outputs[name]) for name, run in runs.items()}


def test_loading_the_plugin_loads_no_client_module(fresh_imports):
    """In a fresh interpreter, as SGLang does it: the entry point loaded, ``register()`` run."""
    out = fresh_imports["plugin"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", ""], out.stdout


def test_every_module_and_function_named_in_the_architecture_doc_exists():
    import importlib
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    full = [_module_name(p) for p in _files() if not p.name.startswith("__")]
    modules = {m.rsplit(".", 1)[-1]: m for m in full}
    named = set(re.findall(r"`((?:\w+/)*)(\w+)(?:\.py)?[.:] ?(\w+)", doc))
    checked = 0
    for folder, module, attr in named:
        # a folder before the name picks among modules of one name (plugin: the server's, the CPU one's)
        dotted = folder.replace("/", ".") + module
        by_path = [m for m in full if folder and (m == dotted or m.endswith("." + dotted))]
        if (module not in modules and not by_path) or attr in ("py",):
            continue
        obj = importlib.import_module(by_path[0] if len(by_path) == 1 else modules[module])
        assert hasattr(obj, attr) or any(hasattr(v, attr) for v in vars(obj).values() if isinstance(v, type)), \
            f"docs/architecture.md names {module}.{attr}, which does not exist"
        checked += 1
    assert checked >= 30, checked


# -- the module map and the test tree as docs/architecture.md draws them ------------------------

_MAP_ROW = re.compile(r"^\| `((?:sgl_embeds|sgl_embeds_srt|sgl_embeds_protocol|sgl_embeds_cpu|testing|csrc)/[\w/.]*)` \| (\w+) \|", re.M)


def test_the_module_map_lists_every_module_on_its_side():
    """Every module of both packages is in the doc's module map (by its file, or its folder), on
    the side the import checks above hold it to."""
    rows = dict(_MAP_ROW.findall((ROOT / "docs" / "architecture.md").read_text()))
    assert len(rows) >= 30, rows
    for path in _files():
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and relative.count("/") == 1:
            continue  # a package's own __init__: the package row is its modules
        row = rows.get(relative) or next((rows[d] for d in rows if d.endswith("/") and relative.startswith(d)), None)
        assert row is not None, f"docs/architecture.md's module map has no row for {relative}"
        side = _side(_module_name(path))
        assert row == side, (relative, row, side)


TEST_ROOT = ROOT / "tests"
TEST_FOLDERS = {"unit", "server", "vlm", "examples", "sabotage"}
SHARED_TEST_CODE = {"conftest.py", "helpers.py", "fake_server.py", "strategies.py", "llava_harness.py",
                    "qwen_vl_harness.py", "engine_probe.py"}
_STARTS_SERVERS = re.compile(r"\b(Server|Gateway)\(|sglang\.Engine\(|start_multi_tokenizer\(")


def test_the_tests_live_in_folders_by_what_they_need():
    top = {p.name for p in TEST_ROOT.iterdir() if p.name != "__pycache__"}
    assert top == TEST_FOLDERS | SHARED_TEST_CODE, top ^ (TEST_FOLDERS | SHARED_TEST_CODE)
    tests = sorted(TEST_ROOT.rglob("test_*.py"))
    names = [p.name for p in tests]
    assert len(names) == len(set(names)), "two test files share a name (pytest imports them by name)"
    for path in tests:
        if path == Path(__file__).resolve():
            continue
        source = path.read_text()
        tree = ast.parse(source)
        classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        assert not [c for c in classes if c.startswith("Fake")] and "ThreadingHTTPServer" not in source, (
            f"{path.name}: a fake server belongs in tests/fake_server.py")
        if path.parent.name == "unit":
            params = {a.arg for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for a in n.args.args}
            pooled = {p for p in params if p.endswith("_server") or p in ("gateway", "servers")}
            assert not pooled and not _STARTS_SERVERS.search(source), (
                f"tests/unit/{path.name} uses a server ({sorted(pooled)}): it belongs in tests/server or tests/vlm")


# Names retired for one word per concept (docs/concepts.md, Glossary): kept out of code, tests,
# docs, benchmarks, programs and tutorials (benchmark results and sabotage patches are history)
RETIRED = [r"(?<![\w-])Embeds\b", r"\bSglEmbeds\b", r"\bspan_handle\b", r"\bKeptSpans?\b", r"\bkept_rows\b", r"\b_KEPT\b",
           r"\bremembered_ids\b", r"\brows_crossed\b", r"(?<!_)\bSPAN_FIELDS\b", r"\bchecked_row_digests\b",
           r"\bchecked_rows\b", r"\b_checked\b", r"PromptRows\.checked", r"\bspan_prompt=", r"\bWRITTEN\b",
           r"\bWrittenBody\b", r"\b_resent_inline\b", r"\bPROMPT_ROWS_KEY\b", r"\bSpanPart\b", r"\.crosses\b",
           r"""scope\["state"\]""", r"(?<!SPAN_)\bPART_TYPE\b", r"\b_keepers\b",
           r"\bSGL_EMBEDS_[A-Z]"]  # the settings' old prefix (SGLang rewrites SGL_ names and warns)


def _project_files() -> list[Path]:
    keep = (".py", ".md", ".ipynb", ".sh")
    return [p for p in ROOT.rglob("*") if p.suffix in keep and p.is_file()
            and not {".venv", "results", "sabotage", ".git", "build", "__pycache__"} & set(p.relative_to(ROOT).parts)
            and p != Path(__file__).resolve()]


def test_retired_names_stay_out():
    found = []
    for path in _project_files():
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {pattern}" for pattern in RETIRED if re.search(pattern, text)]
    assert not found, "retired names (docs/concepts.md, Glossary):\n" + "\n".join(found)


def test_a_retired_name_would_be_found():
    assert re.search(RETIRED[0], "seg.Embeds(rows)") and not re.search(RETIRED[0], "EmbedsEndpoint(url)")
    assert not any(re.search(p, "REQUEST_SPAN_FIELDS, SPAN_PART_TYPE, PositionalEmbeds") for p in RETIRED)


def _defined_names() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module short name -> its top-level names, class name -> its attribute and field names),
    read from the source (importing a module may install hooks: ``http/worker_app.py`` does)."""
    modules, classes = {}, {}
    for path in _files():
        if path.name.startswith("__") or _side(_module_name(path)) == "tests":  # the product's names
            continue
        top = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                top |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        if isinstance(t, ast.Name)}
            if isinstance(node, ast.ClassDef):
                members = classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        modules[path.stem] = top
    return modules, classes


def test_every_name_in_the_glossary_exists():
    doc = (ROOT / "docs" / "concepts.md").read_text()
    glossary = doc[doc.index("## Glossary"):doc.index("\n## ", doc.index("## Glossary") + 1)]
    modules, classes = _defined_names()
    everywhere = set().union(*modules.values())
    checked = 0
    for cell in re.findall(r"^\| [^|]+ \| ([^|]+) \|", glossary, re.M)[2:]:
        for name in re.findall(r"`([\w.]+)(?:\([\w, ]*\))?`", cell):
            if name.endswith(".py"):
                continue
            first, *rest = name.split(".")
            if first in modules:
                ok = not rest or rest[0] in modules[first]
            else:
                ok = first in everywhere and (not rest or rest[0] in classes.get(first, set()))
            assert ok, f"docs/concepts.md's glossary names {name}, which does not exist"
            checked += 1
    assert checked >= 25, checked


def test_every_sabotage_patch_still_applies():
    """A deliberate break that no longer applies tests nothing (``scripts/sabotage.sh`` exits 2):
    each patch must apply to the code as it is now."""
    import subprocess

    patches = sorted((TEST_ROOT / "sabotage").glob("*.patch"))
    assert len(patches) >= 9
    for patch in patches:
        out = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"{patch.name} no longer applies: {out.stderr.strip()}"
        # the tests that must catch it (scripts/sabotage.sh, CI's rotation)
        first = patch.read_text().split("\n", 1)[0]
        assert first.startswith("tests: tests/"), f"{patch.name}: its first line must name its tests"


# Where a family's name may be written in the packages: its record (the table every other module
# reads) and its family modules (docs/architecture.md, "Adding a family"); the test builders are
# test support, not the client
FAMILY_HOMES = {"sgl_embeds_protocol/family.py", "sgl_embeds/vlm/checkpoint.py", "sgl_embeds/vlm/tower.py",
                "sgl_embeds/vlm/anyres.py", "sgl_embeds/vlm/qwen_vl.py", "sgl_embeds/vlm/paligemma.py",
                "sgl_embeds/vlm/gemma3.py", "sgl_embeds/vlm/gemma4.py", "sgl_embeds/vlm/florence2.py",
                "sgl_embeds_srt/florence2.py"}


def _family_names_outside_their_homes(files: dict[str, str]) -> list[str]:
    from sgl_embeds_protocol.family import FAMILIES

    names = {family.name for family in FAMILIES}
    found = []
    for rel, source in files.items():
        if rel in FAMILY_HOMES or rel.startswith("testing/sgl_embeds_testing/"):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_a_family_is_named_only_by_its_record_and_its_modules():
    """No branch or table on family names outside ``family.FAMILIES`` and the family's modules:
    everything else reads the record (``family.family_of``)."""
    files = {str(p.relative_to(ROOT)): p.read_text() for p in _files()}
    found = _family_names_outside_their_homes(files)
    assert not found, "family names outside their record and modules:\n" + "\n".join(found)
    assert all((ROOT / home).exists() for home in FAMILY_HOMES)


def test_a_branch_on_a_family_name_would_be_found():
    source = 'def f(model_type):\n    return model_type == "qwen2_5_vl"\n'
    assert _family_names_outside_their_homes({"sgl_embeds_srt/prompts.py": source}) == [
        "sgl_embeds_srt/prompts.py:2: 'qwen2_5_vl'"]
    assert not _family_names_outside_their_homes({"sgl_embeds/vlm/qwen_vl.py": source})


def test_importing_the_client_loads_no_familys_code(fresh_imports):
    """``import sgl_embeds`` (and ``connect``'s module) loads a family's modules, its transformers
    model classes and open_clip only when a program uses that family."""
    out = fresh_imports["client"]
    assert out.returncode == 0, out.stderr[-2000:]
    *loaded, asked = out.stdout.strip().splitlines()
    assert loaded == [] and asked == "asked True", out.stdout


MAX_MODULE_DOC_LINES = 8  # what the module owns and the invariant it keeps; the story is in docs/


def _long_module_docstrings(files: dict[str, str]) -> list[str]:
    found = []
    for rel, source in files.items():
        lines = len((ast.get_docstring(ast.parse(source)) or "").splitlines())
        if lines > MAX_MODULE_DOC_LINES:
            found.append(f"{rel}: {lines} lines")
    return found


def test_module_docstrings_are_short():
    """A module docstring says what the module owns and the invariant it keeps, in at most
    ``MAX_MODULE_DOC_LINES`` lines; the architecture and its reasons live in docs/."""
    files = {str(p.relative_to(ROOT)): p.read_text() for p in _files()}
    assert "testing/sgl_embeds_testing/reference.py" in files  # the test support counts too
    found = _long_module_docstrings(files)
    assert not found, f"module docstrings over {MAX_MODULE_DOC_LINES} lines (move the story to docs/):\n" + \
        "\n".join(found)


def test_a_long_module_docstring_would_be_found():
    nine = '"""' + "\n".join(f"line {i}" for i in range(1, 10)) + '\n"""\nX = 1\n'
    eight = '"""' + "\n".join(f"line {i}" for i in range(1, 9)) + '\n"""\nX = 1\n'
    assert _long_module_docstrings({"a.py": nine, "b.py": eight, "c.py": "X = 1\n"}) == ["a.py: 9 lines"]


# -- the README: short enough to read at once, and its test command is the one CI runs -----------

README_MAX_WORDS = 900  # issue #47: what it is, why, install, serve, a program, HTTP, models, limits


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    words = len(readme.split())
    assert words < README_MAX_WORDS, f"README.md has {words} words, {README_MAX_WORDS} at most: move detail to docs/"
    assert "`make test`" in readme, "README.md no longer names its test command"
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.M), ".ci/run no longer runs `make test`"
