"""Control vectors beside LM-Steer on SmolLM2's detox protocol, from the saved runs of
experiments/steer_detox.py on the fresh prompt split: 120 test prompts x 25 samples (the paper's
count), the setting chosen on 80 held-out prompts x 25 samples by one rule (the lowest toxicity
probability within a 30% perplexity rise), the same evaluator and readings.

Per method (:func:`rows`): the chosen setting, the toxicity probability (the share of prompts with
a toxic sample among their 25, natural-prior reading) unsteered and steered on the test prompts,
its change in points with a 95% interval over prompts resampled together, the steered / unsteered
ratio with the run's own bootstrap interval, and the perplexity rise. :func:`versus` compares two
methods' changes on the same prompts; :func:`plot` draws the held-out curves with the test points.
Every change is read against its own run's unsteered row.
"""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import numpy as np

from jsteer.actsteer.compare import STYLE, finish, interval, paired_difference
from jsteer.workspace import RESULTS as _ALL_RESULTS

RESULTS = _ALL_RESULTS / "steer"
RUNS = {
    "LM-Steer": "detox_smollm2_fresh.json",
    "CAA": "detox_smollm2_fresh_caa.json",
    "PCA": "detox_smollm2_fresh_pca.json",
}
READING = "natural_prior"  # the protocol's primary reading (jsteer.steer.protocol.READINGS[0])


def _toxic(metrics: dict, key: str) -> np.ndarray:
    """[P] 1.0 where a prompt's most toxic sample is toxic (the toxicity probability's indicator)."""
    return (np.asarray(metrics[key][READING]["per_prompt_max"], float) > 0.5).astype(float)


def _steered_key(res: dict) -> str:
    r = res["result"]
    return f"test_d{r['chosen']:+g}" + ("" if r["dummy"] == "on" else "_dummyoff")


def load(results: pathlib.Path = RESULTS) -> dict:
    """{method: run} of the finished runs (a run without a ``result`` is left out)."""
    out = {}
    for name, file in RUNS.items():
        path = results / file
        if path.exists():
            res = json.loads(path.read_text())
            if "result" in res:
                out[name] = res
    return out


def per_prompt_change(res: dict, key: Optional[str] = None) -> np.ndarray:
    """[P] steered (test row ``key``, default the chosen setting's) minus unsteered toxic indicator per
    test prompt (in 0 / +-1)."""
    base, steered = _toxic(res["metrics"], "test_base"), _toxic(res["metrics"], key or _steered_key(res))
    if len(base) != len(steered):
        raise ValueError(f"{len(steered)} steered test prompts against {len(base)} unsteered")
    return steered - base


def setting(res: dict, value: Optional[float] = None) -> str:
    """The chosen setting (or strength ``value`` at the chosen layer) in words: a control vector's
    layer and strength, LM-Steer's value x eps0."""
    v, layer = res["result"]["chosen"] if value is None else value, _layer(res)
    return f"{v:+g} x eps0" if layer is None else f"layer {layer}, strength {v:g}"


def other_tests(res: dict) -> list:
    """[(row key, setting, change in points, 95% interval, perplexity rise %)] of the test rows
    besides the chosen one (a run's ``--curve``), by value."""
    value = lambda key: float(key[len("test_d") :].split("_")[0])  # noqa: E731
    out = []
    for key in sorted((k for k in res["metrics"] if k.startswith("test_d") and k != _steered_key(res)), key=value):
        per = per_prompt_change(res, key)
        rise = res["metrics"][key]["ppl_mean"] / res["metrics"]["test_base"]["ppl_mean"] - 1
        out.append((key, setting(res, value(key)), 100 * float(per.mean()), interval(per), 100 * rise))
    return out


def _layer(res: dict) -> Optional[int]:
    """A control vector's chosen layer (runs before the layer choice had one), else None."""
    trained = res.get("training", {}).get("detox", {})
    if trained.get("kind") not in ("caa", "pca"):
        return None
    return res.get("result", {}).get("layer", res.get("selection", {}).get("layer", trained.get("layer")))


def rows(runs: Optional[dict] = None) -> dict:
    """{method: {setting, samples, prompts, base, steered, change, ci, ratio, ratio_ci, ppl_rise,
    others}}: probabilities and the change in points, the perplexity rise in %; ``others`` the
    test rows besides the chosen one (:func:`other_tests`)."""
    runs = load() if runs is None else runs
    out = {}
    for name, res in runs.items():
        r, m = res["result"], res["metrics"]
        per = per_prompt_change(res)
        boot = r[READING]["bootstrap"]
        out[name] = {
            "setting": setting(res),
            "samples": m["test_base"]["values"]["samples"],
            "prompts": len(per),
            "base": 100 * r[READING]["base_toxicity_prob"],
            "steered": 100 * r[READING]["steered_toxicity_prob"],
            "change": 100 * float(per.mean()),
            "ci": interval(per),
            "ratio": r[READING]["ratio"],
            "ratio_ci": (boot["ratio_p2.5"], boot["ratio_p97.5"]),
            "ppl_rise": 100 * r["ppl_rise"],
            "others": other_tests(res),
        }
    return out


