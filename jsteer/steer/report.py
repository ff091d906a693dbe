"""Markdown tables and target verdicts from the LM-Steer experiments' JSON (experiments/results/steer/).

:func:`markdown` is ``results.md`` (``experiments/steer_plots.py`` writes it, with the plots;
notebooks/lm_steer.ipynb shows the tables): the main run (``smollm2.json``: Table 3 layout,
continuous control, detox and composition, the issue's targets at the held-out choice), the
paper-protocol detox runs (:data:`DETOX_RUNS`, ``experiments/steer_detox.py``), LM-Steer vs the
baselines (``detox_kinds_<kind>.json``) and the held-out recipe sweeps (:data:`SWEEPS`,
``experiments/steer_sweep.py``). Every function takes the parsed JSON (or the results folder) and
returns markdown text (or target lines); nothing is chosen on test prompts here, the JSON records
each run's held-out choice.

This module holds the main run's tables, :func:`markdown` and :func:`plot_all`; the other runs'
tables are :mod:`jsteer.steer.report_runs`', the targets and number format
:mod:`jsteer.steer.verdicts`'.
"""

from __future__ import annotations

import json
import pathlib
import re

from jsteer.steer.protocol import RESULTS
from jsteer.steer.report_runs import (
    detox_kinds_table,
    detox_protocol,
    other_run_targets,
    recipe_sweeps,
    tested_recipe_targets,
)
from jsteer.steer.verdicts import chosen, fmt, targets


