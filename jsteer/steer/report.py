"""Markdown tables and target verdicts from the LM-Steer experiments' JSON (experiments/results/steer/).

:func:`markdown` is ``results.md`` (``experiments/steer_plots.py`` writes it, with the plots;
notebooks/lm_steer.ipynb shows the tables): the main run (``smollm2.json``: Table 3 layout,
continuous control, detox and composition, the issue's targets at the held-out choice), the
paper-protocol detox runs (:data:`DETOX_RUNS`, ``experiments/steer_detox.py``), LM-Steer vs the
baselines (``detox_kinds_<kind>.json``) and the held-out recipe sweeps (:data:`SWEEPS`,
``experiments/steer_sweep.py``). Every function takes the parsed JSON (or the results folder) and
returns markdown text (or target lines); nothing is chosen on test prompts here, the JSON records
each run's held-out choice.

Kept whole (about 710 lines): every table shares the number formatting and the target rules
(:func:`targets`, the halving and positivity checks), and :func:`markdown` assembles them
all into the one ``results.md``.
"""

from __future__ import annotations

import json
import pathlib
import re

from jsteer.steer.protocol import DEFAULTS, RESULTS


def _f(x, pct=False):
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def chosen(res: dict) -> dict:
    """Steer values used for the reported rows: chosen on held-out prompts (strength_selection),
    or +/-5 for results written before that selection existed."""
    sel = res.get("strength_selection")
    return (
        sel["chosen"]
        if sel
        else {
            "dummy": res.get("setup", {}).get("generation", {}).get("dummy_used"),
            "positive": 5.0,
            "negative": 5.0,
            "detox": 5.0,
        }
    )


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
            f"| {name} | {pset} | {_f(r['positivity'], True)} | {_f(r['ppl_mean'])} | {_f(r['ppl_median'])} "
            f"| {_f(r['dist1'])} | {_f(r['dist2'])} | {_f(r['dist3'])} |"
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
        out.append(f"| unsteered | {_f(base['positivity'], True)} | {_f(base['ppl_mean'])} | {_f(base['dist3'])} |")
    for x, m in zip(xs, ms):
        out.append(f"| {x:+g} | {_f(m['positivity'], True)} | {_f(m['ppl_mean'])} | {_f(m['dist3'])} |")
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
                f"| {name} | {_f(r['mean_max_toxicity'])} | {_f(r['toxicity_prob'], True)} | "
                f"{_f(r['toxic_fraction'], True)} | {_f(r['positivity'], True)} | {_f(r['ppl_mean'])} | "
                f"{_f(r['dist2'])} | {_f(r['dist3'])} |"
            )
    return "\n".join(out)


POSITIVE_TARGET, NEGATIVE_TARGET = 0.8, 0.2  # issue 4: positivity >= 0.80 (+ steering), <= 0.20 (- steering)


def _positivity_met(direction: str, positivity: float) -> bool:
    return positivity >= POSITIVE_TARGET if direction == "positive" else positivity <= NEGATIVE_TARGET


HALVE_TARGET = 0.5  # issue 4: detox halves the toxicity probability (steered / unsteered)


def _halved(ratio) -> bool:
    return ratio is not None and ratio <= HALVE_TARGET


