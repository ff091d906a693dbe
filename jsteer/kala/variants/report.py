"""The comparison table of the knowledge-integration variants (the layout of KALA's Table 4).

``experiments/kala_variants.py`` runs the sweep (one ``variants_<dataset>.json`` per data set under
:data:`jsteer.kala.protocol.OUT`) and writes the table with :func:`table`;
notebooks/knowledge_comparison.ipynb shows the same. :func:`load_results` merges a sweep with the
KALA harness sweep (``ner_<dataset>.json`` of ``experiments/kala_ner.py``) for KALA's own methods
when both ran the same protocol (:func:`jsteer.kala.protocol.same_protocol`); :func:`summarise`
reduces runs to per-method means (train times only over runs not marked ``timing_perturbed``,
:func:`jsteer.kala.protocol.timed`). :func:`run_small` (from :mod:`jsteer.kala.variants.synthetic`)
is the tiny synthetic rerun shown beside the table.
"""

from __future__ import annotations

import json
import pathlib

from jsteer.kala.protocol import OUT, same_protocol, timed
from jsteer.kala.variants.synthetic import run_small  # noqa: F401  (the tiny rerun beside the table)

# the table's rows, in order: the variants sweep's methods (--methods of the script) with the
# harness' own (more_params, pointwise, relational); jsteer.kala.variants.registry.METHODS are
# the variants that registry builds
METHODS = ("finetune", "more_params", "pointwise", "relational", "ernie", "kbert", "eae", "adapter")
NAMES = {
    "finetune": "Fine-tuning",
    "pointwise": "KALA (point-wise)",
    "relational": "KALA (relational)",
    "ernie": "ERNIE (fusion)",
    "kbert": "K-BERT (sentence tree)",
    "eae": "Entities as Experts",
    "adapter": "Knowledge adapter",
    "more_params": "Fine-tuning + 1 layer",
}
DATASET_NAMES = {"conll": "CoNLL-2003", "ncbi": "NCBI-Disease"}


def summarise(runs: list[dict]) -> dict:
    """{method: {"f1": mean, "f1_std": std, "n": seeds, "train_seconds": mean, ...}}."""
    import numpy as np

    out = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == method]
        f1 = np.array([r["f1"] for r in rs])
        timed_rs = timed(rs)
        out[method] = {
            "f1": float(f1.mean()),
            "f1_std": float(f1.std(ddof=1)) if len(f1) > 1 else 0.0,
            "n": len(rs),
            "seeds": sorted(r["seed"] for r in rs),
            "f1_unseen": float(np.mean([r.get("f1_unseen", np.nan) for r in rs])),
            "train_seconds": float(np.mean([r["train_seconds"] for r in timed_rs])),
            "n_timed": len(timed_rs),
            "median_step_seconds": float(np.nanmean([r.get("median_step_seconds") or np.nan for r in timed_rs]))
            if any(r.get("median_step_seconds") for r in timed_rs)
            else None,
            "steps": int(rs[0]["steps"]),
            "params": int(rs[0]["params"]),
        }
    return out


def load_results(results_dir: pathlib.Path = OUT) -> dict:
    """{dataset: {"setup": ..., "summary": summarise(runs), "sources": {method: file}}}: this
    sweep's runs (``variants_<dataset>.json``) plus, for KALA's own methods it did not run,
    the harness sweep's (``ner_<dataset>.json`` of ``experiments/kala_ner.py``, same data and
    settings) when present."""
    out = {}
    for ds in DATASET_NAMES:
        mine_path, kala_path = results_dir / f"variants_{ds}.json", results_dir / f"ner_{ds}.json"
        runs, setup, sources = [], {}, {}
        if mine_path.is_file():
            res = json.loads(mine_path.read_text())
            runs, setup = list(res["runs"]), res.get("setup", {})
            sources = {r["method"]: mine_path.name for r in runs}
        if kala_path.is_file():
            res = json.loads(kala_path.read_text())
            if setup and not same_protocol(setup, res.get("setup", {})):
                res = {"runs": []}  # the harness sweep ran another protocol: not comparable
            for r in res.get("runs", []):
                method = r.get("variant")
                if (
                    method in ("finetune", "more_params", "pointwise", "relational")
                    and sources.get(method, kala_path.name) == kala_path.name
                ):
                    runs.append({**r, "method": method})
                    sources[method] = kala_path.name
            setup = setup or res.get("setup", {})
        if runs:
            out[ds] = {"setup": setup, "summary": summarise(runs), "sources": sources}
    return out


def table(results: dict, methods=METHODS) -> str:
    """Markdown: one row per method, F1 (mean ± std over seeds) and train time per dataset."""
    ds = [d for d in DATASET_NAMES if d in results]
    head = (
        "| Method | "
        + " | ".join(f"{DATASET_NAMES[d]} F1 | {DATASET_NAMES[d]} train s | {DATASET_NAMES[d]} step s" for d in ds)
        + " |"
    )
    rows = [head, "|" + "---|" * (1 + 3 * len(ds))]
    for m in methods:
        cells = []
        for d in ds:
            s = results[d]["summary"].get(m)
            if s is None:
                cells += ["–", "–", "–"]
            else:
                step = s.get("median_step_seconds")
                cells += [
                    f"{s['f1']:.2f} ± {s['f1_std']:.2f} (n={s['n']})",
                    f"{s['train_seconds']:.0f}",
                    "–" if step is None else f"{step:.2f}",
                ]
        if any(c != "–" for c in cells):
            other = any(results[d].get("sources", {}).get(m, "").startswith("ner_") for d in ds)
            rows.append(f"| {NAMES.get(m, m)}{' †' if other else ''} | " + " | ".join(cells) + " |")
    rows.append("")
    for d in ds:
        st, steps = results[d]["setup"], {s["steps"] for s in results[d]["summary"].values()}
        rows.append(
            f"{DATASET_NAMES[d]}: {st.get('train_size')} training / {st.get('test_size')} test sentences, "
            f"{st.get('epochs')} epoch(s) of batch {st.get('batch_size')} ({'/'.join(map(str, sorted(steps)))} "
            f"updates), length <= {st.get('max_len')}, lr {st.get('lr')}, knowledge-module lr "
            f"{st.get('kala_lr')}.  "
        )
    if any(s.get("n_timed", s["n"]) < s["n"] for d in ds for s in results[d]["summary"].values()):
        rows.append(
            "Times are means over the runs not marked `timing_perturbed` in the JSON (another job shared "
            "the CPU during those; their F1 is unaffected).  "
        )
    rows.append(
        "train s: wall seconds of steps 2..N (includes recompiles for new batch shapes); step s: median "
        "train-step seconds (robust to them). Shared, loaded 2-core CPU: times are noisy."
    )
    harness = [
        DATASET_NAMES[d] for d in ds if any(src.startswith("ner_") for src in results[d].get("sources", {}).values())
    ]
    if harness:
        rows.append("")
        rows.append(
            f"† on {', '.join(harness)}: runs of the KALA harness sweep (experiments/kala_ner.py): same data, "
            "subsets and settings, timed in another process."
        )
    return "\n".join(rows)
