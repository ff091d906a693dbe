"""Markdown tables and verdicts from the KALA experiments' JSON (experiments/results/kala/).

:func:`report` renders ``results.md`` (``experiments/kala_report.py`` writes it; notebooks/kala.ipynb
shows it) from the sweeps of ``experiments/kala_ner.py`` (``ner_<dataset>[_full|_dev].json``), the
timing runs (``walltime*.json``, ``step_overhead.json``), the lexicon scores
(``lexicon_quality_<dataset>.json``), ``bench.md`` and ``notes.md``. Scores are entity-level F1 (%),
mean +- std over seeds (sample std over n >= 2 seeds); F1 targets are judged on paired per-seed
gains over fine-tuning, time targets on runs of the same seeds (:func:`same_seeds`) whose timing
was not perturbed (:func:`jsteer.kala.protocol.timed`).
"""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Optional

from jsteer.kala.protocol import OUT as RESULTS
from jsteer.kala.protocol import protocol_setting, timed

DATASETS = {"conll": "CoNLL-2003", "ncbi": "NCBI-Disease"}
MAIN = [
    ("finetune", "Fine-tuning"),
    ("more_params", "+ more params (1 layer)"),
    ("pointwise", "KALA point-wise"),
    ("relational", "KALA relational"),
]
ABLATION = [
    ("relational_gamma_only", "gamma only"),
    ("relational_beta_only", "beta only"),
    ("relational", "gamma + beta"),
]
EDROP = [
    ("relational_edrop", "KALA relational + entity dropout 0.3"),
    ("pointwise_edrop", "KALA point-wise + entity dropout 0.3"),
]
LAYERS = [
    ("relational_L1", "layer 1"),
    ("relational_L5", "layer 5"),
    ("relational", "layers 3, 5 (default)"),
    ("relational_L135", "layers 1, 3, 5"),
]


def load(results: pathlib.Path = RESULTS, suffix: str = "") -> dict:
    """{dataset: sweep JSON} of ``ner_<dataset><suffix>.json`` (``"_full"``: the whole-data runs)."""
    out = {}
    for ds in DATASETS:
        p = results / f"ner_{ds}{suffix}.json"
        if p.is_file():
            out[ds] = json.loads(p.read_text())
    return out


def runs_of(res: dict, variant: str) -> list[dict]:
    return [r for r in res.get("runs", []) if r["variant"] == variant]


def mean_std(xs: list[float]) -> tuple[Optional[float], Optional[float]]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def fmt(xs: list[float], digits: int = 2) -> str:
    m, s = mean_std(xs)
    if m is None:
        return "-"
    n = len([x for x in xs if x is not None])
    return f"{m:.{digits}f}" + (f" +- {s:.{digits}f}" if s is not None else "") + f" (n={n})"


def table(all_res: dict, variants, metric: str = "f1", title: str = "") -> str:
    head = "| method | " + " | ".join(DATASETS[d] for d in all_res) + " |"
    lines = [title, "", head, "|---" * (len(all_res) + 1) + "|"] if title else [head, "|---" * (len(all_res) + 1) + "|"]
    for v, name in variants:
        cells = [fmt([r.get(metric) for r in runs_of(all_res[d], v)]) for d in all_res]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(res: dict, a: str, b: str, key: str = "f1") -> list[float]:
    """Per-seed differences b - a over the seeds both variants ran."""
    ra = {r["seed"]: r.get(key) for r in runs_of(res, a)}
    rb = {r["seed"]: r.get(key) for r in runs_of(res, b)}
    return [rb[s] - ra[s] for s in sorted(set(ra) & set(rb)) if ra[s] is not None and rb[s] is not None]


def same_seeds(res: dict, base: str, variant: str) -> list[dict]:
    """``base``'s runs of the seeds ``variant`` ran: time comparisons pair runs of one seed, which
    the seed-major sweeps ran close together, under like load (extra seeds of one variant, run
    on another day, would otherwise move the other's ratio)."""
    seeds = {r["seed"] for r in runs_of(res, variant)}
    return [r for r in runs_of(res, base) if r["seed"] in seeds]