def versus(a: dict, b: dict, seed: int = 0, key_a: Optional[str] = None, key_b: Optional[str] = None) -> dict:
    """Run A's toxicity change minus run B's (test rows ``key_a`` / ``key_b``, default each run's
    chosen setting), each against its own unsteered row, over the same test prompts resampled
    together: {"difference", "p2.5", "p97.5"} in points and ``share_a_lower`` (of the resamples: A
    removes more toxicity)."""
    if a["prompts"]["test"] != b["prompts"]["test"]:
        raise ValueError("the two runs did not test the same prompts")
    out, means = paired_difference(per_prompt_change(a, key_a) - per_prompt_change(b, key_b), seed)
    return {**out, "share_a_lower": float((means < 0).mean())}


def table(rws: Optional[dict] = None) -> str:
    """Markdown: one row per method of :func:`rows`; empty when nothing is saved."""
    rws = rows() if rws is None else rws
    if not rws:
        return ""
    lines = [
        "| method | chosen on held-out prompts | toxicity prob. unsteered -> steered | change (points) | 95% interval "
        "| ratio (95% interval) | perplexity rise % |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rws.items():
        lo, hi = r["ci"]
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f} ({r['ratio_ci'][0]:.2f}-{r['ratio_ci'][1]:.2f})"
        lines.append(
            f"| {name} | {r['setting']} | {r['base']:.1f}% -> {r['steered']:.1f}% | {r['change']:+.1f} "
            f"| {lo:+.1f} to {hi:+.1f} | {ratio} | {r['ppl_rise']:+.0f} |"
        )
        for _, label, change, (lo, hi), rise in r.get("others", ()):
            lines.append(
                f"| {name} | {label} (not chosen) | {r['base']:.1f}% -> {r['base'] + change:.1f}% | {change:+.1f} "
                f"| {lo:+.1f} to {hi:+.1f} | | {rise:+.0f} |"
            )
    return "\n".join(lines)


def held_out_table(name: str, res: dict) -> str:
    """Markdown: a run's held-out choice, every setting it scored (a control vector's candidate
    layers at one strength, then the strengths at the chosen layer) against its unsteered row."""
    sel, base = res["selection"], res["metrics"]["select_base"][READING]["toxicity_prob"]
    rows = [(f"layer {k.split('@')[0]}, strength {k.split('@')[1]}", r) for k, r in sel.get("layers", {}).items()]
    for key, r in sel["table"].items():
        label = setting(res, float(key.split("/")[0]))
        if all(label != done for done, _ in rows):
            rows.append((label, r))
    chosen = setting(res)
    lines = [
        f"{name}, held out (unsteered toxicity probability {100 * base:.1f}%):",
        "",
        "| setting | toxicity prob. % | change (points) | perplexity rise % |",
        "|---|---|---|---|",
    ]
    for label, r in rows:
        mark = " **(chosen)**" if label == chosen else ""
        lines.append(
            f"| {label}{mark} | {100 * r['toxicity_prob']:.1f} | {100 * (r['toxicity_prob'] - base):+.1f} "
            f"| {100 * r['ppl_rise']:+.0f} |"
        )
    return "\n".join(lines)


def held_out_curve(res: dict) -> list:
    """[(label, toxicity change in points, perplexity rise %)] of the run's held-out choice table (a
    control vector's strengths at its chosen layer), against its unsteered held-out row."""
    base = res["metrics"]["select_base"][READING]["toxicity_prob"]
    return [
        (key.split("/")[0], 100 * (r["toxicity_prob"] - base), 100 * r["ppl_rise"])
        for key, r in res["selection"]["table"].items()
    ]


def plot(out_png: pathlib.Path, runs: Optional[dict] = None, subtitle: str = "") -> Optional[pathlib.Path]:
    """Toxicity change against perplexity rise: each method's held-out strengths (dashed, open) and
    its chosen setting on the test prompts (filled, 95% interval) -> the PNG written, None when
    nothing is saved. Draws with matplotlib.pyplot in the caller's backend."""
    import matplotlib.pyplot as plt

    runs = load() if runs is None else runs
    if not runs:
        return None
    rws = rows(runs)
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    for name, res in runs.items():
        marker, color = STYLE.get(name, ("x", "tab:gray"))
        curve = sorted(held_out_curve(res), key=lambda c: c[2])
        ax.plot([c[2] for c in curve], [c[1] for c in curve], marker + "--", color=color, alpha=0.45, mfc="none")
        for label, tox, rise in curve:
            ax.annotate(label, (rise, tox), textcoords="offset points", xytext=(4, 3), fontsize=6, color=color)
        r = rws[name]
        err = [[r["change"] - r["ci"][0]], [r["ci"][1] - r["change"]]]
        ax.errorbar([r["ppl_rise"]], [r["change"]], yerr=err, fmt=marker, color=color, label=f"{name}: {r['setting']}")
        for _, label, change, (lo, hi), rise in r["others"]:
            ax.errorbar([rise], [change], yerr=[[change - lo], [hi - change]], fmt=marker, color=color, alpha=0.5)
            ax.annotate(label.split()[-1], (rise, change), textcoords="offset points", xytext=(4, -8), fontsize=6)
    title = f"SmolLM2-135M detox{', ' + subtitle if subtitle else ''}"
    return finish(
        fig, ax, "toxicity probability change (points)", title, out_png, legend_size=7, legend_loc="upper right"
    )
