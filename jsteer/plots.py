"""PNG charts for the CLI's ``--png`` / ``--chart`` options: a steer's SVD directions (``jsteer
steer explain``), the nearest tokens of type vectors (``jsteer typevec neighbours``) and per-type
F1 (``jsteer kala eval``). Matplotlib's Agg canvas (no display needed, no pyplot state), imported only
when a chart is drawn; every file is written atomically (a temporary file in the same folder,
then renamed), so a failed or interrupted draw never leaves a partial PNG.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Mapping, Optional, Sequence


def figure(**kw):
    """A matplotlib ``Figure`` drawn by the Agg canvas: no pyplot, so no global backend is set
    or changed (a notebook's stays as it was)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path) -> pathlib.Path:
    """Write ``fig`` as a PNG to ``path`` atomically (temp file + rename)."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not a PNG file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _barh(ax, labels: Sequence[str], values: Sequence[float], color: str, title: str) -> None:
    y = list(range(len(labels)))[::-1]  # first item on top
    ax.barh(y, list(values), color=color)
    ax.set_yticks(y)
    ax.set_yticklabels([repr(x)[1:-1] if isinstance(x, str) else str(x) for x in labels], fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.axvline(0, color="black", linewidth=0.5)


def explain_chart(directions: Sequence[Mapping], path, title: Optional[str] = None) -> pathlib.Path:
    """One row per direction of :func:`jsteer.steer.interpret.explain`'s result: the tokens it
    promotes ("+", scores) and demotes ("-") as horizontal bars."""
    if not directions:
        raise ValueError("explain chart: no directions to draw")
    n = len(directions)
    rows = max(len(d["top"]) for d in directions)
    fig = figure(figsize=(8, max(2.0, 0.25 * rows + 1.0) * n))
    axes = fig.subplots(n, 2, squeeze=False)
    for (ax_top, ax_bot), d in zip(axes, directions):
        head = f"direction {d['index']} (s={d['singular_value']:.3g})"
        _barh(ax_top, [t for t, _ in d["top"]], [v for _, v in d["top"]], "tab:green", f"{head}: +")
        _barh(ax_bot, [t for t, _ in d["bottom"]], [v for _, v in d["bottom"]], "tab:red", f"{head}: -")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def neighbours_chart(rows: Mapping[str, Sequence[Mapping]], path, title: Optional[str] = None) -> pathlib.Path:
    """One panel per type vector: its nearest tokens by cosine (``rows``: {name: [{"token",
    "cos"}, ...]}, as ``jsteer typevec neighbours --json`` prints)."""
    if not rows:
        raise ValueError("neighbours chart: no type vectors to draw")
    k = max(len(r) for r in rows.values())
    fig = figure(figsize=(6, max(2.0, 0.25 * k + 1.0) * len(rows)))
    axes = fig.subplots(len(rows), 1, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], rows.items()):
        _barh(ax, [x["token"] for x in r], [x["cos"] for x in r], "tab:blue", f"{name}: nearest tokens")
        ax.set_xlabel("cosine", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def scores_chart(scores: Mapping[str, float], path, title: str = "", xlabel: str = "F1 (%)") -> pathlib.Path:
    """Horizontal bars of {name: score} (e.g. per-type F1), each labelled with its value."""
    if not scores:
        raise ValueError("scores chart: nothing to draw")
    names = list(scores)
    vals = [float(scores[n]) for n in names]
    fig = figure(figsize=(6, max(2.0, 0.35 * len(names) + 1.0)))
    ax = fig.subplots()
    _barh(ax, names, vals, "tab:purple", title)
    for y, v in zip(range(len(names))[::-1], vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_xlim(0, max(100.0, max(vals) * 1.1))
    fig.tight_layout()
    return save_figure(fig, path)