F1_TARGET = {"conll": 0.4, "ncbi": 1.0}
TIME_TARGET = 0.15  # relational train wall time within 15% of fine-tuning


def f1_target_line(d: str, res: dict, variant: str, name: str) -> str:
    """``variant``'s F1 gain over fine-tuning on dataset ``d`` against the issue's target (mean
    over seeds, paired per-seed differences); "" when no seed has both."""
    diffs = paired(res, "finetune", variant)
    if not diffs:
        return ""
    m, s = mean_std(diffs)
    target = F1_TARGET[d]
    sd = f" +- {s:.2f}" if s is not None else ""
    per = ", ".join(f"{x:+.2f}" for x in diffs)
    return (
        f"{DATASETS[d]} F1: {name} - fine-tuning = {m:+.2f}{sd} (per seed {per}; n={len(diffs)}); "
        f"target >= +{target}: **{'met' if m >= target else 'missed'}**"
        + ("" if len(diffs) >= 3 else " (fewer than 3 seeds: not meaningful)")
        + ("; the gain is within one seed std of zero" if s is not None and abs(m) < s else "")
    )


def target_lines(all_res: dict) -> str:
    """The issue's targets, each met / missed with the numbers: F1 gain of relational KALA (and
    of its entity-dropout variant) over fine-tuning, and train-time overhead."""
    out = []
    for d, res in all_res.items():
        lines = [
            f1_target_line(d, res, "relational_edrop", "relational + entity dropout"),
            f1_target_line(d, res, "relational", "relational"),
        ]
        out += [x for x in lines if x]
        if not lines[1]:
            continue
        t = [r for r in paired(res, "finetune", "relational", "train_seconds")]
        ft_runs = timed(same_seeds(res, "finetune", "relational"))
        ft = mean_std([r["train_seconds"] for r in ft_runs])[0]
        rel = mean_std([r["train_seconds"] for r in timed(runs_of(res, "relational"))])[0]
        st_ft = mean_std([r.get("median_step_seconds") for r in ft_runs])[0]
        st_rel = mean_std([r.get("median_step_seconds") for r in timed(runs_of(res, "relational"))])[0]
        if ft and rel and t:
            ratio = rel / ft
            step = f"; median step {st_rel:.2f} s vs {st_ft:.2f} s = {st_rel / st_ft:.2f}x" if st_ft and st_rel else ""

            def ok(r):
                return "met" if r <= 1 + TIME_TARGET else "missed"

            verdict = f"target <= {1 + TIME_TARGET:.2f}x: by train wall **{ok(ratio)}**"
            if st_ft and st_rel:
                verdict += f", by median step **{ok(st_rel / st_ft)}**"
            out.append(
                f"{DATASETS[d]} train wall time (steps 2..N, recompiles for new batch / graph shapes "
                f"included): relational {rel:.0f} s vs fine-tuning {ft:.0f} s = {ratio:.2f}x{step}; {verdict} "
                f"(shared CPU, load varied during the sweep: noisy)"
            )
    return "\n".join(f"- {x}" for x in out)


