"""Tables and plots of the Type Embeddings analyses (``experiments/typevec_analysis.py``'s
``analysis.json``: paper Table 1, Figure 3, Table 2, Figures 4-5, Table 9).

The script runs the analyses (:mod:`jsteer.typevec.analysis`) and writes ``analysis.md`` and the
plots with :func:`markdown` / :func:`plots`; notebooks/type_embeddings.ipynb shows the same.
:data:`OUT` (``$JSTEER_OUT`` or ``experiments/results/typevec``) is where the plots go by default.
"""

from __future__ import annotations

import os
import pathlib

from jsteer.workspace import ROOT

OUT = pathlib.Path(os.environ.get("JSTEER_OUT", ROOT / "experiments" / "results" / "typevec"))


def plots(res: dict, prefix: str = "", out: pathlib.Path | None = None) -> None:
    """``<prefix>kurtosis.png`` (Figure 3) and ``<prefix>layers.png`` (Figures 4-5) of the parts
    ``res`` has, in ``out`` (default :data:`OUT`, read when called)."""
    out = pathlib.Path(out) if out is not None else OUT
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "kurtosis" in res:
        ks = res["kurtosis"]
        fig, axes = plt.subplots(1, len(ks), figsize=(4 * len(ks), 3.2), squeeze=False)
        for ax, (t, r) in zip(axes[0], ks.items()):
            comps = [c for c in r if c != "singular_values_mean"]
            for c in comps:
                ax.hist(r[c]["values_raw"], bins=40, alpha=0.5, label=f"v{int(c) + 1}: k={r[c]['kurtosis_raw']:.1f}")
            ax.set_title(f"MiniLM {t}: mean entry of v_i over runs")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{prefix}kurtosis.png", dpi=100)
        plt.close(fig)
    if "layers" in res:
        r = res["layers"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label in ("without_TE", "with_TE"):
            ax.plot(r[label]["f1"], marker="o", ms=3, label=label.replace("_", " "))
        ax.set_xlabel("layer (0 = embeddings)")
        ax.set_ylabel("F1, City vs other types")
        ax.set_ylim(0, 1.02)
        ax.legend()
        ax.set_title("SmolLM2 layer-wise linear probes")
        fig.tight_layout()
        fig.savefig(out / f"{prefix}layers.png", dpi=100)
        plt.close(fig)


def markdown(res: dict) -> str:
    """The tables (paper Tables 1, 2, 9, Figures 3-5) of the parts ``res`` has, as markdown."""
    lines = ["# Type-embedding analyses", ""]
    if "retrieval" in res:
        lines += ["## Table 1: nearest tokens to TE (cosine)", ""]
        for model, rows in res["retrieval"].items():
            lines += [f"### {model}", "", "| type | top-20 in KG list | nearest tokens |", "|---|---:|---|"]
            for t, r in rows.items():
                if "error" in r:
                    lines.append(f"| {t} | - | {r['error']} |")
                else:
                    lines.append(f"| {t} | {r['top20_in_kg_list']:.2f} | {', '.join(r['neighbours'])} |")
            lines.append("")
    if "kurtosis" in res:
        comps = [c for c in next(iter(res["kurtosis"].values())) if c != "singular_values_mean"]
        lines += [
            "## Figure 3: singular vectors over random 10-example sets (MiniLM)",
            "",
            "Excess kurtosis over runs of the mean entry of v_i, with raw LAPACK signs / oriented by our "
            "sign convention, and stability (mean |cos| between runs' oriented v_i and the first run's):",
            "",
            "| type | "
            + " | ".join(f"v{int(c) + 1} kurtosis raw / oriented | v{int(c) + 1} stability" for c in comps)
            + " |",
            "|---|" + "---:|---:|" * len(comps),
        ]
        for t, r in res["kurtosis"].items():
            lines.append(
                f"| {t} | "
                + " | ".join(
                    f"{r[c]['kurtosis_raw']:.2f} / {r[c]['kurtosis_oriented']:.2f} | {r[c]['stability']:.3f}"
                    for c in comps
                )
                + " |"
            )
        lines.append("")
    if "aa" in res:
        lines += [
            "## Table 2: adversarial accuracy / sensitivity (SmolLM2, mean +- std over repeats)",
            "",
            "| type | lambda | AA (TE) | AS (TE) | AA (random) | AS (random) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for t, byl in res["aa"].items():
            for lam, r in byl.items():
                lines.append(
                    f"| {t} | {lam} | {r['TE']['AA']['mean']:.3f} +- {r['TE']['AA']['std']:.3f} | "
                    f"{r['TE']['AS']['mean']:.3f} +- {r['TE']['AS']['std']:.3f} | "
                    f"{r['random']['AA']['mean']:.3f} +- {r['random']['AA']['std']:.3f} | "
                    f"{r['random']['AS']['mean']:.3f} +- {r['random']['AS']['std']:.3f} |"
                )
        lines.append("")
    if "layers" in res:
        r = res["layers"]
        lines += [
            f"## Figures 4-5: layer-wise probes ({r['target']} vs other types, lambda {r['lambda']}, "
            f"{r['n_per_class']} prompts per class)",
            "",
            "| layer | F1 without TE | F1 with TE |",
            "|---:|---:|---:|",
        ]
        for i, (a, b) in enumerate(zip(r["without_TE"]["f1"], r["with_TE"]["f1"])):
            lines.append(f"| {i} | {a:.3f} | {b:.3f} |")
        lines += [
            "",
            "TCAV (share of City prompts whose City log-probability rises along the layer's CAV):",
            "",
            "| layer | without TE | with TE |",
            "|---:|---:|---:|",
        ]
        for k in r["tcav"]["without_TE"]:
            lines.append(f"| {k} | {r['tcav']['without_TE'][k]:.3f} | {r['tcav']['with_TE'][k]:.3f} |")
        lines.append("")
    if "toxic" in res:
        r = res["toxic"]
        lines += [
            "## Table 9: toxic concept vector in generation (SmolLM2, every token)",
            "",
            f"Concept words: {', '.join(r['concept_words'])}; evaluator: {r['evaluator']}",
            "",
            "| lambda | mean max toxicity | toxicity prob | ppl (median) | dist-2 |",
            "|---:|---:|---:|---:|---:|",
        ]
        for lam, row in r["rows"].items():
            lines.append(
                f"| {lam} | {row['mean_max_toxicity']:.3f} | {row['toxicity_prob']:.3f} | "
                f"{row['ppl_median']:.1f} | {row['dist2']:.3f} |"
            )
    return "\n".join(lines) + "\n"
