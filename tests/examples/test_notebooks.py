"""Every tutorial notebook in examples/ is committed with its outputs (a reader on the web sees
its answers and pictures) and runs top to bottom against real CPU servers, where it must show the
same claims as the committed run (``sgl_embeds_testing.claims``: the ✓ lines, which hold only what
is stable across machines) and the same pictures. ``make notebooks`` refreshes the outputs."""

from __future__ import annotations

from pathlib import Path

import re

import nbformat
import pytest
from nbclient import NotebookClient

from sgl_embeds_testing.claims import claims_in

pytestmark = pytest.mark.per_server  # each tutorial where its servers run anyway
NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.ipynb"))
MIN_CLAIMS = 3
# a folder of the machine a notebook last ran on (scripts/refresh_notebooks.py writes them as
# <checkout>/, ~/ and <tmp>/)
MACHINE_PATH = re.compile(r"(?<![\w<>~.])/(?:work|root|home|tmp|check|Users|private|var/folders)/")
# A notebook reads the URL of a running server from one of these (and starts its own without):
# the pool's server each stands for
SERVER_URLS = {"SGLANG_EMBEDS_URL": "llama",  # mechanics: the tiny Llama
               "SGLANG_EMBEDS_VLM_URL": "llava_llama",  # the tiny LLaVA's split LLM
               "SGLANG_EMBEDS_DEMO_URL": "demo",  # meaning: SmolLM2-135M-Instruct
               "SGLANG_EMBEDS_QWEN_VL_URL": "qwen_vl_spans",  # the tiny Qwen2.5-VL, NaN tower
               "SGLANG_EMBEDS_QWEN3_VL_URL": "qwen3_vl_spans",  # the tiny Qwen3-VL, NaN tower
               "SGLANG_EMBEDS_LLAVA_NEXT_URL": "llava_next",  # the tiny LLaVA-NeXT's split LLM
               "SGLANG_EMBEDS_PALIGEMMA2_URL": "paligemma2",  # the tiny PaliGemma 2, served split
               "SGLANG_EMBEDS_GEMMA3_URL": "gemma3_vlm",  # the tiny Gemma 3, served split
               "SGLANG_EMBEDS_GEMMA4_URL": "gemma4_vlm",  # the tiny Gemma 4 (E2B layout), served split
               "SGLANG_EMBEDS_FLORENCE2_URL": "florence2"}  # the tiny Florence-2, served whole


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
    # a cell that raises (a claim that does not hold: its AssertionError) is an error output this
    # test asserts on, not an exception of nbclient's that hides which claim failed
    NotebookClient(book, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [f"{o['ename']}: {o['evalue']}" for c in book.cells for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors}"
    assert _claims(book) == _claims(committed), f"{path.name} no longer shows what its committed outputs show"
    assert _pictures(book) == _pictures(committed)
