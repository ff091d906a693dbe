"""Activation steering (CAA, or PCA with --method pca) of SmolLM2-135M towards / away from positive sentiment, on the
LM-Steer experiment's protocol (experiments/steer_smollm2.py) so that the two compare row by row.

    PYTHONPATH=. .venv/bin/python experiments/actsteer_smollm2.py [--pairs 32] [--layers 6,10,15]

(PYTHONPATH=. makes the worktree's jsteer the one imported.) Steps:

1. Vector: CAA (jsteer.actsteer.train, last token) from ``--pairs`` positive / negative SST-5
   sentences of the LM-Steer steer half (steer_common.sentiment_steer_texts: labels 3-4 vs 0-1,
   class-balanced, seeded; detokenised as the evaluator's texts), once at every candidate layer.
2. Choice on held-out prompts only (the 10 held-out neutral prompts of steer_smollm2.py, 5
   samples each): the layer at strength ``--strength``, then the strength at that layer among
   ``--strengths``, by SELECTION_RULE (the layer by its steering effect, the strength by
   LM-Steer's fluency limit).
3. Test: the 20 neutral test prompts of steer_smollm2.py x 5 samples x 20 tokens, top-p 0.9,
   temperature 1, same seeds, at -s, 0 and +s: positivity by the MiniLM sentiment evaluator
   (steer_evaluators.get, the "quick" recipe smollm2.json used), perplexity of the continuation
   under the unsteered model, distinct-n.

Every evaluated setting is written to --out at once; a rerun reuses settings whose values,
prompts and sample count match (and drops those its choices no longer read). Results:
experiments/results/actsteer/{smollm2.json, results.md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

import jsteer
from jsteer import actsteer
from jsteer.actsteer.compare import change, steer_choices, versus
from jsteer.steer import data as steer_data
from jsteer.steer import evaluate, protocol
from jsteer.workspace import ROOT, log, write_json

RESULTS = ROOT / "experiments" / "results" / "actsteer"
HEADER = (
    "| model | positivity % | change (points) | ppl (mean) | ppl rise % | ppl (median) | dist-1 | dist-2 | dist-3 |"
)
RULE = "|---|---|---|---|---|---|---|---|---|"
SELECTION_RULE = (
    "held-out prompts only; a (layer, strength) setting is scored at +s and -s together. Layer: the "
    "largest positivity gap pos(+s) - pos(-s) at --strength (ties: the smaller perplexity rise). "
    "Strength at that layer: among the candidates whose perplexity rise over the unsteered samples is "
    "<= 30% at both signs (LM-Steer's limit), the largest gap (ties: the smaller strength); if none, "
    "the smallest rise (the larger of the two signs')."
)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: results/actsteer/smollm2.json (caa), smollm2_<method>.json")
    ap.add_argument("--method", default="caa", choices=actsteer.METHODS[:2])
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--layers", default="6,10,15", help="candidate layers (SmolLM2 has 30)")
    ap.add_argument("--strength", type=float, default=2.0, help="strength at which the layer is chosen")
    ap.add_argument("--strengths", default="1,2,3", help="candidate strengths at the chosen layer")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--select-prompts", type=int, default=10)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--gen-batch", type=int, default=50)
    ap.add_argument("--steer", default=str(protocol.RESULTS / "smollm2.json"), help="LM-Steer's run to compare with")
    ap.add_argument("--report", action="store_true", help="only rewrite the results md from --out's saved run")
    return ap.parse_args()


def pick_layer(rows: dict) -> int:
    """rows {(layer, s): {"gap", "max_ppl_rise"}} at one s -> the chosen layer (SELECTION_RULE)."""
    return max(rows, key=lambda k: (rows[k]["gap"], -rows[k]["max_ppl_rise"]))[0]


def pick_strength(rows: dict) -> float:
    """rows {(layer, s): {"gap", "max_ppl_rise"}} at one layer -> the chosen s (SELECTION_RULE)."""
    ok = [k for k, r in rows.items() if r["max_ppl_rise"] <= 0.3]
    if ok:
        return max(ok, key=lambda k: (rows[k]["gap"], -k[1]))[1]
    return min(rows, key=lambda k: (rows[k]["max_ppl_rise"], k[1]))[1]


def main():
    a = parse()
    out_path = pathlib.Path(a.out or RESULTS / ("smollm2.json" if a.method == "caa" else f"smollm2_{a.method}.json"))
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    md = out_path.parent / ("results.md" if a.method == "caa" else f"results_{a.method}.md")
    if a.report:
        md.write_text(report(res, out_path.name, pathlib.Path(a.steer)))
        log("wrote", md)
        return
    layers = [int(x) for x in a.layers.split(",")]
    strengths = [float(x) for x in a.strengths.split(",")]
    res["setup"] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised, fp32)",
        "method": a.method,
        "vector": f"{a.pairs} positive / {a.pairs} negative SST-5 train sentences (steer half, labels 3-4 vs 0-1, "
        f"detokenised), paired in seeded order; resid_post, {actsteer.REDUCE[a.method]} token",
        "candidate_layers": layers,
        "layer_choice_strength": a.strength,
        "candidate_strengths": strengths,
        "generation": {
            "test_prompts": a.prompts,
            "held_out_select_prompts": a.select_prompts,
            "samples_per_prompt": a.samples,
            "max_new_tokens": 20,
            "top_p": 0.9,
            "temperature": 1.0,
            "prompt_seed": 0,
            "sample_seed": 0,
            "gen_batch": a.gen_batch,
        },
        "evaluator": "all-MiniLM-L6-v2 fine-tuned by steer_evaluators.get('sentiment', epochs=0.74)",
        "rule": SELECTION_RULE,
    }
    save = lambda: write_json(out_path, res)  # noqa: E731
    t_all = time.time()
    lm = jsteer.load("smollm2-135m")
    clf = evaluate.get("sentiment", jsteer.load("minilm"), epochs=0.74)
    res["evaluator_accuracy"] = clf.meta["accuracy"]

    texts, values = steer_data.sentiment_steer_texts(2 * a.pairs)
    texts = [steer_data.detok_sst(t) for t in texts]
    pos = [t for t, v in zip(texts, values[:, 0]) if v > 0]
    neg = [t for t, v in zip(texts, values[:, 0]) if v < 0]
    t0 = time.time()
    cv = actsteer.train(lm, pos, neg, layers=layers, method=a.method)
    res["vector"] = {
        "seconds": time.time() - t0,
        "recipe": cv.recipe,
        "norms": {str(k): float(np.linalg.norm(v)) for k, v in cv.numpy().items()},
    }
    log("vector", res["vector"]["norms"])

    test = steer_data.prompts("neutral", a.prompts, seed=0)
    pool = steer_data.prompt_pool("neutral", exclude=test)
    sel = [pool[i] for i in sorted(np.random.default_rng(1).choice(len(pool), a.select_prompts, replace=False))]
    res["prompts"] = {"neutral": test, "held_out_select": sel}

    used = set()  # settings this run's protocol reads; others (left by a run with other choices) are dropped

    def run(key, prompt_list, layer=None, s=0.0):
        """Generate and score one setting (cached in the results when values and prompts match)."""
        want = {
            "layer": layer,
            "strength": s,
            "samples": a.samples,
            "prompts_sha1": steer_data.prompts_sha1(prompt_list),
            "pairs": a.pairs,
            "method": a.method,
        }
        used.add(key)
        if res.get("metrics", {}).get(key, {}).get("values") == want:
            return res["metrics"][key]
        hooks = None if layer is None else cv.select(layer).hooks(s)
        t0 = time.time()
        samples = evaluate.sample(lm, lambda b: hooks, prompt_list, a.samples, batch=a.gen_batch)
        gen = time.time() - t0
        m = evaluate.summarize(lm, clf, None, prompt_list, samples)
        m.update(values=want, gen_seconds=gen, eval_seconds=time.time() - t0 - gen)
        res.setdefault("metrics", {})[key] = m
        res.setdefault("examples", {})[key] = [p + " ||| " + ss[0] for p, ss in zip(prompt_list[:3], samples)]
        log(key, {k: round(v, 3) for k, v in m.items() if isinstance(v, float)})
        save()
        return m

    base = run("select_base", sel)

    def score(layer, s):
        up, down = run(f"select_l{layer}_s{s:+g}", sel, layer, s), run(f"select_l{layer}_s{-s:+g}", sel, layer, -s)
        rise = max(up["ppl_mean"], down["ppl_mean"]) / base["ppl_mean"] - 1
        return {
            "positive": up["positivity"],
            "negative": down["positivity"],
            "gap": up["positivity"] - down["positivity"],
            "max_ppl_rise": rise,
        }

    by_layer = {(k, a.strength): score(k, a.strength) for k in layers}
    layer = pick_layer(by_layer)
    by_strength = {(layer, s): by_layer.get((layer, s)) or score(layer, s) for s in strengths}
    strength = pick_strength(by_strength)
    res["selection"] = {
        "layers": {f"{k}@{s:g}": r for (k, s), r in by_layer.items()},
        "strengths": {f"{k}@{s:g}": r for (k, s), r in by_strength.items()},
        "chosen": {"layer": layer, "strength": strength},
        "base": base["positivity"],
    }
    log("chosen", res["selection"]["chosen"])

    run("neutral_base", test)
    for s in (strength, -strength):
        run(f"neutral_l{layer}_s{s:+g}", test, layer, s)
    for part in ("metrics", "examples"):
        res[part] = {k: v for k, v in res[part].items() if k in used}
    res["total_seconds_this_run"] = time.time() - t_all
    save()
    md.write_text(report(res, out_path.name, pathlib.Path(a.steer)))
    log("done", out_path, f"{res['total_seconds_this_run']:.0f}s")


def report(res, source: str = "smollm2.json", steer: pathlib.Path = protocol.RESULTS / "smollm2.json") -> str:
    """results.md: the held-out choice and the test rows, next to LM-Steer's run ``steer``."""
    m, sel = res["metrics"], res["selection"]
    gen = res["setup"]["generation"]
    steer = steer.resolve()
    steer_name = steer.relative_to(ROOT) if steer.is_relative_to(ROOT) else steer
    layer, s = sel["chosen"]["layer"], sel["chosen"]["strength"]
    method = res["setup"]["method"].upper()
    lines = [
        f"# Activation steering ({method}) on SmolLM2-135M: sentiment",
        "",
        f"Written by `experiments/actsteer_smollm2.py` from `{source}` (the whole run: "
        f"{res['total_seconds_this_run']:.0f} s on a shared 2-core CPU).",
        "",
        f"Vector: {res['setup']['vector']}. Evaluator: {res['setup']['evaluator']}, test accuracy "
        f"{res['evaluator_accuracy']:.1%}.",
        "",
        f"## Held-out choice ({gen['held_out_select_prompts']} held-out neutral prompts x "
        f"{gen['samples_per_prompt']} samples)",
        "",
        f"Rule: {SELECTION_RULE}",
        "",
        f"Unsteered positivity {sel['base']:.0%}. **Chosen: layer {layer}, strength {s:g}.**",
        "",
        "| layer @ strength | positivity +s | positivity -s | gap | max ppl rise |",
        "|---|---|---|---|---|",
    ]
    for part in ("layers", "strengths"):
        for key, r in sel[part].items():
            if part == "strengths" and key in sel["layers"]:
                continue
            lines.append(
                f"| {key} | {r['positive']:.0%} | {r['negative']:.0%} | {r['gap']:+.0%} | {r['max_ppl_rise']:+.0%} |"
            )
    lines += [
        "",
        f"## Test: {res['setup']['generation']['test_prompts']} neutral prompts x "
        f"{res['setup']['generation']['samples_per_prompt']} samples (steer_smollm2.py's prompts and seeds)",
        "",
        HEADER,
        RULE,
    ]

    def row(name, r, base):
        return (
            f"| {name} | {100 * r['positivity']:.1f} | {100 * (r['positivity'] - base['positivity']):+.1f} | "
            f"{r['ppl_mean']:.2f} | {100 * (r['ppl_mean'] / base['ppl_mean'] - 1):+.0f} | {r['ppl_median']:.2f} | "
            f"{r['dist1']:.2f} | {r['dist2']:.2f} | {r['dist3']:.2f} |"
        )

    lines.append(row("unsteered", m["neutral_base"], m["neutral_base"]))
    for v in (s, -s):
        lines.append(row(f"{method} layer {layer}, {v:+g}", m[f"neutral_l{layer}_s{v:+g}"], m["neutral_base"]))
    if steer.exists():
        ref = json.loads(steer.read_text())
        acc = ref["evaluators"]["sentiment"]["accuracy"]
        same = abs(acc - res["evaluator_accuracy"]) < 1e-9
        lines += [
            "",
            f"LM-Steer on the same prompts and seeds ({steer_name}, "
            + (
                f"the same cached evaluator, test accuracy {acc:.1%}"
                if same
                else f"its own evaluator of the same recipe, test accuracy {acc:.1%}: retrained, so not bit-identical "
                "to the one above: the unsteered samples are the same (same ppl) but score differently"
            )
            + "; compare each method's change from its own unsteered row):",
            "",
            HEADER,
            RULE,
        ]
        for key in sorted(
            (k for k in ref["metrics"] if k.startswith("neutral_")),
            key=lambda k: 0.0 if k == "neutral_base" else float(k.split("_s")[1]),
        ):
            v = None if key == "neutral_base" else float(key.split("_s")[1])
            held_out = v is not None and v in steer_choices(ref)
            name = "unsteered" if v is None else f"LM-Steer {v:+g} (x eps0){' (chosen held-out)' if held_out else ''}"
            lines.append(row(name, ref["metrics"][key], ref["metrics"]["neutral_base"]))
        lines += ["", "## Reading", ""] + comparison(
            m, layer, s, ref["metrics"], method, gen["test_prompts"], gen["samples_per_prompt"]
        )
    return "\n".join(lines) + "\n"


