"""Execute every notebook in place, so that it is committed with its tables and plots.

    .venv/bin/python notebooks/execute.py [NAME.ipynb ...] [--small]

Outputs come from the committed results JSON plus each notebook's own rerun (full setting unless
``--small``). Plots the notebooks write go to a temporary folder (``JSTEER_OUT``), never over the
committed results; output text naming this machine's folders (the repository, the temporary
folder, the interpreter's prefix) is rewritten relative, and a path left over is an error.
tests/test_notebooks.py re-executes them small and checks the committed outputs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
MACHINE = ("/work/", "/tmp/", "/home/", "/root/", "/check/", "/usr/")


def scrub(nb, replace: dict[str, str]) -> list[str]:
    """Rewrite machine paths in text outputs; returns the lines that still name one."""
    left = []

    def fix(s: str) -> str:
        for a, b in replace.items():
            s = s.replace(a, b)
        return s

    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = fix(out["text"])
            for key in ("text/plain", "text/markdown", "text/html"):
                if key in out.get("data", {}):
                    out["data"][key] = fix(out["data"][key])
            if out.get("output_type") == "error":
                left.append(f"error: {out.get('ename')}: {out.get('evalue')}")
            text = out.get("text", "") + "".join(
                str(v) for k, v in out.get("data", {}).items() if k.startswith("text/")
            )
            left += [ln for ln in text.splitlines() if any(m in ln for m in MACHINE)]
    return left


def main(argv=None) -> int:
    import nbformat
    from nbclient import NotebookClient

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebooks to run (default: all in notebooks/)")
    ap.add_argument("--small", action="store_true", help="JSTEER_SMALL=1 (the CI setting)")
    a = ap.parse_args(argv)
    paths = [HERE / n for n in a.names] or sorted(HERE.glob("*.ipynb"))
    os.environ.setdefault("JUPYTER_PATH", str(pathlib.Path(sys.prefix) / "share" / "jupyter"))
    bad = 0
    with tempfile.TemporaryDirectory(prefix="jsteer-nb-") as tmp:
        os.environ["JSTEER_OUT"] = tmp
        os.environ["JSTEER_SMALL"] = "1" if a.small else "0"
        for path in paths:
            t0 = time.perf_counter()
            nb = nbformat.read(path, as_version=4)
            NotebookClient(
                nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
            ).execute()
            left = scrub(nb, {tmp: "$JSTEER_OUT", str(ROOT) + "/": "", str(ROOT): ".", sys.prefix: "$VENV"})
            if left:
                bad += 1
                print(f"{path.name}: NOT written, outputs name this machine or failed:\n  " + "\n  ".join(left[:10]))
                continue
            nbformat.write(nb, path)
            print(f"{path.name}: executed in {time.perf_counter() - t0:.0f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
