"""Tables (markdown) and plots (PNG) from the LM-Steer experiment JSON.

    .venv/bin/python experiments/steer_plots.py [experiments/results/steer/smollm2.json] [--out DIR]
    .venv/bin/python experiments/steer_plots.py experiments/results/steer/smollm2_1000steps.json

The main run (``smollm2.json``) writes ``results.md`` with every run beside it (detox protocol,
recipe sweeps, baselines) and the plots; another run ``smollm2_<tag>.json`` writes only its own
tables to ``results_<tag>.md`` and plots named ``<plot>_<tag>.png``. The tables and verdicts are
:mod:`jsteer.steer.report` (notebooks/lm_steer.ipynb shows the same).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

from jsteer.steer.protocol import RESULTS
from jsteer.steer.report import detox_table, markdown, plot_all, sweep_table, table3
from jsteer.steer.verdicts import targets

matplotlib.use("Agg")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="?", default=str(RESULTS / "smollm2.json"))
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    res = json.loads(pathlib.Path(a.json).read_text())
    print(table3(res), "\n")
    print(sweep_table(res), "\n")
    print(detox_table(res), "\n")
    print(json.dumps(targets(res), indent=1))
    bp = pathlib.Path(a.json).parent / "bench.json"
    bench = json.loads(bp.read_text()) if bp.exists() else None
    pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
    src = pathlib.Path(a.json)
    suffix = src.stem[len("smollm2") :] if src.stem.startswith("smollm2") else "_" + src.stem  # "" for the main run
    md = pathlib.Path(a.out) / f"results{suffix}.md"
    md.write_text(markdown(res, bench, src.parent if not suffix else None, src.name))
    print("wrote", md)
    for f in plot_all(res, pathlib.Path(a.out), suffix):
        print("wrote", f)


if __name__ == "__main__":
    main()
