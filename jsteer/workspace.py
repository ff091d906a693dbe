"""Where the repository's experiments keep their inputs and outputs, and the small I/O they share.

The experiment protocols (:mod:`jsteer.kala.protocol`, :mod:`jsteer.steer.data`, ...) read the
data sets beside the repository and write under it, as the scripts in ``experiments/`` always
have::

    <repo>/../shared/data          DATA: the data sets (CoNLL-2003, SST-5, Jigsaw, LAMA, ...)
    <repo>/experiments/results     RESULTS: the committed result JSON / markdown
    <repo>/runs, <repo>/out        RUNS / OUT: caches and scratch (graphs, memories, evaluators)
"""

from __future__ import annotations

import json
import os
import pathlib
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "experiments" / "results"
RUNS = ROOT / "runs"
OUT = ROOT / "out"


def log(*a) -> None:
    """Print with a wall-clock time stamp, flushed (long runs are followed through their logs)."""
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def write_json(path, obj) -> None:
    """Write ``obj`` as JSON (indent 1) atomically: a run killed mid-write leaves the old file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
