"""Every notebook in notebooks/ executes top to bottom in its small setting (JSTEER_SMALL=1)."""

import os
import pathlib
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed_without_machine_paths(path):
    """A reader opening the notebook sees its tables and plots (notebooks/execute.py wrote them),
    and nothing in them names the machine that ran it."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: run notebooks/execute.py"
    outs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outs if o.get("output_type") == "error"], path.name
    assert any("image/png" in o.get("data", {}) for o in outs), f"{path.name}: no plot in its outputs"
    assert any("text/markdown" in o.get("data", {}) for o in outs), f"{path.name}: no table in its outputs"
    text = "\n".join(
        o.get("text", "") + "".join(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/")) for o in outs
    )
    for root in ("/work/", "/tmp/", "/home/", "/root/", "/check/", sys.prefix):
        assert root not in text, f"{path.name}: an output names {root}"


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
