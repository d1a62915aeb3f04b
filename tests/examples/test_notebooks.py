"""Every tutorial notebook in examples/ is committed with its outputs (a reader on the web sees
its answers and pictures) and runs top to bottom against real CPU servers, where it must show the
same claims as the committed run (``sgl_embeds_testing.claims``: the ✓ lines, which hold only what
is stable across machines) and the same pictures. ``make notebooks`` refreshes the outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import re

import nbformat
import pytest
from nbclient import NotebookClient

from sgl_embeds_testing import notebook_kernels, zygote
from sgl_embeds_testing.claims import claims_in

pytestmark = pytest.mark.per_server  # each tutorial where its servers run anyway
NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.ipynb"))
MIN_CLAIMS = 3
# a folder of the machine a notebook last ran on (scripts/refresh_notebooks.py writes them as
# <checkout>/, ~/ and <tmp>/)
MACHINE_PATH = re.compile(r"(?<![\w<>~.])/(?:work|root|home|tmp|check|Users|private|var/folders)/")
SERVER_URLS = notebook_kernels.SERVER_URLS  # the URL variables a notebook reads, and the pool server each names


def _claims(book) -> list[str]:
    return claims_in(o.get("text", "") for c in book.cells for o in c.get("outputs", []) if o.get("output_type") == "stream")


def _pictures(book) -> list[int]:
    """The code cells (by index) that show a picture."""
    return [i for i, c in enumerate(book.cells)
            if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]


def test_there_are_tutorials():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_its_outputs(path):
    book = nbformat.read(path, as_version=4)
    unrun = [i for i, c in enumerate(book.cells) if c.cell_type == "code" and c.get("execution_count") is None]
    assert not unrun, f"{path.name}: cells {unrun} were not run: refresh with `make notebooks`"
    assert not [o for c in book.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert len(_claims(book)) >= MIN_CLAIMS, f"{path.name} shows fewer than {MIN_CLAIMS} checked claims"
    shown = [text for c in book.cells for o in c.get("outputs", [])
             for text in [o.get("text", ""), *(v for v in o.get("data", {}).values() if isinstance(v, str))]]
    paths = sorted({m.group(0) + t[m.end():].split()[0][:40] for t in shown for m in MACHINE_PATH.finditer(t)})
    assert not paths, f"{path.name} shows folders of the machine it ran on: {paths}"


def _urls_read(path: Path) -> list[str]:
    return sorted(set(re.findall(r"SGLANG_EMBEDS_\w*URL", path.read_text())))


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.pooled(*(SERVER_URLS.get(v, v) for v in _urls_read(p))))
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom_and_shows_what_is_committed(path, servers, monkeypatch, tmp_path):
    committed = nbformat.read(path, as_version=4)
    wanted = _urls_read(path)
    assert wanted and set(wanted) <= set(SERVER_URLS), f"{path.name} reads {wanted}"
    for variable, server in zip(wanted, servers.get(*[SERVER_URLS[v] for v in wanted])):
        monkeypatch.setenv(variable, server.url)
    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # the kernel forked from a process that has imported the client (notebook_kernels.py), so a
    # tutorial's time is its cells', not its kernel's imports; a cell that raises (a claim that
    # does not hold: its AssertionError) is an error output this test asserts on, not an
    # exception of nbclient's that hides which claim failed
    NotebookClient(book, timeout=300, kernel_name="python3", allow_errors=True,
                   kernel_manager_class=notebook_kernels.ForkedKernelManager,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [f"{o['ename']}: {o['evalue']}" for c in book.cells for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors}"
    assert _claims(book) == _claims(committed), f"{path.name} no longer shows what its committed outputs show"
    assert _pictures(book) == _pictures(committed)


def test_a_tutorials_kernel_is_forked_with_the_client_imported_and_nothing_of_the_server(monkeypatch, tmp_path):
    """The kernel a tutorial runs in (notebook_kernels.py): a child of the client zygote, in the
    notebook's folder and environment, with the client imported and nothing of the server side
    (the plugin, SGLang's HTTP server), and without the zygote's folder on its path."""
    if not zygote.enabled():
        pytest.skip(f"{zygote.SWITCH}=0: the kernels start fresh interpreters")
    monkeypatch.setenv("SGLANG_EMBEDS_URL", "http://127.0.0.1:1")
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import json, os, sys\n"
        "print(json.dumps({'parent': os.getppid(), 'cwd': os.getcwd(), 'path': sys.path,\n"
        "                  'url': os.environ.get('SGLANG_EMBEDS_URL'),\n"
        "                  'loaded': [m for m in ('sgl_embeds', 'sgl_embeds_srt', 'sglang.srt.entrypoints.http_server')\n"
        "                             if m in sys.modules]}))")])
    NotebookClient(book, timeout=120, kernel_name="python3", kernel_manager_class=notebook_kernels.ForkedKernelManager,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    seen = json.loads(book.cells[0].outputs[0]["text"])
    assert seen["parent"] not in (os.getpid(), 1), "forked from the zygote, not started by this process"
    assert seen["cwd"] == str(tmp_path) and seen["url"] == "http://127.0.0.1:1"
    assert seen["loaded"] == ["sgl_embeds"], seen["loaded"]
    assert str(Path.cwd()) not in seen["path"], "the zygote's folder (this run's) stays off the kernel's path"