def comparison(
    m: dict, layer: int, s: float, ref: dict, name: str = "CAA", prompts: int = 20, samples: int = 5
) -> list:
    """One line per direction: the control vector's change next to the LM-Steer row of the nearest perplexity rise
    (same direction), each against its own unsteered row; with per-prompt positivity in both runs, the
    difference with its 95% interval over prompts (:func:`jsteer.actsteer.compare.versus`)."""

    out = []
    for sign, word in ((1, "towards"), (-1, "away from")):
        dp, dr = change(m, f"neutral_l{layer}_s{sign * s:+g}")
        keys = [k for k in ref if k.startswith("neutral_s") and float(k.split("_s")[1]) * sign > 0]
        near = min(keys, key=lambda k: abs(change(ref, k)[1] - dr))
        lp, lr = change(ref, near)
        out.append(
            f"- {word} positive: {name} {sign * s:+g} moves positivity {dp:+.0f} points at a {dr:+.0f}% perplexity "
            f"rise; LM-Steer at the nearest rise ({near.split('_s')[1]} x eps0, {lr:+.0f}%) moves it {lp:+.0f} "
            "points."
        )
        if "positivity_per_prompt" in m["neutral_base"] and "positivity_per_prompt" in ref["neutral_base"]:
            v = versus((m, f"neutral_l{layer}_s{sign * s:+g}"), (ref, near))
            out[-1] += (
                f" {name} minus LM-Steer: {sign * v['difference']:+.0f} points in the steered direction, 95% "
                f"interval {sign * v['p2.5' if sign > 0 else 'p97.5']:+.0f} to "
                f"{sign * v['p97.5' if sign > 0 else 'p2.5']:+.0f} (prompts resampled together)."
            )
    theirs = ref["neutral_base"]["values"]["samples"]
    if theirs != samples:
        same = f"LM-Steer's run has {theirs} samples per prompt, not these: compare the changes only"
    elif abs(m["neutral_base"]["positivity"] - ref["neutral_base"]["positivity"]) < 1e-9:
        same = "The two runs score the same unsteered samples with the same evaluator"
    else:
        same = (
            f"The two evaluators differ (same unsteered samples: {m['neutral_base']['positivity']:.0%} here, "
            f"{ref['neutral_base']['positivity']:.0%} for LM-Steer's)"
        )
    out.append(
        f"- Each row is {prompts * samples} samples ({prompts} prompts x {samples}); the samples of one prompt are not "
        f"independent, so intervals resample prompts. {same}."
    )
    return out


if __name__ == "__main__":
    main()
