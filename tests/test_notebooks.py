"""Every notebook in notebooks/ executes top to bottom in its small setting (JSTEER_SMALL=1)."""

import os
import pathlib
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JSTEER_SMALL", "1")
    monkeypatch.setenv("JSTEER_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    # run the kernel with this interpreter so it sees the installed jsteer
    client.extra_arguments = []
    os.environ.setdefault("JUPYTER_PATH", str(pathlib.Path(sys.prefix) / "share" / "jupyter"))
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors, errors
