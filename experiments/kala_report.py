"""Write the KALA results report (experiments/results/kala/results.md) from the experiment JSON.

    python experiments/kala_report.py            # writes experiments/results/kala/results.md
    python experiments/kala_report.py --from-variants ncbi   # main-group runs from variants_ncbi.json first

The tables and verdicts are :mod:`jsteer.kala.report` (notebooks/kala.ipynb shows the same report).
"""

from __future__ import annotations

import sys

from jsteer.kala.protocol import import_variants
from jsteer.kala.report import RESULTS, report

if __name__ == "__main__":
    if sys.argv[1:2] == ["--from-variants"]:
        for ds in sys.argv[2:]:
            print("wrote", import_variants(ds))
    text = report()
    (RESULTS / "results.md").write_text(text)
    print(text)
    sys.exit(0)
