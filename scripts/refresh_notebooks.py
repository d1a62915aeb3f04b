"""Run the tutorials in examples/ top to bottom and save them with their outputs (``make notebooks``).

Each notebook starts the server it needs (none of the SGLANG_EMBEDS_*_URL variables is passed on),
so a refresh needs nothing running. tests/examples/test_notebooks.py then requires CI's fresh run of each
notebook to show the same claims and pictures as the outputs saved here.

    .venv/bin/python scripts/refresh_notebooks.py [examples/NAME.ipynb ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def refresh(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as workdir:
        NotebookClient(book, timeout=600, kernel_name="python3", resources={"metadata": {"path": workdir}}).execute()
    nbformat.write(without_machine_paths(without_stderr(book)), path)


def without_stderr(book):
    """The notebook without what its cells wrote to stderr (libraries' warnings and progress
    bars, which differ from machine to machine and teach nothing)."""
    for cell in book.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
    return book


def machine_paths() -> dict[str, str]:
    """This machine's folders as a stored output names them instead: the checkout, the home
    folder, the temporary folder (longest first, so the checkout wins over a home it is in)."""
    places = {str(EXAMPLES.parent): "<checkout>", str(Path.home()): "~", tempfile.gettempdir(): "<tmp>"}
    return dict(sorted(places.items(), key=lambda item: -len(item[0])))


def without_machine_paths(book):
    """The notebook with this machine's folders in its outputs written as ``machine_paths`` says
    (a reader's machine has other ones; the checked claims hold none)."""
    places = machine_paths()

    def scrub(text: str) -> str:
        for place, name in places.items():
            text = text.replace(place + "/", name + "/")
        return text

    for cell in book.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if "text" in output:
                output.text = scrub(output.text)
            for kind, value in output.get("data", {}).items():
                if isinstance(value, str) and kind.startswith("text/"):
                    output.data[kind] = scrub(value)
    return book


def main(paths: list[str]) -> None:
    for name in [v for v in os.environ if v.startswith("SGLANG_EMBEDS_") and v.endswith("_URL")]:
        del os.environ[name]  # each notebook starts its own server
    for path in [Path(p) for p in paths] or sorted(EXAMPLES.glob("*.ipynb")):
        print(f"running {path.name} ...", flush=True)
        refresh(path)


if __name__ == "__main__":
    main(sys.argv[1:])
