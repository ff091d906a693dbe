"""Control vectors beside LM-Steer on SmolLM2's sentiment protocol, from the saved runs
(experiments/actsteer_smollm2.py: ``smollm2.json`` CAA, ``smollm2_<method>.json`` the others;
experiments/steer_smollm2.py: LM-Steer's ``smollm2.json``): one table and one plot of the
positivity change against the perplexity rise on the 20 neutral test prompts. Every row is read
against its own run's unsteered row (runs may score with separately trained evaluators).
Where the runs saved per-prompt positivity, each change gets a 95% interval and :func:`versus`
compares two methods' changes, both over prompts resampled together (the samples of one prompt are
not independent draws; every run uses the same test prompts).
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import numpy as np

from jsteer.workspace import RESULTS as _ALL_RESULTS

RESULTS = _ALL_RESULTS / "actsteer"
STEER = _ALL_RESULTS / "steer" / "smollm2.json"
RUNS = {"CAA": "smollm2.json", "PCA": "smollm2_pca.json"}
# the same protocol at the paper's 25 samples per prompt (results dir, LM-Steer's run); first in PROTOCOLS
RESULTS_25 = RESULTS / "samples25"
STEER_25 = _ALL_RESULTS / "steer" / "smollm2_samples25.json"
PROTOCOLS = ((RESULTS_25, STEER_25), (RESULTS, STEER))
MAX_RISE = 150  # % perplexity rise: the chart's right edge (LM-Steer reaches +1479% at +7)
RESAMPLES = 4000
STYLE = {"LM-Steer": ("o", "tab:blue"), "CAA": ("s", "tab:red"), "PCA": ("^", "tab:purple")}  # marker, colour


def change(rows: dict, key: str) -> tuple[float, float]:
    """(positivity change in points, perplexity rise in %) of ``rows[key]`` against its unsteered row."""
    r, b = rows[key], rows["neutral_base"]
    return 100 * (r["positivity"] - b["positivity"]), 100 * (r["ppl_mean"] / b["ppl_mean"] - 1)


def _per_prompt_change(rows: dict, key: str) -> Optional[np.ndarray]:
    """[P] positivity change per prompt of ``rows[key]`` against the unsteered row, or None when the
    run saved no per-prompt positivity."""
    r, b = rows[key].get("positivity_per_prompt"), rows["neutral_base"].get("positivity_per_prompt")
    if r is None or b is None:
        return None
    if len(r) != len(b):
        raise ValueError(f"{key}: {len(r)} prompts against the unsteered row's {len(b)}")
    return np.asarray(r, float) - np.asarray(b, float)


def _resampled_means(per_prompt: np.ndarray, seed: int) -> np.ndarray:
    """[RESAMPLES] means of ``per_prompt`` [P] over prompts resampled with replacement."""
    idx = np.random.default_rng(seed).integers(0, len(per_prompt), size=(RESAMPLES, len(per_prompt)))
    return per_prompt[idx].mean(axis=1)


def interval(per_prompt: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% interval (points) of the mean of ``per_prompt`` [P] over prompts resampled with
    replacement (:data:`RESAMPLES` times)."""
    lo, hi = np.percentile(_resampled_means(per_prompt, seed), [2.5, 97.5])
    return 100 * float(lo), 100 * float(hi)


def versus(a: tuple[dict, str], b: tuple[dict, str], seed: int = 0) -> dict:
    """Method A's positivity change minus method B's, each against its own unsteered row, over the
    same test prompts resampled together: ``a`` / ``b`` = (a run's metrics, a row key) ->
    {"difference", "p2.5", "p97.5"} in points and ``share_a_ahead`` (of the resamples)."""
    da, db = _per_prompt_change(*a), _per_prompt_change(*b)
    if da is None or db is None:
        raise ValueError(f"{a[1]} / {b[1]}: a run saved no per-prompt positivity (rerun it)")
    if len(da) != len(db):
        raise ValueError(f"{a[1]}: {len(da)} prompts, {b[1]}: {len(db)}; not the same test prompts")
    out, means = paired_difference(da - db, seed)
    return {**out, "share_a_ahead": float((means > 0).mean())}


def paired_difference(diff: np.ndarray, seed: int = 0) -> tuple[dict, np.ndarray]:
    """Per-prompt differences ``diff`` [P] -> ({"difference", "p2.5", "p97.5"} in points, the
    resampled means [RESAMPLES])."""
    means = _resampled_means(diff, seed)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"difference": 100 * float(diff.mean()), "p2.5": 100 * float(lo), "p97.5": 100 * float(hi)}, means


def steer_choices(ref: dict) -> tuple:
    """The steer values LM-Steer's run chose on held-out prompts (+positive, -negative)."""
    ch = ref.get("strength_selection", {}).get("chosen", {})
    return ch.get("positive"), -ch.get("negative", 0.0)