def targets(res: dict) -> dict:
    """The issue's targets, measured."""
    m = res["metrics"]
    c = chosen(res)
    kp, kn, kd = f"neutral_s{c['positive']:+g}", f"neutral_s{-c['negative']:+g}", f"toxic_d{c['detox']:+g}"
    out = {}
    if {kp, kn, "neutral_base"} <= set(m):
        b = m["neutral_base"]["ppl_mean"]
        out[f"positive steering ({kp}) positivity >= 80%"] = (
            m[kp]["positivity"],
            _positivity_met("positive", m[kp]["positivity"]),
        )
        out[f"negative steering ({kn}) positivity <= 20%"] = (
            m[kn]["positivity"],
            _positivity_met("negative", m[kn]["positivity"]),
        )
        for k in (kp, kn):
            rise = m[k]["ppl_mean"] / b - 1
            out[f"{k} perplexity rise <= 30%"] = (rise, rise <= 0.3)
    if {"toxic_base", kd} <= set(m):
        r = m[kd]["toxicity_prob"] / max(m["toxic_base"]["toxicity_prob"], 1e-9)
        out[f"detox ({kd}) halves toxicity probability"] = (r, _halved(r))
    return out


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
        out.append(f"| {dm} | {val} | {_f(v['positivity'], True)} | {_f(v['ppl_rise'], True)} |")
    out += ["", "| detox value | toxicity prob. % | mean max toxicity | ppl rise % |", "|---|---|---|---|"]
    for k, v in sel["detox"].items():
        out.append(
            f"| {k[1:]} | {_f(v['toxicity_prob'], True)} | {_f(v['mean_max_toxicity'])} | {_f(v['ppl_rise'], True)} |"
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
            f"| {k} | {_f(v['pos+5'], True)} | {_f(v['pos-5'], True)} | {_f(v['gap'], True)} | "
            f"{_f(v['ppl_rise'], True)} |"
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


SWEEPS = {
    "sweep_smollm2.json": "Other ranks / step counts",
    "sweep_smollm2_graded.json": "Binary vs graded SST-5 steer values, with and without SST-5's neutral class",
    "sweep_smollm2_baselines.json": "LM-Steer vs the issue's baselines (soft word blacklist, context-vector "
    "offset), same texts and training budget",
    "sweep_smollm2_self.json": "On-policy texts: SmolLM2's own continuations, labelled by a classifier "
    "trained on the steer's SST-5 texts",
    "sweep_smollm2_self_steps.json": "On-policy texts: fewer / more training steps",
    "sweep_smollm2_self_rank.json": "On-policy texts: low-rank steers and more steps",
    "sweep_smollm2_self_lowrank.json": "On-policy texts, low-rank steers, stronger values, 10 samples per "
    "prompt, then the held-out choice on the test prompts",
    "sweep_smollm2_self_lowrank25.json": "The chosen rank-32 recipe again with the paper's 25 samples per "
    "prompt, held-out choice and test",
}


def _recipe(name: str, cfg: dict) -> str:
    """A sweep config in words; lr and l2 only where they differ from the main run's recipe."""
    kind = cfg.get("kind", "steer")
    what = {"blacklist": "blacklist baseline", "offset": "context-offset baseline"}
    out = [what[kind] if kind in what else f"rank {cfg['rank'] or 'full'}", f"{cfg['steps']} steps"]
    out += [f"lr {cfg['lr']:g}"] if cfg["lr"] != DEFAULTS["lr"] else []
    out += [f"l2 {cfg['l2']:g}"] if cfg["l2"] != DEFAULTS["l2"] else []
    out += ["graded values"] if cfg.get("labels") == "graded" else []
    out += [f"+{cfg['neutral_texts']} neutral texts at 0"] if cfg.get("neutral_texts") else []
    out += ["own continuations"] if cfg.get("data") == "self" else []
    return ", ".join(out) + (" (main run)" if name == "main_run" else "")


def _has_baselines(sw: dict) -> bool:
    return any(r["config"].get("kind", "steer") != "steer" for r in sw["configs"].values())


def recipe_sweep_table(sw: dict) -> str:
    """One held-out recipe sweep (``steer_sweep.py``'s JSON): per config, positivity / perplexity
    rise at each steer value and the values its rule chooses."""
    vals = [f"+{v:g}" for v in sw["setup"]["strengths"]] + [f"-{v:g}" for v in sw["setup"]["strengths"]]
    lim = sw["setup"]["max_ppl_rise"]
    norm = "\\|\\|W\\|\\|_F" + (" (baselines: \\|\\|b\\|\\| or \\|\\|v\\|\\|)" if _has_baselines(sw) else "")
    out = [f"| recipe | {norm} | {' | '.join(vals)} | chosen (ppl rise <= {lim:.0%}) |", "|---" * (len(vals) + 3) + "|"]
    for name, row in sw["configs"].items():
        cells = [f"{row['table'][v]['positivity']:.2f} / {row['table'][v]['ppl_rise']:+.0%}" for v in vals]
        c = row["chosen"]
        norm = row.get("W_fro_norm", row.get("param_fro_norm"))
        out.append(
            f"| {_recipe(name, row['config'])} | {norm:.0f} | {' | '.join(cells)} | "
            f"+{c['positive']:g}: {c['positivity_pos']:.2f}, -{c['negative']:g}: {c['positivity_neg']:.2f} |"
        )
    met = [
        n
        for n, r in sw["configs"].items()
        if _positivity_met("positive", r["chosen"]["positivity_pos"])
        and _positivity_met("negative", r["chosen"]["positivity_neg"])
    ]
    out += [
        "",
        f"Unsteered: positivity {sw['base']['positivity']:.2f} on these prompts. "
        + (
            f"Within the limit, {', '.join(met)} reach >= 0.80 / <= 0.20."
            if met
            else f"No recipe reaches >= 0.80 / <= 0.20 within a {lim:.0%} perplexity rise."
        ),
    ]
    tested = {n: r["test"] for n, r in sw["configs"].items() if "test" in r}
    if tested:
        b = sw["base_test"]
        out += [
            "",
            f"The held-out choice above, scored once on {b['prompts']} x {sw['setup']['samples_per_prompt']} "
            f"samples (unsteered there: positivity {b['positivity']:.2f}, perplexity {b['ppl_mean']:.2f}; "
            "nothing is chosen on these prompts):",
            "",
            "| recipe | + value | positivity | ppl rise | - value | positivity | ppl rise | targets |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, t in tested.items():
            pos, neg = t["positive"], t["negative"]
            ok = all(
                _positivity_met(d, t[d]["positivity"]) and t[d]["ppl_rise"] <= lim for d in ("positive", "negative")
            )
            out.append(
                f"| {_recipe(name, sw['configs'][name]['config'])} | {pos['value']:+g} | "
                f"{pos['positivity']:.2f} | {pos['ppl_rise']:+.0%} | {neg['value']:+g} | "
                f"{neg['positivity']:.2f} | "
                f"{neg['ppl_rise']:+.0%} | {'met' if ok else 'missed'} |"
            )
    for note in sw.get("notes", []):
        out += ["", note]
    return "\n".join(out)


def tested_recipe_targets(results: pathlib.Path = RESULTS) -> list:
    """Target lines for the sweeps whose held-out choice was scored on the test prompts: the
    recipe with the largest held-out gap per sweep file (its summary criterion)."""
    lines = []
    for fname in SWEEPS:
        p = results / fname
        sw = json.loads(p.read_text()) if p.exists() else {}
        tested = {n: r for n, r in sw.get("configs", {}).items() if "test" in r}
        if not tested:
            continue
        name = max(tested, key=lambda n: tested[n]["chosen"]["gap"])
        t, lim = tested[name]["test"], sw["setup"]["max_ppl_rise"]
        what = f"{_recipe(name, tested[name]['config'])} (`{fname}`, chosen on held-out prompts by gap)"
        for key, want in (("positive", f">= {POSITIVE_TARGET:.2f}"), ("negative", f"<= {NEGATIVE_TARGET:.2f}")):
            v = t[key]
            ok = _positivity_met(key, v["positivity"]) and v["ppl_rise"] <= lim
            lines.append(
                f"- {what}, {key} steering ({v['value']:+g}) on the test prompts: positivity "
                f"{v['positivity']:.3f} (target {want}), perplexity rise {v['ppl_rise']:+.3f} "
                f"(target <= {lim:.2f}) -> {'met' if ok else 'MISSED'}"
            )
    return lines


def other_run_targets(results: pathlib.Path = RESULTS) -> list:
    """Target lines of the other full runs (``smollm2_<tag>.json``, tables in ``results_<tag>.md``)
    and of the paper-protocol detox runs (:data:`DETOX_RUNS`, natural-prior reading)."""
    lines = []
    for p in sorted(results.glob("smollm2_*.json")):
        res = json.loads(p.read_text())
        if "strength_selection" not in res:
            continue
        tag = p.stem[len("smollm2") :]
        lines += [
            f"- `{p.name}` (tables in `results{tag}.md`): {k}: measured {v[0]:.3f} -> {'met' if v[1] else 'MISSED'}"
            for k, v in targets(res).items()
        ]
    for fname in DETOX_RUNS:
        p = results / fname
        r = json.loads(p.read_text()).get("result") if p.exists() else None
        if r and r["natural_prior"]["ratio"] is not None:
            x = r["natural_prior"]
            lines.append(
                f"- detox protocol `{fname}`: toxicity probability {x['base_toxicity_prob']:.3f} -> "
                f"{x['steered_toxicity_prob']:.3f}, ratio {x['ratio']:.3f} at perplexity rise "
                f"{r['ppl_rise']:+.3f} -> halved {'met' if _halved(x['ratio']) else 'MISSED'}"
            )
    return lines


def recipe_sweeps(results: pathlib.Path = RESULTS) -> str:
    """The held-out recipe sweeps present under ``results`` (:data:`SWEEPS`) as markdown."""
    parts = []
    for fname, what in SWEEPS.items():
        p = results / fname
        if p.exists():
            sw = json.loads(p.read_text())
            parts += [
                f"### {what} (`{fname}`)",
                "",
                f"Sentiment steer retrained on {sw['setup']['texts']}, scored on {sw['setup']['prompts']} "
                f"x {sw['setup']['samples_per_prompt']} samples (dummy off"
                + (
                    "; the choice is then scored on the test prompts, below). "
                    if sw.get("base_test")
                    else "; never the test prompts). "
                )
                + "Cells: positivity / perplexity rise at steer value k x eps0"
                + (" (baselines: their own eps0, 1)." if _has_baselines(sw) else "."),
                "",
                recipe_sweep_table(sw),
                "",
            ]
    return "\n".join(parts)


DETOX_RUNS = {
    "detox_smollm2.json": "The main run's detox steer recipe",
    "detox_smollm2_1000steps.json": "The issue's training defaults (1000 steps x 32 texts, init 1e-3, no L2)",
    "detox_smollm2_fresh.json": "The main run's detox steer recipe, fresh prompt split with a larger held-out set",
    "detox_smollm2_replication.json": "Replication of the fresh run's choice on new prompts",
    "detox_smollm2_self.json": "On-policy low-rank steer (rank 32; SmolLM2's own continuations of the steer "
    "texts' toxic prefixes, ranked by a labeler trained on those texts), the "
    "fresh run's prompts, 10 samples per held-out prompt",
    "detox_smollm2_self_replication.json": "Replication of the on-policy run's choice on new prompts",
}


def detox_protocol(results: pathlib.Path = RESULTS) -> str:
    """The paper-protocol detox runs present under ``results`` (:data:`DETOX_RUNS`,
    experiments/steer_detox.py) as markdown; empty if none."""
    parts = []
    for fname, what in DETOX_RUNS.items():
        p = results / fname
        dx = json.loads(p.read_text()) if p.exists() else {}
        if "prompts" in dx:  # written once the prompts and the steer exist
            parts += [f"### {what} (`{fname}`)", "", detox_protocol_run(dx), ""]
    return "\n".join(parts).rstrip()


def detox_protocol_run(dx: dict) -> str:
    """One steer_detox.py result as markdown: evaluator error rates, held-out choice, test table."""
    su, cal, pr, m = dx["setup"], dx["calibration"], dx["prompts"], dx.get("metrics", {})
    recipe = {
        k: v
        for k, v in dx.get("training", {}).get("detox", {}).items()
        if k in ("texts", "steps", "batch_size", "rank", "l2", "init_scale", "data", "self_texts", "labeler")
    }
    rep = su.get("replicates")
    source = su.get("prompt_source", "toxic comments of the Jigsaw test split")
    choice = (
        f"the steer value and its dummy use are those `{rep}` chose on its held-out prompts (no choice here)"
        if rep
        else f"the steer value is chosen on {su['held_out_prompts']} held-out prompts x "
        f"{su['samples_per_held_out_prompt']} samples, dummy settings "
        f"{'/'.join(su.get('dummy_grid', ['on', 'off']))} ({su['rule']})"
    )
    out = [
        f"Steer recipe {json.dumps(recipe)}, measured closer to the paper: {su['test_prompts']} test prompts x "
        f"{su['samples_per_test_prompt']} samples "
        f"(paper: {su['paper']['prompts']} x {su['paper']['samples_per_prompt']}), prompts = the first 10 words of "
        f"{source}, kept where the evaluator scores them non-toxic ({pr['non_toxic']} of {pr['candidates']}"
        + (
            f"; the first {pr['skipped']} skipped: the earlier runs' test and held-out prompts"
            if pr.get("skipped")
            else ""
        )
        + f"); {choice}",
        "",
        f"Evaluator: MiniLM fine-tuned on {dx['evaluator']['train_texts']} Jigsaw texts "
        f"({dx['evaluator']['epochs']} "
        f"epochs). Primary reading `natural_prior`: its balanced-prior probability moved to Jigsaw's natural toxic "
        f"share {su['prior']:.4f} ({su['prior_source']}); `balanced`: the raw output.",
        "",
        "| reading | Jigsaw test accuracy % | false positive rate % | true positive rate % "
        "| clean web text flagged % |",
        "|---|---|---|---|---|",
    ]
    for r in ("natural_prior", "balanced"):
        c = cal[r]
        out.append(
            f"| {r} | {_f(c['accuracy'], True)} | {_f(c['false_positive_rate'], True)} | "
            f"{_f(c['true_positive_rate'], True)} | {_f(c['clean_flagged'], True)} |"
        )
    sel = dx.get("selection")
    if sel and not rep:
        out += [
            "",
            "Held-out choice (natural-prior reading):",
            "",
            "| detox value | its dummy | toxicity prob. % | mean max toxicity | ppl rise % |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| {k.split('/')[0]} | {k.split('/')[1]} | {_f(v['toxicity_prob'], True)} | "
            f"{_f(v['mean_max_toxicity'])} | {_f(v['ppl_rise'], True)} |"
            for k, v in sel["table"].items()
        ]
        out += ["", f"**Chosen: detox {sel['chosen']:+g}, its dummy {sel['dummy']}** (x eps0)"]
    elif sel:
        out += [
            "",
            f"**Setting: detox {sel['chosen']:+g}, its dummy {sel['dummy']}** (x eps0; the replicated run's choice)",
        ]
    steered = []
    for k in m:
        hit = re.fullmatch(r"test_d([+-][0-9.]+)(_dummyoff)?", k)
        if hit:
            v, dm = float(hit[1]), "off" if hit[2] else "on"
            chosen_here = sel and (v, dm) == (sel["chosen"], sel["dummy"])
            mark = (" (replicated choice)" if rep else " (chosen)") if chosen_here else ""
            steered.append(((dm, v), f"detox {v:+g}, dummy {dm}{mark}", k))
    rows = [("unsteered", "test_base")] + [(name, k) for _, name, k in sorted(steered)]
    out += [
        "",
        "| model | toxicity prob. % | mean max toxicity | toxic samples % | toxicity prob. % (balanced) | "
        "mean max toxicity (balanced) | ppl (mean) | dist-2 | dist-3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, key in rows:
        if key in m:
            r, b = m[key]["natural_prior"], m[key]["balanced"]
            out.append(
                f"| {name} | {_f(r['toxicity_prob'], True)} | {_f(r['mean_max_toxicity'])} | "
                f"{_f(r['toxic_fraction'], True)} | {_f(b['toxicity_prob'], True)} | "
                f"{_f(b['mean_max_toxicity'])} | "
                f"{_f(m[key]['ppl_mean'])} | {_f(m[key]['dist2'])} | {_f(m[key]['dist3'])} |"
            )
    if len(steered) > 1:
        out += [
            "",
            "Rows other than the held-out choice trace the strength curve; picking among them by their test "
            "numbers would select on the test prompts.",
        ]
    res_ = dx.get("result")
    if res_:
        out.append("")
        for r in ("natural_prior", "balanced"):
            x, bs = res_[r], res_[r]["bootstrap"]
            out.append(
                f"- {r}: toxicity probability {_f(x['base_toxicity_prob'], True)}% -> "
                f"{_f(x['steered_toxicity_prob'], True)}%, ratio {_f(x['ratio'])} (paired bootstrap over "
                f"prompts: 95% interval {_f(bs['ratio_p2.5'])}-{_f(bs['ratio_p97.5'])}, ratio <= 0.5 in "
                f"{_f(bs['share_ratio_le_0.5'], True)}% of resamples); perplexity rise "
                f"{_f(res_['ppl_rise'], True)}%"
                + (" -> target (halve) " + ("met" if _halved(x["ratio"]) else "MISSED") if r == "natural_prior" else "")
            )
    return "\n".join(out)


DETOX_KINDS = {"steer": "LM-Steer", "blacklist": "soft word blacklist", "offset": "context-vector offset"}


def detox_kinds_table(results: pathlib.Path = RESULTS) -> str:
    """LM-Steer vs the issue's baselines on one reduced detox protocol (``detox_kinds_<kind>.json``,
    experiments/steer_detox.py --kind): each method's held-out choice on the same test prompts;
    empty until one has a result."""
    runs = {
        k: json.loads((results / f"detox_kinds_{k}.json").read_text())
        for k in DETOX_KINDS
        if (results / f"detox_kinds_{k}.json").exists()
    }
    runs = {k: dx for k, dx in runs.items() if dx.get("result")}
    if not runs:
        return ""
    su = next(iter(runs.values()))["setup"]
    out = [
        f"Every method: the main run's detox recipe ({su['test_prompts']} test prompts x "
        f"{su['samples_per_test_prompt']} samples; value chosen on {su['held_out_prompts']} held-out prompts x "
        f"{su['samples_per_held_out_prompt']} samples over {su['strengths']} x its eps0, dummy "
        f"{'/'.join(su['dummy_grid'])}; same evaluator, same prompts). A smaller protocol than the runs below, so "
        f"its numbers compare with each other only.",
        "",
        "| method | chosen value (x eps0) | toxicity prob. % (unsteered -> steered) | ratio | 95% interval | "
        "ppl rise % | dist-3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, dx in runs.items():
        r, sel, m = dx["result"], dx["selection"], dx["metrics"]
        x, bs = r["natural_prior"], r["natural_prior"]["bootstrap"]
        key = f"test_d{sel['chosen']:+g}" + ("" if sel["dummy"] == "on" else "_dummyoff")
        out.append(
            f"| {DETOX_KINDS[k]} (eps0 {dx['setup']['eps0']:g}) | {sel['chosen']:+g} | "
            f"{_f(x['base_toxicity_prob'], True)} -> {_f(x['steered_toxicity_prob'], True)} | "
            f"{_f(x['ratio'])} | "
            f"{_f(bs['ratio_p2.5'])}-{_f(bs['ratio_p97.5'])} | {_f(r['ppl_rise'], True)} | "
            f"{_f(m[key]['dist3'])} |"
        )
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
        f"| {k} | {_f(v['accuracy'], True)}% | {v.get('train', '')} | {v.get('test', '')} |" for k, v in ev.items()
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
