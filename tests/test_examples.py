"""Every tutorial notebook in examples/ runs top to bottom against real CPU servers (each
notebook's own assertions fail the run when it stops showing what it claims), and is committed
with its outputs cleared."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ipynb"))


def test_there_are_tutorials():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    book = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in book.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, servers, monkeypatch, tmp_path):
    llama, vlm, demo, qwen_vl = servers.get("llama", "llava_llama", "demo", "qwen_vl_spans")
    monkeypatch.setenv("SGL_EMBEDS_URL", llama.url)  # mechanics: the tiny Llama
    monkeypatch.setenv("SGL_EMBEDS_VLM_URL", vlm.url)  # the tiny LLaVA's split LLM
    monkeypatch.setenv("SGL_EMBEDS_DEMO_URL", demo.url)  # meaning: SmolLM2-135M-Instruct
    monkeypatch.setenv("SGL_EMBEDS_QWEN_VL_URL", qwen_vl.url)  # the tiny Qwen2.5-VL, NaN tower
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in book.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    code = "".join(c.source for c in book.cells if c.cell_type == "code")
    assert "assert " in code, f"{path.name} checks nothing it shows"