def runs(results: pathlib.Path = RESULTS, steer: pathlib.Path = STEER) -> dict:
    """{method: (metrics, [(row key, label, value, chosen on held-out prompts)])} of the saved runs:
    each control vector's chosen layer at +-s, LM-Steer's whole strength curve. Runs not yet saved
    are left out."""
    out = {}
    for name, file in RUNS.items():
        path = results / file
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        ch = res["selection"]["chosen"]
        rows = [
            (f"neutral_l{ch['layer']}_s{v:+g}", f"{name} layer {ch['layer']}, {v:+g}", v, True)
            for v in (ch["strength"], -ch["strength"])
        ]
        out[name] = (res["metrics"], rows)
    if steer.exists():
        ref = json.loads(steer.read_text())
        picked = steer_choices(ref)
        keys = [k for k in ref["metrics"] if k.startswith("neutral_s")]
        values = sorted((float(k.split("_s")[1]), k) for k in keys)
        rows = [(k, f"LM-Steer {v:+g} x eps0", v, v in picked) for v, k in values]
        out["LM-Steer"] = (ref["metrics"], rows)
    return out


def points(results: pathlib.Path = RESULTS, steer: pathlib.Path = STEER) -> dict:
    """{method: [(label, value, positivity change, ppl rise %, chosen on held-out prompts, 95%
    interval of the change or None)]} from :func:`runs`."""
    out = {}
    for name, (metrics, rows) in runs(results, steer).items():
        out[name] = []
        for key, label, v, chosen in rows:
            per = _per_prompt_change(metrics, key)
            out[name].append((label, v, *change(metrics, key), chosen, None if per is None else interval(per)))
    return out


def samples_per_prompt(results: pathlib.Path = RESULTS, steer: pathlib.Path = STEER) -> set:
    """The sample counts of the saved runs' unsteered test rows (one value when they agree)."""
    return {m["neutral_base"]["values"].get("samples") for m, _ in runs(results, steer).values()}


def table(pts: Optional[dict] = None) -> str:
    """Markdown: one row per point of :func:`points`; empty when nothing is saved."""
    pts = points() if pts is None else pts
    if not pts:
        return ""
    lines = [
        "| method | positivity change (points) | 95% interval | perplexity rise % | chosen on held-out prompts |",
        "|---|---|---|---|---|",
    ]
    for rows in pts.values():
        for label, _, dp, dr, chosen, ci in rows:
            span = "" if ci is None else f"{ci[0]:+.0f} to {ci[1]:+.0f}"
            lines.append(f"| {label} | {dp:+.0f} | {span} | {dr:+.0f} | {'yes' if chosen else ''} |")
    return "\n".join(lines)


def plot(out_png: pathlib.Path, pts: Optional[dict] = None, subtitle: str = "") -> Optional[pathlib.Path]:
    """Positivity change against perplexity rise, every method on one chart (points up to
    :data:`MAX_RISE`; 95% intervals as error bars where known) -> the PNG written (None when
    nothing is saved); ``subtitle`` names the protocol (e.g. "20 neutral prompts x 25 samples").
    Draws with matplotlib.pyplot in the caller's backend."""
    import matplotlib.pyplot as plt

    pts = points() if pts is None else pts
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    for name, rows in pts.items():
        marker, color = STYLE.get(name, ("x", "tab:gray"))
        marker += "-" if name == "LM-Steer" else ""
        rows = [r for r in rows if r[3] <= MAX_RISE]
        ax.plot([r[3] for r in rows], [r[2] for r in rows], marker, color=color, label=name)
        for _, v, dp, dr, _, ci in rows:
            ax.annotate(f"{v:+g}", (dr, dp), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
            if ci is not None:
                ax.errorbar([dr], [dp], yerr=[[dp - ci[0]], [ci[1] - dp]], fmt="none", ecolor=color, lw=0.8, alpha=0.6)
    title = f"SmolLM2-135M{', ' + subtitle if subtitle else ''} (rises > {MAX_RISE}% off the chart)"
    return finish(fig, ax, "positivity change (points)", title, out_png)


def finish(fig, ax, ylabel: str, title: str, out_png: pathlib.Path, legend_size: int = 8, legend_loc: str = "best"):
    """The comparison charts' frame: the zero line, the 30% perplexity limit, axis labels, title and
    legend; then :func:`save`."""
    ax.axhline(0, color="black", lw=0.6)
    ax.axvline(30, ls=":", color="gray", label="30% perplexity limit")
    ax.set_xlabel("perplexity rise over the unsteered samples (%)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size, loc=legend_loc)
    return save(fig, out_png)


def save(fig, out_png: pathlib.Path) -> pathlib.Path:
    """Write ``fig`` to ``out_png`` whole or not at all (a temporary file renamed), and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png = pathlib.Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(out_png.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
