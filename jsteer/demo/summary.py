"""The demo's summary page: ``summary.png`` (matplotlib, Agg) and ``summary.html`` embedding it
(as a data URI: the page is one self-contained file)."""

from __future__ import annotations

import base64
import html
import pathlib


def _steer_curve(card: dict):
    """(values, positivity, ppl rise) of the committed evaluation, the unsteered model at 0."""
    table = {float(v): r for v, r in card["table"].items()}
    table[0.0] = {"positivity": card["unsteered"]["positivity"], "ppl_rise": 0.0}
    vs = sorted(table)
    return vs, [table[v]["positivity"] for v in vs], [table[v]["ppl_rise"] for v in vs]


def write_png(path, steer: dict, typevec: dict, kala: dict | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 3 if kala else 2
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.2))
    ax = axes[0]
    vs, pos, rise = _steer_curve(steer["committed"])
    ax.plot(vs, pos, "o-", color="tab:green", label="positivity")
    ax.set_xlabel("steer value (x eps0)")
    ax.set_ylabel("share of positive continuations")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(vs, rise, "s--", color="tab:gray", alpha=0.7, label="perplexity rise")
    ax2.set_ylabel("perplexity rise vs unsteered", color="tab:gray")
    ax.set_title(f"LM-Steer rank {steer['rank']} (committed results)", fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", fontsize=8)
    ax.text(0.02, -0.2, steer["committed"]["source"].split(" ")[0], transform=ax.transAxes, fontsize=6)

    ax = axes[1]
    labels = [p.replace(" was born in", "...") for p in typevec["prompts"]]
    x = range(len(labels))
    before = [r["city_mass"] for r in typevec["before"]]
    after = [r["city_mass"] for r in typevec["after"]]
    for off, vals, name in ((-0.2, before, "without type vector"), (0.2, after, "with City type vector")):
        ax.bar_label(ax.bar([i + off for i in x], vals, 0.4, label=name), fmt="%.2f", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("P(next token is a city)")
    ax.set_ylim(0, 1)
    ax.set_title("Type Embeddings: '... was born in' (measured now)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)

    if kala:
        ax = axes[2]
        splits = ("seen", "unseen")
        for j, (m, name) in enumerate((("finetune", "plain fine-tuning"), ("relational", "KALA"))):
            bars = ax.bar([i + (j - 0.5) * 0.4 for i in range(2)], [kala["f1"][m][s] for s in splits], 0.4, label=name)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks([0, 1], ["seen entities", "unseen entities"])
        ax.set_ylabel("entity F1")
        ax.set_ylim(0, 119)
        ax.set_title("KALA: synthetic NER (measured now)", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_html(path, png, lines: list[str], timings: dict) -> pathlib.Path:
    """The page: ``png`` (a path) inline, the section times and the demo's printed lines."""
    path = pathlib.Path(path)
    data = base64.b64encode(pathlib.Path(png).read_bytes()).decode("ascii")
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.1f} s</td></tr>" for k, v in timings.items())
    body = html.escape("\n".join(lines))
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>jsteer demo</title></head><body>"
        "<h1>jsteer demo</h1>"
        f"<img src='data:image/png;base64,{data}' alt='{html.escape(pathlib.Path(png).name)}' style='max-width:100%'>"
        f"<h2>Section times</h2><table>{rows}</table>"
        f"<h2>Output</h2><pre>{body}</pre></body></html>\n"
    )
    return path