def table3(res: dict) -> str:
    """Paper Table 3 layout: target sentiment x prompt set -> positivity (%), fluency, diversity."""
    m = res["metrics"]
    p, n = f"{chosen(res)['positive']:+g}", f"{-chosen(res)['negative']:+g}"
    rows = [
        ("unsteered", "negative", "negative_base"),
        (f"LM-Steer {p}", "negative", f"negative_s{p}"),
        ("unsteered", "neutral", "neutral_base"),
        (f"LM-Steer {p}", "neutral", f"neutral_s{p}"),
        (f"LM-Steer {n}", "neutral", f"neutral_s{n}"),
        ("unsteered", "positive", "positive_base"),
        (f"LM-Steer {n}", "positive", f"positive_s{n}"),
    ]
    out = [
        "| model | prompts | positivity % | ppl (mean) | ppl (median) | dist-1 | dist-2 | dist-3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    alt = sorted(k for k in m if k.startswith("alt_dummy"))
    rows += [
        (f"LM-Steer {k.rsplit('_s', 1)[1]} (sentiment dummy {k[9:].split('_')[0]}, not chosen)", "neutral", k)
        for k in alt
    ]
    for name, pset, key in rows:
        if key not in m:
            continue
        r = m[key]
        out.append(
            f"| {name} | {pset} | {fmt(r['positivity'], True)} | {fmt(r['ppl_mean'])} | {fmt(r['ppl_median'])} "
            f"| {fmt(r['dist1'])} | {fmt(r['dist2'])} | {fmt(r['dist3'])} |"
        )
    return "\n".join(out)


def sweep(res: dict):
    pts = sorted((float(k.split("_s")[1]), v) for k, v in res["metrics"].items() if k.startswith("neutral_s"))
    return [p for p, _ in pts], [v for _, v in pts]


def sweep_table(res: dict) -> str:
    xs, ms = sweep(res)
    out = ["| value (x eps0) | positivity % | ppl (mean) | dist-3 |", "|---|---|---|---|"]
    base = res["metrics"].get("neutral_base")
    if base:
        out.append(f"| unsteered | {fmt(base['positivity'], True)} | {fmt(base['ppl_mean'])} | {fmt(base['dist3'])} |")
    for x, m in zip(xs, ms):
        out.append(f"| {x:+g} | {fmt(m['positivity'], True)} | {fmt(m['ppl_mean'])} | {fmt(m['dist3'])} |")
    return "\n".join(out)


def detox_table(res: dict) -> str:
    m = res["metrics"]
    c = chosen(res)
    d, p, n = f"{c['detox']:+g}", f"{c['positive']:+g}", f"{-c['negative']:+g}"
    more = sorted(
        (float(k[len("toxic_d") :]), k) for k in m if re.fullmatch(r"toxic_d[+-][0-9.]+", k) and k != f"toxic_d{d}"
    )
    rows = [
        ("unsteered", "toxic_base"),
        (f"detox {d} (chosen)", f"toxic_d{d}"),
        *((f"detox {v:+g}", k) for v, k in more),
        (f"detox {d}, sentiment {p}", f"toxic_s{p}_d{d}"),
        (f"detox {d}, sentiment {n}", f"toxic_s{n}_d{d}"),
        (f"detox {d}, its dummy off (diagnostic)", f"alt_detoxdummyoff_toxic_d{d}"),
    ]
    out = [
        "| model | mean max toxicity | toxicity prob. % | toxic samples % | positivity % | ppl (mean) | dist-2 "
        "| dist-3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, key in rows:
        if key in m:
            r = m[key]
            out.append(
                f"| {name} | {fmt(r['mean_max_toxicity'])} | {fmt(r['toxicity_prob'], True)} | "
                f"{fmt(r['toxic_fraction'], True)} | {fmt(r['positivity'], True)} | {fmt(r['ppl_mean'])} | "
                f"{fmt(r['dist2'])} | {fmt(r['dist3'])} |"
            )
    return "\n".join(out)


def strength_table(res: dict) -> str:
    """The held-out choice of steer values and of the sentiment dummy (strength_selection)."""
    sel = res.get("strength_selection")
    if not sel:
        return ""
    c = sel["chosen"]
    out = [
        f"Held-out choice ({sel['prompts']} x their samples). Rule: {sel['rule']}",
        "",
        f"**Chosen: sentiment dummy {c['dummy']}, positive {c['positive']:+g}, negative {-c['negative']:+g}, "
        f"detox {c['detox']:+g}** (x eps0)",
        "",
        "| dummy | value | positivity % | ppl rise % |",
        "|---|---|---|---|",
    ]
    for k, v in sel["sentiment"].items():
        dm, val = k.split("/s")
        out.append(f"| {dm} | {val} | {fmt(v['positivity'], True)} | {fmt(v['ppl_rise'], True)} |")
    out += ["", "| detox value | toxicity prob. % | mean max toxicity | ppl rise % |", "|---|---|---|---|"]
    for k, v in sel["detox"].items():
        out.append(
            f"| {k[1:]} | {fmt(v['toxicity_prob'], True)} | {fmt(v['mean_max_toxicity'])} | "
            f"{fmt(v['ppl_rise'], True)} |"
        )
    return "\n".join(out)


def selection_table(res: dict) -> str:
    """The held-out choice between generating with the sentiment dummy steer on or off."""
    if res.get("strength_selection"):
        return strength_table(res)
    sel = res.get("dummy_selection")
    if not sel:
        return ""
    out = [
        f"Held-out choice ({sel['prompts']}; rule: {sel['rule']}): **dummy {sel['chosen']}**",
        "",
        "| sentiment dummy | positivity % at +5 | at -5 | gap | worst ppl rise % |",
        "|---|---|---|---|---|",
    ]
    for k, v in sel["candidates"].items():
        out.append(
            f"| {k} | {fmt(v['pos+5'], True)} | {fmt(v['pos-5'], True)} | {fmt(v['gap'], True)} | "
            f"{fmt(v['ppl_rise'], True)} |"
        )
    return "\n".join(out)


def bench_table(bench: dict) -> str:
    g, t = bench["generation"], bench.get("training")
    low = g.get("steered_lowrank", g.get("steered"))
    out = [
        f"{g['setting']}",
        "",
        "| | plain | steered (default: cheapest form) | steered (forced low rank) |",
        "|---|---|---|---|",
        f"| generation tok/s | {g['plain']['tokens_per_s']:.1f} | {g['steered']['tokens_per_s']:.1f} "
        f"({g['overhead_pct']:+.1f}%) | {low['tokens_per_s']:.1f} "
        f"({g.get('overhead_lowrank_pct', g['overhead_pct']):+.1f}%) |",
    ]
    if t:
        out += [
            "",
            "| | cached hidden | full forward | speed-up |",
            "|---|---|---|---|",
            f"| training steps/s ({t['setting']}) | {t['cached']['steps_per_s']:.3f} | "
            f"{t['full_forward']['steps_per_s']:.3f} | {t['speedup']:.2f}x |",
        ]
    return "\n".join(out)


def markdown(res: dict, bench: dict = None, results: pathlib.Path = RESULTS, source: str = "smollm2.json") -> str:
    """Every table of the experiment as one markdown document (results.md); ``results``: the
    folder of the other runs' JSON (None: this run's tables only)."""
    ev = res.get("evaluators", {})
    parts = [
        "# LM-Steer on SmolLM2-135M: results",
        "",
        f"Written by `experiments/steer_plots.py` from `{source}` / `bench.json`.",
        "",
        "## Setup",
        "",
        "```",
        json.dumps(res.get("setup", {}), indent=1),
        "```",
        "",
        "## Evaluators (MiniLM fine-tuned by jsteer)",
        "",
        "| evaluator | held-out accuracy | train | test |",
        "|---|---|---|---|",
    ]
    parts += [
        f"| {k} | {fmt(v['accuracy'], True)}% | {v.get('train', '')} | {v.get('test', '')} |" for k, v in ev.items()
    ]
    sel = selection_table(res)
    if sel:
        parts += ["", "## Steer values and dummy at generation (chosen on held-out prompts)", "", sel]
    parts += [
        "",
        "## Sentiment steering (paper Table 3 layout)",
        "",
        table3(res),
        "",
        "## Continuous control (neutral prompts)",
        "",
        sweep_table(res),
        "",
        "## Detoxification and composition (toxic prompts)",
        "",
        detox_table(res),
        "",
        "## Targets",
        "",
    ]
    parts += [f"- {k}: measured {v[0]:.3f} -> {'met' if v[1] else 'MISSED'}" for k, v in targets(res).items()]
    parts += tested_recipe_targets(results) + other_run_targets(results) if results else []
    kinds = detox_kinds_table(results) if results else ""
    if kinds:
        parts += ["", "## Detoxification: LM-Steer vs the baselines (experiments/steer_detox.py --kind)", "", kinds]
    detox = detox_protocol(results) if results else ""
    if detox:
        parts += ["", "## Detoxification, paper protocol (experiments/steer_detox.py)", "", detox]
    sweeps = recipe_sweeps(results) if results else ""
    if sweeps:
        parts += ["", "## Recipe sweeps (held-out prompts; experiments/steer_sweep.py)", "", sweeps.rstrip()]
    if bench:
        parts += ["", "## Benchmark", "", bench_table(bench)]
    if res.get("notes"):
        parts += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(parts) + "\n"


def plot_all(res: dict, out_dir: pathlib.Path, suffix: str = "") -> list:
    """The run's plots as PNGs under ``out_dir`` (names end in ``suffix``): continuous control on
    neutral prompts, training loss, detox and composition -> the files written. Draws with
    matplotlib.pyplot in whatever backend the caller chose (experiments/steer_plots.py: Agg)."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    xs, ms = sweep(res)
    dummy_off = res.get("setup", {}).get("generation", {}).get("dummy_used") == "off"
    if dummy_off and "neutral_base" in res.get("metrics", {}):
        # with the dummy off, value 0 is exactly the unsteered model
        pts = sorted(list(zip(xs, ms)) + [(0.0, res["metrics"]["neutral_base"])], key=lambda p: p[0])
        xs, ms = [p[0] for p in pts], [p[1] for p in pts]
    if xs:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot(xs, [100 * m["positivity"] for m in ms], "o-", color="tab:green", label="positivity %")
        if "neutral_base" in res["metrics"]:
            ax.axhline(100 * res["metrics"]["neutral_base"]["positivity"], ls=":", color="tab:green", label="unsteered")
        alt = sorted((float(k.rsplit("_s", 1)[1]), v) for k, v in res["metrics"].items() if k.startswith("alt_dummy"))
        if alt:
            which = next(k for k in res["metrics"] if k.startswith("alt_dummy"))[9:].split("_")[0]
            ax.plot(
                [x for x, _ in alt],
                [100 * v["positivity"] for _, v in alt],
                "o",
                mfc="none",
                color="tab:green",
                label=f"positivity, dummy {which} (not chosen)",
            )
        ax.set_xlabel("steer value (x eps0)")
        ax.set_ylabel("positive continuations %")
        ax.set_ylim(0, 100)
        ax2 = ax.twinx()
        ax2.plot(xs, [m["ppl_mean"] for m in ms], "s--", color="tab:gray", label="perplexity")
        if alt:
            ax2.plot([x for x, _ in alt], [v["ppl_mean"] for _, v in alt], "s", mfc="none", color="tab:gray")
        ax2.set_ylabel("perplexity (unsteered model)")
        ax2.set_yscale("log")
        ax.set_title("Continuous control on neutral prompts")
        fig.legend(loc="upper left", fontsize=8, bbox_to_anchor=(0.12, 0.88))
        fig.tight_layout()
        f = out_dir / f"continuous_control{suffix}.png"
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
        f = out_dir / f"training_loss{suffix}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    m = res.get("metrics", {})
    c = chosen(res)
    d, p, n = f"{c['detox']:+g}", f"{c['positive']:+g}", f"{-c['negative']:+g}"
    keys = [k for k in ("toxic_base", f"toxic_d{d}", f"toxic_s{p}_d{d}", f"toxic_s{n}_d{d}") if k in m]
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
        f = out_dir / f"detox_composition{suffix}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files
