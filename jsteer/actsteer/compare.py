"""Control vectors beside LM-Steer on SmolLM2's sentiment protocol, from the saved runs
(experiments/actsteer_smollm2.py: ``smollm2.json`` CAA, ``smollm2_<method>.json`` the others;
experiments/steer_smollm2.py: LM-Steer's ``smollm2.json``): one table and one plot of the
positivity change against the perplexity rise on the 20 neutral test prompts. Every row is read
against its own run's unsteered row (the two runs score with separately trained evaluators).
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

from jsteer.workspace import RESULTS as _ALL_RESULTS

RESULTS = _ALL_RESULTS / "actsteer"
STEER = _ALL_RESULTS / "steer" / "smollm2.json"
RUNS = {"CAA": "smollm2.json", "PCA": "smollm2_pca.json"}
MAX_RISE = 150  # % perplexity rise: the chart's right edge (LM-Steer reaches +1479% at +7)


def change(rows: dict, key: str) -> tuple[float, float]:
    """(positivity change in points, perplexity rise in %) of ``rows[key]`` against its unsteered row."""
    r, b = rows[key], rows["neutral_base"]
    return 100 * (r["positivity"] - b["positivity"]), 100 * (r["ppl_mean"] / b["ppl_mean"] - 1)


def steer_choices(ref: dict) -> tuple:
    """The steer values LM-Steer's run chose on held-out prompts (+positive, -negative)."""
    ch = ref.get("strength_selection", {}).get("chosen", {})
    return ch.get("positive"), -ch.get("negative", 0.0)


def points(results: pathlib.Path = RESULTS, steer: pathlib.Path = STEER) -> dict:
    """{method: [(label, value, positivity change, ppl rise %, chosen on held-out prompts)]}: each
    control vector's chosen layer at +-s, and LM-Steer's whole strength curve. Runs not yet saved
    are left out."""
    out = {}
    for name, file in RUNS.items():
        path = results / file
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        ch = res["selection"]["chosen"]
        rows = []
        for v in (ch["strength"], -ch["strength"]):
            key = f"neutral_l{ch['layer']}_s{v:+g}"
            rows.append((f"{name} layer {ch['layer']}, {v:+g}", v, *change(res["metrics"], key), True))
        out[name] = rows
    if steer.exists():
        ref = json.loads(steer.read_text())
        picked = steer_choices(ref)
        keys = [k for k in ref["metrics"] if k.startswith("neutral_s")]
        out["LM-Steer"] = [
            (f"LM-Steer {v:+g} x eps0", v, *change(ref["metrics"], k), v in picked)
            for v, k in sorted((float(k.split("_s")[1]), k) for k in keys)
        ]
    return out


def table(pts: Optional[dict] = None) -> str:
    """Markdown: one row per point of :func:`points`; empty when nothing is saved."""
    pts = points() if pts is None else pts
    if not pts:
        return ""
    lines = [
        "| method | positivity change (points) | perplexity rise % | chosen on held-out prompts |",
        "|---|---|---|---|",
    ]
    for rows in pts.values():
        for label, _, dp, dr, chosen in rows:
            lines.append(f"| {label} | {dp:+.0f} | {dr:+.0f} | {'yes' if chosen else ''} |")
    return "\n".join(lines)


def plot(out_png: pathlib.Path, pts: Optional[dict] = None) -> Optional[pathlib.Path]:
    """Positivity change against perplexity rise, every method on one chart (points up to
    :data:`MAX_RISE`) -> the PNG written (None when nothing is saved). Draws with
    matplotlib.pyplot in the caller's backend."""
    import matplotlib.pyplot as plt

    pts = points() if pts is None else pts
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    style = {"LM-Steer": ("o-", "tab:blue"), "CAA": ("s", "tab:red"), "PCA": ("^", "tab:purple")}
    for name, rows in pts.items():
        marker, color = style.get(name, ("x", "tab:gray"))
        rows = [r for r in rows if r[3] <= MAX_RISE]
        ax.plot([r[3] for r in rows], [r[2] for r in rows], marker, color=color, label=name)
        for _, v, dp, dr, _ in rows:
            ax.annotate(f"{v:+g}", (dr, dp), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
    ax.axhline(0, color="black", lw=0.6)
    ax.axvline(30, ls=":", color="gray", label="30% perplexity limit")
    ax.set_xlabel("perplexity rise over the unsteered samples (%)")
    ax.set_ylabel("positivity change (points)")
    ax.set_title(f"SmolLM2-135M, 20 neutral prompts x 5 samples (rises > {MAX_RISE}% off the chart)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png = pathlib.Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(out_png.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