def seed_table(all_res: dict, variants=MAIN) -> str:
    """Every run: F1 (seen / unseen), train seconds, steps, final loss."""
    lines = [
        "| dataset | method | seed | F1 | seen F1 | unseen F1 | train s | steps | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for d, res in all_res.items():
        for v, name in variants:
            for r in sorted(runs_of(res, v), key=lambda r: r["seed"]):
                lines.append(
                    f"| {DATASETS[d]} | {name} | {r['seed']} | {f(r.get('f1'))} | {f(r.get('f1_seen'))} | "
                    f"{f(r.get('f1_unseen'))} | {r['train_seconds']:.0f} | {r['steps']} | "
                    f"{r['final_loss']:.3f} |"
                )
    return "\n".join(lines)


def cost_table(all_res: dict) -> str:
    lines = [
        "| dataset | method | median step (s) | vs fine-tuning | train wall (s) | step memory (MiB) | params (M) |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, res in all_res.items():
        for v, name in MAIN:
            rs = timed(runs_of(res, v))
            if not rs:
                continue
            base = mean_std([r.get("median_step_seconds") for r in timed(same_seeds(res, "finetune", v))])[0]
            step = mean_std([r.get("median_step_seconds") for r in rs])[0]
            wall = mean_std([r["train_seconds"] for r in rs])[0]
            mem = [r["step_memory_bytes"] for r in rs if r.get("step_memory_bytes")] or [
                m for m in [res.get("step_memory", {}).get(v)] if m
            ]
            ratio = f"{step / base:.2f}x" if (base and step) else "-"
            lines.append(
                f"| {DATASETS[d]} | {name} | {step:.2f} | {ratio} | {wall:.0f} | "
                + (f"{mem[0] / 2**20:.0f}" if mem else "-")
                + f" | {rs[0]['params'] / 1e6:.2f} |"
                if step
                else f"| {DATASETS[d]} | {name} | - | - | {wall:.0f} | - | {rs[0]['params'] / 1e6:.2f} |"
            )
    return "\n".join(lines)


def timing_sweep_lines(results: pathlib.Path = RESULTS) -> str:
    """Fine-tuning vs relational KALA (+ entity dropout) run back to back, alone on the machine,
    with the smaller graph buckets (``ner_conll_edrop.json``): per-seed train wall and median step."""
    path = results / "ner_conll_edrop.json"
    if not path.is_file():
        return ""
    res = json.loads(path.read_text())
    lines = [
        "| seed | fine-tuning wall (s) | relational wall (s) | wall ratio | fine-tuning step (s) | "
        "relational step (s) | step ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed in sorted({r["seed"] for r in res["runs"]}):
        ft = [r for r in timed(runs_of(res, "finetune")) if r["seed"] == seed]
        rel = [r for r in timed(runs_of(res, "relational_edrop")) if r["seed"] == seed]
        if ft and rel:
            a, b = ft[0], rel[0]
            sa, sb = a["median_step_seconds"], b["median_step_seconds"]
            lines.append(
                f"| {seed} | {a['train_seconds']:.0f} | {b['train_seconds']:.0f} | "
                f"{b['train_seconds'] / a['train_seconds']:.2f}x | {sa:.3f} | {sb:.3f} | {sb / sa:.2f}x |"
            )
    return "\n".join(lines)


def walltime_lines(results: pathlib.Path = RESULTS, name: str = "walltime.json") -> str:
    """The clean wall-time comparison of ``name`` (experiments/kala_walltime.py): per dataset and
    cache state, each seed's fit wall and median step of fine-tuning and KALA, their ratios, and
    the issue's <= 1.15x verdict on the median ratio."""
    path = results / name
    if not path.is_file():
        return ""
    res = json.loads(path.read_text())
    lines = [
        "| dataset | compilation cache | seed | fine-tuning fit (s) | KALA fit (s) | fit ratio | "
        "fine-tuning step (s) | KALA step (s) | step ratio | batch shapes (FT / KALA) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    by = {(r["dataset"], r["variant"], r["seed"], r["cache"]): r for r in res["runs"]}
    for ds, per_variant in res.get("summary", {}).items():
        for v, per_cache in per_variant.items():
            for cache in ("cold", "warm"):
                summ = per_cache.get(cache)
                if not summ:
                    continue
                for seed in summ["seeds"]:
                    a, b = by[ds, "finetune", seed, cache], by[ds, v, seed, cache]
                    lines.append(
                        f"| {DATASETS[ds]} | {cache} | {seed} | {a['fit_seconds']:.0f} | "
                        f"{b['fit_seconds']:.0f} | "
                        f"{b['fit_seconds'] / a['fit_seconds']:.2f}x | {a['median_step_seconds']:.3f} | "
                        f"{b['median_step_seconds']:.3f} | "
                        f"{b['median_step_seconds'] / a['median_step_seconds']:.2f}x | "
                        f"{a['shapes']} / {b['shapes']} |"
                    )
                fit = summ["fit_seconds_ratio"]["median"]
                verdicts.append(
                    f"{DATASETS[ds]}, {cache} cache ({v}, {len(summ['seeds'])} seeds): fit wall "
                    f"{fit:.2f}x, median step {summ['median_step_seconds_ratio']['median']:.2f}x "
                    f"(median over seeds); target <= {1 + TIME_TARGET:.2f}x: "
                    f"**{'met' if fit <= 1 + TIME_TARGET else 'missed'}**"
                )
    return "\n".join(lines + [""] + [f"- {x}" for x in verdicts])


def step_overhead_lines(results: pathlib.Path = RESULTS) -> str:
    """experiments/kala_step_overhead.py's interleaved train-step times: per backbone and length
    bucket, each method's median step and its ratio to fine-tuning's."""
    path = results / "step_overhead.json"
    if not path.is_file():
        return ""
    res = json.loads(path.read_text())
    names = {"finetune": "fine-tuning", "pointwise": "point-wise", "relational_edrop": "relational + edrop"}
    lines = [
        "| backbone | T | " + " | ".join(f"{n} step (ms)" for n in names.values()) + " | trainable params "
        "(FT / relational) |",
        "|---|---|" + "---|" * len(names) + "---|",
    ]
    for backbone, r in res["backbones"].items():
        for t, per in r["steps"].items():
            cells = [
                f"{per[v]['median_step_seconds'] * 1e3:.0f}"
                + ("" if v == "finetune" else f" ({per[v]['ratio_to_finetune']:.3f}x)")
                for v in names
                if v in per
            ]
            pr = r["params"]
            lines.append(
                f"| {backbone} | {t} | "
                + " | ".join(cells)
                + f" | {pr['finetune'] / 1e6:.1f}M / {pr['relational_edrop'] / 1e6:.1f}M |"
            )
    return "\n".join(lines)


def setup_lines(all_res: dict, sizes: str = "seeded random subsets") -> str:
    out = []
    for d, res in all_res.items():
        s = res.get("setup", {})
        out.append(
            f"- {DATASETS[d]}: {s.get('train_size')} training / {s.get('test_size')} test sentences "
            f"({sizes}), {s.get('epochs')} epoch(s), batch {s.get('batch_size')}, max length "
            f"{s.get('max_len')} subwords (length-bucketed), AdamW lr {s.get('lr')} (backbone + head), KALA lr "
            f"{s.get('kala_lr')}, {s.get('schedule', 'linear warmup + decay')} (warmup "
            f"{s.get('warmup_ratio', 0.1)}), clip 1.0, weight decay 0.01; graph lexicon "
            f"{protocol_setting(s, 'graph_strategy')}, entity vocabulary {s.get('entity_vocab')} "
            f"(+ null), {s.get('relations')} relations, {s.get('mean_nodes', 0):.1f} nodes / "
            f"{s.get('mean_edges', 0):.1f} edges per training graph; test contexts seen "
            f"{s.get('n_seen_contexts')}, unseen (>= {s.get('unseen_min')} unseen entities) "
            f"{s.get('n_unseen_contexts')}."
        )
    return "\n".join(out)


def edrop_rate_lines(all_res: dict, results: pathlib.Path = RESULTS) -> str:
    """The entity-dropout rate sweep scored on the dev split (``ner_<ds>_dev.json``, written by
    ``kala_ner.py --eval-split dev --groups main edrop edrop_rates``): dev F1 of every relational
    KALA variant with entity dropout (its rate as the run recorded it) and the per-seed difference
    from fine-tuning of the same seed; then the dev choice against the rate of the test runs
    (``all_res``: :func:`load`'s test-split results)."""
    out = []
    for ds, label in DATASETS.items():
        p = results / f"ner_{ds}_dev.json"
        if not p.is_file():
            continue
        res = json.loads(p.read_text())
        out += [
            f"{label} (dev split, {res['setup']['test_size']} sentences; `{p.name}`):",
            "",
            "| method | entity dropout | dev F1 | minus fine-tuning, per seed | mean |",
            "|---|---|---|---|---|",
            f"| Fine-tuning | - | {fmt([r['f1'] for r in runs_of(res, 'finetune')])} | | |",
        ]
        rates = {}  # entity dropout -> variant
        for r in res["runs"]:
            if r["kala"]["method"] == "relational" and r["kala"].get("entity_dropout", 0) > 0:
                rates[r["kala"]["entity_dropout"]] = r["variant"]
        means = {}
        for rate, variant in sorted(rates.items()):
            f1 = [r["f1"] for r in runs_of(res, variant)]
            diff = paired(res, "finetune", variant)
            means[rate] = statistics.mean(f1)
            out.append(
                f"| KALA relational | {rate} | {fmt(f1)} | "
                + ", ".join(f"{x:+.2f}" for x in diff)
                + (f" | {statistics.mean(diff):+.2f} |" if diff else " | - |")
            )
        if means:
            best = max(means, key=means.get)
            test_rates = {r["kala"]["entity_dropout"] for r in runs_of(all_res.get(ds, {}), "relational_edrop")}
            out += [
                "",
                f"Dev choice: {best}"
                + (
                    " (the rate of the test runs above)."
                    if test_rates == {best}
                    else f" (the test runs above used {sorted(test_rates)})."
                ),
            ]
        out.append("")
    return "\n".join(out)


FULL = [("finetune", "Fine-tuning"), ("relational_edrop", "KALA relational + entity dropout 0.3")]


def full_data_lines(results: pathlib.Path = RESULTS, suffix: str = "_full") -> str:
    """The whole-data runs (``ner_<ds><suffix>.json``: every training and test sentence, the subset
    runs' hyper-parameters): F1 overall / seen / unseen, the F1 targets, and the step-time ratio
    of the same seeds (both methods ran under the same load)."""
    full = load(results, suffix)
    if not full:
        return ""
    out = [setup_lines(full, "every sentence of the split"), ""]
    for metric, title in (("f1", "test F1"), ("f1_seen", "seen contexts"), ("f1_unseen", "unseen contexts")):
        out += [table(full, FULL, metric, title=f"{title} (%)"), ""]
    for d, res in full.items():
        line = f1_target_line(d, res, "relational_edrop", "relational + entity dropout")
        if not line:
            continue
        out.append(f"- {line}")
        ft = timed(same_seeds(res, "finetune", "relational_edrop"))
        kala = timed(same_seeds(res, "relational_edrop", "finetune"))
        ft_step, ft_wall, k_step, k_wall = (
            mean_std([r.get(k) for r in rs])[0] for rs in (ft, kala) for k in ("median_step_seconds", "train_seconds")
        )
        if ft_step and ft_wall and k_step and k_wall:
            out.append(
                f"- {DATASETS[d]} time (same seeds): median step {k_step:.3f} s vs {ft_step:.3f} s = "
                f"{k_step / ft_step:.2f}x, train wall {k_wall:.0f} s vs {ft_wall:.0f} s = "
                f"{k_wall / ft_wall:.2f}x (other jobs shared the 2 cores during these runs: read the ratio, "
                f"not the seconds)"
            )
    return "\n".join(out)


def lexicon_quality_lines(results: pathlib.Path = RESULTS) -> str:
    """What each lexicon strategy finds of the gold mentions (``lexicon_quality_<ds>.json``,
    experiments/kala_lexicon_quality.py; labels used only to score), on the test split."""
    lines = [
        "| dataset | lexicon strategy | entries | mentions / sentence | precision (overlap / exact) | "
        "recall (overlap) |",
        "|---|---|---|---|---|---|",
    ]
    for ds, label in DATASETS.items():
        p = results / f"lexicon_quality_{ds}.json"
        if not p.is_file():
            continue
        for strategy, r in json.loads(p.read_text())["strategies"].items():
            t = r["test"]
            lines.append(
                f"| {label} | {strategy} | {t['lexicon_size']} | {t['mentions_per_sentence']:.2f} | "
                f"{t['precision_overlap']:.3f} / {t['precision_exact']:.3f} | {t['recall_overlap']:.3f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def report(results: pathlib.Path = RESULTS) -> str:
    all_res = load(results)
    if not all_res:
        return "No KALA results yet (run experiments/kala_ner.py)."
    edrop = [v for v in EDROP if any(runs_of(res, v[0]) for res in all_res.values())]  # variants that ran
    parts = [
        "# KALA on MiniLM: results",
        "",
        "Setup (see experiments/kala_ner.py):",
        setup_lines(all_res),
        "",
        table(all_res, MAIN + edrop, title="## Main results (Tables 1-2): test entity F1 (%)"),
        "",
        "Entity dropout (not in the paper): training graph nodes made null at random (rate 0.3), "
        "as out-of-vocabulary test entities are (the vocabulary is built from the training "
        "mentions, so without it no training mention is ever null).",
        "",
        "Targets (issue 6):",
        "",
        target_lines(all_res),
        "",
        "### Whole training and test sets (`ner_<dataset>_full.json`)",
        "",
        "Fine-tuning and the headline variant on every training and test sentence, with the subset "
        "runs' hyper-parameters, epochs and entity-dropout rate (nothing re-tuned):",
        "",
        full_data_lines(results) or "(not run yet)",
        "",
        "### NCBI-Disease, whole data, with the defined-term graph (`ner_ncbi_full_abbreviation.json`)",
        "",
        "The same runs on a graph whose lexicon is the corpus' own defined terms and their abbreviations "
        "(`jsteer kala build-graph --strategy abbreviation`: Schwartz-Hearst definitions, long and short form "
        "one entity, plus frequent n-grams ending on a defined term's head word) instead of frequent "
        "n-grams; fine-tuning and KALA ran side by side, one process each. What each lexicon finds of the "
        "test split's gold mentions (`lexicon_quality_<dataset>.json`, experiments/kala_lexicon_quality.py; "
        "the labels only score the builder's output):",
        "",
        lexicon_quality_lines(results),
        "",
        full_data_lines(results, "_full_abbreviation") or "(not run yet)",
        "",
        "Training wall time on that graph (`walltime_abbreviation.json`, kala_walltime.py's protocol below):",
        "",
        walltime_lines(results, "walltime_abbreviation.json") or "(not run yet)",
        "",
        "### Entity-dropout rate, chosen on the dev split",
        "",
        "The rate of the runs above was set before any tuning; the sweep below scores it and other rates "
        "on the dev split (same training subset, seeds and protocol; the test split plays no part).",
        "",
        edrop_rate_lines(all_res, results) or "(no dev sweep yet)",
        "",
        table(all_res, ABLATION, title="## gamma / beta ablation (Table 3): test F1 (%)"),
        "",
        "## Seen vs unseen contexts (Figure 4): test F1 (%)",
        "",
        table(all_res, MAIN + edrop, "f1_seen", title="Seen (every mentioned entity in the training vocabulary)"),
        "",
        table(all_res, MAIN + edrop, "f1_unseen", title="Unseen (>= 3 mentioned entities outside it)"),
        "",
        table(all_res, LAYERS, title="## KFM layer location (MiniLM has 6 layers, 0-based): test F1 (%)"),
        "",
        "## Training cost (Table 11)",
        "",
        "Median train-step time of each run (steps that compiled a new shape excluded by the median), "
        'mean over seeds; "vs fine-tuning" divides by fine-tuning\'s runs of the same seeds. '
        "Runs were measured at different times on a shared 2-core machine whose load varied (load "
        "average 2-20), so ratios between runs are noisy; the interleaved benchmark below is the "
        "controlled comparison. Step memory: bytes XLA plans for one AdamW step (arguments + "
        "outputs + temporaries) at the first batch's shape.",
        "",
        cost_table(all_res),
        "",
        "CoNLL-2003, fine-tuning and relational KALA + entity dropout of the same seed run back to "
        "back, alone on the machine, relational with 2 smaller graph-bucket rungs "
        "(``TrainConfig.graph_rungs=2``; `ner_conll_edrop.json`; seed 0 left out: another process "
        "shared the CPU). Train wall counts steps 2..N, so it includes compiling each new batch / "
        "graph shape: relational KALA meets up to 3x more shapes, each a ~12 s compile on this CPU, "
        "and the persistent compilation cache (runs/jax_cache) was cold for seed 1. On 376-step "
        "runs that compile time, not the step, is most of the gap:",
        "",
        timing_sweep_lines(results),
        "",
        "### Training wall time, measured cleanly (experiments/kala_walltime.py; `walltime.json`)",
        "",
        "Each run a fresh process on the idle machine with the protocol above (no evaluation); the two "
        "methods of a seed back to back in alternating order; each run twice: with an empty "
        "compilation cache (cold: a first run compiles every batch shape) and again reading its "
        "compiled steps from that cache (warm: any later run). Fit = first batch to last step, "
        "compiles included. Relational KALA with entity dropout 0.3 (the headline variant), default "
        "graph buckets (no smaller rungs).",
        "",
        walltime_lines(results) or "(not run yet)",
        "",
        "CoNLL-2003 again after fine-tuning's batches stopped growing to a longer length bucket for its "
        "graph's sake (`kdata.batches(graph=False)`, session 31; the readings above predate it, so "
        "fine-tuning paid some graph-driven padding there; `walltime_conll_padfix.json`):",
        "",
        walltime_lines(results, "walltime_conll_padfix.json") or "(not run yet)",
        "",
        "The same with 2 smaller graph-bucket rungs (``--graph-rungs 2``, `walltime_rungs2.json`): only "
        "the graph padding differs (and with it the dropout draws): less padded edge work, up to one more "
        "compiled shape per rung and length bucket:",
        "",
        walltime_lines(results, "walltime_rungs2.json") or "(not run yet)",
        "",
        "CoNLL-2003 again with short batches' graph buckets sized for 98% of length-grouped batches "
        "instead of 95% (session 32; fewer batches move to the 64-subword bucket for their graph's "
        "sake; `walltime_conll_p98.json`):",
        "",
        walltime_lines(results, "walltime_conll_p98.json") or "(not run yet)",
        "",
        "### Train-step cost, interleaved (experiments/kala_step_overhead.py; `step_overhead.json`)",
        "",
        "One process, each method's compiled train step timed in rounds on the same CoNLL-2003 batches "
        "(B = 16), so that machine drift hits every method alike; MiniLM as in the runs above, and "
        "BERT-base's shape (the paper's backbone; random weights, which a step's time does not "
        "depend on):",
        "",
        step_overhead_lines(results) or "(not run yet)",
        "",
        "## Every run",
        "",
        seed_table(all_res, MAIN + edrop + [v for v in ABLATION + LAYERS if v not in MAIN]),
    ]
    notes = results / "notes.md"  # hand-written reading of the numbers (protocol choices, caveats)
    if notes.is_file():
        parts += ["", notes.read_text().rstrip()]
    bench = results / "bench.md"
    if bench.is_file():
        parts += ["", "## Throughput benchmark (experiments/bench_kala.py)", "", bench.read_text()]
    for md in gpu_bench_files(results):
        parts += [
            "",
            f"### On a GPU ({md.parent.name}/{md.name}; that folder's README has the context)",
            "",
            md.read_text(),
        ]
    return "\n".join(parts) + "\n"


def gpu_bench_files(results: pathlib.Path = RESULTS) -> list:
    """experiments/device_check_kala.sh's tables (``results/../gpu_*/kala_b<batch>[_<variant>].md``),
    by run folder, then batch, then name."""
    by_batch = lambda md: (md.parent.name, int(md.stem[len("kala_b") :].split("_")[0]), md.stem)  # noqa: E731
    return sorted(results.parent.glob("gpu_*/kala_b*.md"), key=by_batch)
