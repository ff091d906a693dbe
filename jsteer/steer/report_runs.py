"""Markdown and target lines of the LM-Steer runs beside the main one (experiments/results/steer/).

Each function reads the JSON files present under a results folder and returns markdown text (or
``- ...`` target lines); absent files are skipped. The runs: the held-out recipe sweeps
(:data:`SWEEPS`, ``experiments/steer_sweep.py``: per config a table of positivity / perplexity
rise at each steer value, its held-out choice and, where scored, that choice on the test
prompts), the paper-protocol detox runs (:data:`DETOX_RUNS`, ``experiments/steer_detox.py``:
evaluator error rates, held-out choice, test table with bootstrap intervals), LM-Steer vs the
baselines (:data:`DETOX_KINDS`, ``detox_kinds_<kind>.json``) and the other full runs
(``smollm2_<tag>.json``).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Iterator

from jsteer.steer.protocol import DEFAULTS, RESULTS
from jsteer.steer.verdicts import NEGATIVE_TARGET, POSITIVE_TARGET, fmt, halved, positivity_met, targets

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


def _present(results: pathlib.Path, names) -> Iterator[tuple[str, dict]]:
    """(file name, its parsed JSON) for each of ``names`` that exists under ``results``."""
    for fname in names:
        p = results / fname
        if p.exists():
            yield fname, json.loads(p.read_text())


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
        if positivity_met("positive", r["chosen"]["positivity_pos"])
        and positivity_met("negative", r["chosen"]["positivity_neg"])
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
                positivity_met(d, t[d]["positivity"]) and t[d]["ppl_rise"] <= lim for d in ("positive", "negative")
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
    for fname, sw in _present(results, SWEEPS):
        tested = {n: r for n, r in sw.get("configs", {}).items() if "test" in r}
        if not tested:
            continue
        name = max(tested, key=lambda n: tested[n]["chosen"]["gap"])
        t, lim = tested[name]["test"], sw["setup"]["max_ppl_rise"]
        what = f"{_recipe(name, tested[name]['config'])} (`{fname}`, chosen on held-out prompts by gap)"
        for key, want in (("positive", f">= {POSITIVE_TARGET:.2f}"), ("negative", f"<= {NEGATIVE_TARGET:.2f}")):
            v = t[key]
            ok = positivity_met(key, v["positivity"]) and v["ppl_rise"] <= lim
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
    for fname, dx in _present(results, DETOX_RUNS):
        r = dx.get("result")
        if r and r["natural_prior"]["ratio"] is not None:
            x = r["natural_prior"]
            lines.append(
                f"- detox protocol `{fname}`: toxicity probability {x['base_toxicity_prob']:.3f} -> "
                f"{x['steered_toxicity_prob']:.3f}, ratio {x['ratio']:.3f} at perplexity rise "
                f"{r['ppl_rise']:+.3f} -> halved {'met' if halved(x['ratio']) else 'MISSED'}"
            )
    return lines


def recipe_sweeps(results: pathlib.Path = RESULTS) -> str:
    """The held-out recipe sweeps present under ``results`` (:data:`SWEEPS`) as markdown."""
    parts = []
    for fname, sw in _present(results, SWEEPS):
        parts += [
            f"### {SWEEPS[fname]} (`{fname}`)",
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
    for fname, dx in _present(results, DETOX_RUNS):
        if "prompts" in dx:  # written once the prompts and the steer exist
            parts += [f"### {DETOX_RUNS[fname]} (`{fname}`)", "", detox_protocol_run(dx), ""]
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
            f"| {r} | {fmt(c['accuracy'], True)} | {fmt(c['false_positive_rate'], True)} | "
            f"{fmt(c['true_positive_rate'], True)} | {fmt(c['clean_flagged'], True)} |"
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
            f"| {k.split('/')[0]} | {k.split('/')[1]} | {fmt(v['toxicity_prob'], True)} | "
            f"{fmt(v['mean_max_toxicity'])} | {fmt(v['ppl_rise'], True)} |"
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
                f"| {name} | {fmt(r['toxicity_prob'], True)} | {fmt(r['mean_max_toxicity'])} | "
                f"{fmt(r['toxic_fraction'], True)} | {fmt(b['toxicity_prob'], True)} | "
                f"{fmt(b['mean_max_toxicity'])} | "
                f"{fmt(m[key]['ppl_mean'])} | {fmt(m[key]['dist2'])} | {fmt(m[key]['dist3'])} |"
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
                f"- {r}: toxicity probability {fmt(x['base_toxicity_prob'], True)}% -> "
                f"{fmt(x['steered_toxicity_prob'], True)}%, ratio {fmt(x['ratio'])} (paired bootstrap over "
                f"prompts: 95% interval {fmt(bs['ratio_p2.5'])}-{fmt(bs['ratio_p97.5'])}, ratio <= 0.5 in "
                f"{fmt(bs['share_ratio_le_0.5'], True)}% of resamples); perplexity rise "
                f"{fmt(res_['ppl_rise'], True)}%"
                + (" -> target (halve) " + ("met" if halved(x["ratio"]) else "MISSED") if r == "natural_prior" else "")
            )
    return "\n".join(out)


DETOX_KINDS = {
    "steer": "LM-Steer",
    "blacklist": "soft word blacklist",
    "offset": "context-vector offset",
    "caa": "CAA control vector",
    "pca": "PCA control vector",
}


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
        layer = dx.get("training", {}).get("detox", {}).get("layer")  # a control vector's
        name = DETOX_KINDS[k] + ("" if layer is None else f", layer {layer}")
        if dx["setup"]["strengths"] != su["strengths"]:
            name += f", values {dx['setup']['strengths']}"
        out.append(
            f"| {name} (eps0 {dx['setup']['eps0']:g}) | {sel['chosen']:+g} | "
            f"{fmt(x['base_toxicity_prob'], True)} -> {fmt(x['steered_toxicity_prob'], True)} | "
            f"{fmt(x['ratio'])} | "
            f"{fmt(bs['ratio_p2.5'])}-{fmt(bs['ratio_p97.5'])} | {fmt(r['ppl_rise'], True)} | "
            f"{fmt(m[key]['dist3'])} |"
        )
    return "\n".join(out)
