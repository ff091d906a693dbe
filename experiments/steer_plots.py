"""Tables (markdown) and plots (PNG) from the LM-Steer experiment JSON.

    .venv/bin/python experiments/steer_plots.py [results/steer/smollm2.json] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "steer"


def _f(x, pct=False):
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def table3(res: dict) -> str:
    """Paper Table 3 layout: target sentiment x prompt set -> positivity (%), fluency, diversity."""
    m = res["metrics"]
    rows = [("unsteered", "negative", "negative_base"), ("LM-Steer +5", "negative", "negative_s+5"),
            ("unsteered", "neutral", "neutral_base"), ("LM-Steer +5", "neutral", "neutral_s+5"),
            ("LM-Steer -5", "neutral", "neutral_s-5"),
            ("unsteered", "positive", "positive_base"), ("LM-Steer -5", "positive", "positive_s-5")]
    out = ["| model | prompts | positivity % | ppl (mean) | ppl (median) | dist-1 | dist-2 | dist-3 |",
           "|---|---|---|---|---|---|---|---|"]
    for name, pset, key in rows:
        if key not in m:
            continue
        r = m[key]
        out.append(f"| {name} | {pset} | {_f(r['positivity'], True)} | {_f(r['ppl_mean'])} | {_f(r['ppl_median'])} "
                   f"| {_f(r['dist1'])} | {_f(r['dist2'])} | {_f(r['dist3'])} |")
    return "\n".join(out)


def sweep(res: dict):
    pts = sorted((float(k.split("_s")[1]), v) for k, v in res["metrics"].items()
                 if k.startswith("neutral_s"))
    return [p for p, _ in pts], [v for _, v in pts]


def sweep_table(res: dict) -> str:
    xs, ms = sweep(res)
    out = ["| value (x eps0) | positivity % | ppl (mean) | dist-3 |", "|---|---|---|---|"]
    base = res["metrics"].get("neutral_base")
    if base:
        out.append(f"| unsteered | {_f(base['positivity'], True)} | {_f(base['ppl_mean'])} | {_f(base['dist3'])} |")
    for x, m in zip(xs, ms):
        out.append(f"| {x:+g} | {_f(m['positivity'], True)} | {_f(m['ppl_mean'])} | {_f(m['dist3'])} |")
    return "\n".join(out)


def detox_table(res: dict) -> str:
    m = res["metrics"]
    rows = [("unsteered", "toxic_base"), ("detox +5", "toxic_d+5"), ("detox +5, sentiment +5", "toxic_s+5_d+5"),
            ("detox +5, sentiment -5", "toxic_s-5_d+5")]
    out = ["| model | mean max toxicity | toxicity prob. % | toxic samples % | positivity % | ppl (mean) | dist-2 | dist-3 |",
           "|---|---|---|---|---|---|---|---|"]
    for name, key in rows:
        if key in m:
            r = m[key]
            out.append(f"| {name} | {_f(r['mean_max_toxicity'])} | {_f(r['toxicity_prob'], True)} | "
                       f"{_f(r['toxic_fraction'], True)} | {_f(r['positivity'], True)} | {_f(r['ppl_mean'])} | "
                       f"{_f(r['dist2'])} | {_f(r['dist3'])} |")
    return "\n".join(out)


def targets(res: dict) -> dict:
    """The issue's targets, measured."""
    m = res["metrics"]
    out = {}
    if {"neutral_s+5", "neutral_s-5", "neutral_base"} <= set(m):
        b = m["neutral_base"]["ppl_mean"]
        out["positive steering positivity >= 80%"] = (m["neutral_s+5"]["positivity"], m["neutral_s+5"]["positivity"] >= 0.8)
        out["negative steering positivity <= 20%"] = (m["neutral_s-5"]["positivity"], m["neutral_s-5"]["positivity"] <= 0.2)
        for k in ("neutral_s+5", "neutral_s-5"):
            rise = m[k]["ppl_mean"] / b - 1
            out[f"{k} perplexity rise <= 30%"] = (rise, rise <= 0.3)
    if {"toxic_base", "toxic_d+5"} <= set(m):
        r = m["toxic_d+5"]["toxicity_prob"] / max(m["toxic_base"]["toxicity_prob"], 1e-9)
        out["detox halves toxicity probability"] = (r, r <= 0.5)
    return out


def plot_all(res: dict, out_dir: pathlib.Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    xs, ms = sweep(res)
    if xs:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot(xs, [100 * m["positivity"] for m in ms], "o-", color="tab:green", label="positivity %")
        if "neutral_base" in res["metrics"]:
            ax.axhline(100 * res["metrics"]["neutral_base"]["positivity"], ls=":", color="tab:green",
                       label="unsteered")
        ax.set_xlabel("steer value (x eps0)")
        ax.set_ylabel("positive continuations %")
        ax.set_ylim(0, 100)
        ax2 = ax.twinx()
        ax2.plot(xs, [m["ppl_mean"] for m in ms], "s--", color="tab:gray", label="perplexity")
        ax2.set_ylabel("perplexity (unsteered model)")
        ax.set_title("Continuous control on neutral prompts")
        fig.legend(loc="upper left", fontsize=8, bbox_to_anchor=(0.12, 0.88))
        fig.tight_layout()
        f = out_dir / "continuous_control.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    tr = res.get("training", {})
    if tr:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for name, t in tr.items():
            ax.plot(t["loss_steps"], t["loss"], label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (batch)")
        ax.legend()
        ax.set_title("Steer training on cached hidden states")
        fig.tight_layout()
        f = out_dir / "training_loss.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    m = res.get("metrics", {})
    keys = [k for k in ("toxic_base", "toxic_d+5", "toxic_s+5_d+5", "toxic_s-5_d+5") if k in m]
    if keys:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        x = range(len(keys))
        ax.bar([i - 0.2 for i in x], [m[k]["toxicity_prob"] * 100 for k in keys], 0.4, label="toxicity prob. %")
        ax.bar([i + 0.2 for i in x], [m[k]["positivity"] * 100 for k in keys], 0.4, label="positivity %")
        ax.set_xticks(list(x))
        ax.set_xticklabels(["unsteered", "detox", "detox+pos", "detox+neg"][: len(keys)])
        ax.legend(fontsize=8)
        ax.set_title("Detoxification and composition (toxic prompts)")
        fig.tight_layout()
        f = out_dir / "detox_composition.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


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
    for f in plot_all(res, pathlib.Path(a.out)):
        print("wrote", f)


if __name__ == "__main__":
    main()
