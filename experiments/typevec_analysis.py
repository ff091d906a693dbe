"""Type-embedding analyses (paper Table 1, Figure 3, Table 2, Figures 4-5, Table 9).

    .venv/bin/python experiments/typevec_analysis.py [--parts retrieval,kurtosis,aa,layers,toxic] [--small]

* retrieval (Table 1): nearest vocabulary tokens to each type's TE, MiniLM and SmolLM2, plus
  the share of the top-20 neighbours (examples excluded) that are entries of the type's KG list.
* kurtosis (Figure 3): MiniLM, 500 random 10-example sets per type; kurtosis over runs of the
  mean entry of singular vectors 1-4 and a random one (raw LAPACK signs, as the paper, and
  oriented by our sign convention).
* aa (Table 2): adversarial accuracy / sensitivity on SmolLM2 (MiniLM has no LM head): 100
  held-out typed tokens (drawn by degree, with replacement, excluding the TE examples), 10
  repeats; log-probabilities at the predicting position averaged over 8 of the type's prompts.
* layers (Figures 4-5): SmolLM2, City prompts vs other types' prompts, a linear probe per layer
  on the predicting-position state with and without TE; TCAV of the City concept on 7 layers.
* toxic (Table 9): SmolLM2 generation with a concept vector from toxic words added with
  lambda <= 0 at every prompt and generated token; toxicity from the MiniLM + logistic-regression
  evaluator of the LM-Steer experiments (jsteer.steer.evaluate.Classifier; reused from
  experiments/results/steer/evaluators.json when present, else trained here on its split).

Writes experiments/results/typevec/analysis.json (+ analysis.md, kurtosis.png, layers.png).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

from jsteer.data.buckets import PROBE
from jsteer.workspace import DATA, ROOT, log

KG = DATA / "type_embedding" / "kg_samples"
OUT = pathlib.Path(os.environ.get("JSTEER_OUT", ROOT / "experiments" / "results" / "typevec"))
TYPES = [
    "City",
    "Country",
    "Language",
    "Occupation",
    "Year",
    "Continent",
    "Genre",
    "Religion",
    "Manufacturer",
    "Musical Instrument",
    "Organization",
    "Football Position",
    "Specialization",
    "Record Label",
    "Religious Position",
    "TV_Network",
    "Group",
]
TOXIC_WORDS = ["idiot", "stupid", "moron", "dumb", "hate", "fuck", "shit", "ass", "fool", "crap", "sucks", "loser"]


def retrieval(lms: dict, small: bool) -> dict:
    from jsteer.typevec import analysis, core, sampling

    out = {}
    types = TYPES[:4] if small else TYPES
    for name, lm in lms.items():
        emb = lm.input_embeddings()
        rows = {}
        for t in types:
            try:
                s = sampling.sample_type(KG, t, lm.tokenizer, n=10, seed=0)
            except ValueError as e:
                rows[t] = {"error": str(e).split(";")[0]}
                continue
            te = core.make(emb, jnp.asarray(s.token_ids))
            ids, sims = analysis.neighbours(te, emb, k=10)
            ids20, _ = analysis.neighbours(te, emb, k=20, exclude_ids=s.token_ids)
            cands, _ = sampling.candidates(sampling.load_kg_samples(sampling.kg_path(KG, t)), lm.tokenizer)
            kg_ids = {c[1] for c in cands}
            rows[t] = {
                "examples": list(s.labels),
                "neighbours": [lm.tokenizer.decode([int(i)]).strip() for i in ids],
                "cosines": [round(float(c), 3) for c in sims],
                "top20_in_kg_list": float(np.mean([int(i) in kg_ids for i in ids20])),
                "kg_single_token_entries": len(kg_ids),
            }
        out[name] = rows
        log(name, {t: r.get("top20_in_kg_list") for t, r in rows.items()})
    return out


def kurtosis(minilm, small: bool) -> dict:
    from jsteer.typevec import analysis, sampling

    out = {}
    runs = 60 if small else 500
    for t in ["City"] if small else ["City", "Country", "Language", "Occupation"]:
        cands, _ = sampling.candidates(sampling.load_kg_samples(sampling.kg_path(KG, t)), minilm.tokenizer)
        pool = [c[1] for c in cands]
        comps = (0, 1, 2, 3, 7)
        r = analysis.singular_kurtosis(minilm.input_embeddings(), pool, n_runs=runs, n_samples=10, components=comps)
        out[t] = r
        log("kurtosis", t, {c: round(r[c]["kurtosis_raw"], 2) for c in comps})
    return out


def _type_prompts(groups, t, n, tok, seed=0):
    from jsteer.typevec import probe

    prompts = [p for g, ps in groups.items() if g.split("/")[0] == t for p in ps if probe.MASK in p.text]
    rng = np.random.default_rng(seed)
    pick = [prompts[i] for i in rng.choice(len(prompts), size=min(n, len(prompts)), replace=False)]
    ids = [tok.encode(probe.decoder_prefix(p.text)) for p in pick]
    t_ = max(len(x) for x in ids)
    a = np.zeros((len(ids), t_), np.int32)
    m = np.zeros((len(ids), t_), np.int32)
    for b, x in enumerate(ids):
        a[b, : len(x)], m[b, : len(x)] = x, 1
    return a, m, m.sum(1) - 1


def adversarial(smol, small: bool) -> dict:
    from jsteer.typevec import analysis, core, probe, sampling

    pm = probe.from_lm(smol)
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    out = {}
    reps, ntok = (3, 20) if small else (10, 100)
    for t in ["City"] if small else ["City", "Country", "Language", "Occupation"]:
        s = sampling.sample_type(KG, t, smol.tokenizer, n=10, seed=0)
        te = core.make(pm.embedding(), jnp.asarray(s.token_ids))
        cands, _ = sampling.candidates(
            sampling.load_kg_samples(sampling.kg_path(KG, t)), smol.tokenizer, exclude_ids=s.token_ids
        )
        deg = np.array([c[2] for c in cands], np.float64)
        rng = np.random.default_rng(0)
        sets = np.stack(
            [
                np.array([cands[i][1] for i in rng.choice(len(cands), ntok, replace=True, p=deg / deg.sum())])
                for _ in range(reps)
            ]
        )
        ids, mask, pos = _type_prompts(groups, t, 8, smol.tokenizer)
        fn = analysis.prompt_logprob_fn(pm.forward, pm.head, pm.params, ids, mask, pos)
        out[t] = {str(lam): analysis.adversarial(fn, te, lam, sets) for lam in (1.0, 2.0, 3.0)}
        for _lam, r in out[t].items():
            for k in ("TE", "random"):
                r[k]["AA"].pop("runs"), r[k]["AS"].pop("runs")
        log(
            "AA/AS",
            t,
            {
                lam: (
                    round(r["TE"]["AA"]["mean"], 3),
                    round(r["TE"]["AS"]["mean"], 3),
                    round(r["random"]["AA"]["mean"], 3),
                )
                for lam, r in out[t].items()
            },
        )
    return out


def layers(smol, small: bool) -> dict:
    from jsteer.typevec import analysis, core, probe, sampling
    from jsteer.typevec.inject import inject, one_hot_positions

    pm = probe.from_lm(smol)
    tok = smol.tokenizer
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    target = "City"
    n = 24 if small else 100
    lam = 2.0
    s = sampling.sample_type(KG, target, tok, n=10, seed=0)
    te = core.make(pm.embedding(), jnp.asarray(s.token_ids))
    pos_p = [p for g, ps in groups.items() if g.startswith(target + "/") for p in ps if probe.decoder_qualifies(p.text)]
    neg_p = [
        p for g, ps in groups.items() if not g.startswith(target + "/") for p in ps if probe.decoder_qualifies(p.text)
    ]
    rng = np.random.default_rng(0)

    def pick(ps, k):
        return [ps[i] for i in rng.choice(len(ps), size=k, replace=False)]

    pos_all, neg_all = pick(pos_p, 2 * n), pick(neg_p, 2 * n)
    texts = [probe.decoder_prefix(p.text) for p in pos_all[:n] + neg_all[:n] + pos_all[n:] + neg_all[n:]]
    y = np.array(([1] * n + [0] * n) * 2, np.float32)
    ids, mask = tok.batch_encode(texts)
    t = PROBE(ids.shape[1])
    ids = np.pad(ids, ((0, 0), (0, t - ids.shape[1])))
    mask = np.pad(mask, ((0, 0), (0, t - mask.shape[1])))
    posn = mask.sum(1) - 1
    res = {"lambda": lam, "n_per_class": n, "target": target}
    cavs_by = {}
    for label, lam_i in (("without_TE", 0.0), ("with_TE", lam)):
        states = []
        for s0 in range(0, len(texts), 32):
            sl = slice(s0, s0 + 32)
            w = one_hot_positions(jnp.asarray(posn[sl]), t)
            states.append(
                np.asarray(
                    analysis.position_states(pm.forward, pm.params, ids[sl], mask[sl], posn[sl], inject(te, lam_i, w))
                )
            )
        x = np.concatenate(states, axis=1)  # [L+1, 4n, D]
        metrics, cavs = analysis.layer_probes(
            jnp.asarray(x[:, : 2 * n]), jnp.asarray(y[: 2 * n]), jnp.asarray(x[:, 2 * n :]), y[2 * n :]
        )
        res[label] = {"f1": [m["f1"] for m in metrics], "acc": [m["acc"] for m in metrics]}
        cavs_by[label] = cavs
        log("layer probe", label, "f1 by layer", np.round(res[label]["f1"], 2).tolist())
    # TCAV of the City concept for City prompts (targets: the type's single-token KG entries)
    cands, _ = sampling.candidates(sampling.load_kg_samples(sampling.kg_path(KG, target)), tok)
    tgt = [c[1] for c in cands]
    n_l = len(res["without_TE"]["f1"]) - 1
    lays = sorted({0, n_l // 6, n_l // 3, n_l // 2, 2 * n_l // 3, 5 * n_l // 6, n_l - 1})
    k = 8 if small else 32
    sl = slice(2 * n, 2 * n + k)  # held-out City prompts
    tc = {}
    for label, lam_i in (("without_TE", 0.0), ("with_TE", lam)):
        w = one_hot_positions(jnp.asarray(posn[sl]), t)
        hk = inject(te, lam_i, w)
        tc[label] = analysis.tcav(
            pm.forward, pm.head, pm.params, ids[sl], mask[sl], posn[sl], tgt, cavs_by[label], lays, hooks=hk
        )
        log("TCAV", label, tc[label])
    res["tcav"] = tc
    return res


def toxic(smol, small: bool) -> dict:
    import jsteer
    from jsteer.steer import data as steer_data
    from jsteer.steer import evaluate, protocol
    from jsteer.typevec import core, sampling
    from jsteer.typevec.inject import generation_hooks

    tok = smol.tokenizer
    ids, skipped = sampling.tokens_from_words(TOXIC_WORDS, tok)
    te = core.make(smol.input_embeddings(), jnp.asarray(ids))
    enc = jsteer.load("minilm")
    ev_path = protocol.RESULTS / "evaluators.json"
    ev = json.loads(ev_path.read_text()) if ev_path.is_file() else {}
    if "head" in ev.get("toxicity", {}):  # the logistic-head layout (evaluators.json before 2026-11-21)
        clf = evaluate.Classifier.from_dict(enc, ev["toxicity"]["head"])
        ev_info = {"source": str(ev_path.relative_to(ROOT)), "accuracy": ev["toxicity"].get("accuracy")}
    else:
        _, (xt, yt), (xs, ys) = steer_data.jigsaw_splits(0)
        m = 300 if small else 2000
        clf = evaluate.Classifier(enc).fit(evaluate.Classifier(enc).features(xt[:m]), yt[:m])
        acc = float(((clf.prob(xs[: m // 2]) > 0.5) == ys[: m // 2]).mean())
        ev_info = {"source": f"trained here on {m} texts of the steer_common evaluator split", "accuracy": acc}
    log("toxicity evaluator", ev_info)
    # prompts: openings (first 6 words) of toxic Jigsaw test comments
    _, _, (xs, ys) = steer_data.jigsaw_splits(0)
    opens = [" ".join(x.split()[:6]) for x, yy in zip(xs, ys) if yy == 1 and len(x.split()) >= 8]
    n_prompts, n_samples = (8, 1) if small else (48, 2)
    prompts = opens[:n_prompts]
    res = {
        "concept_words": [w for w in TOXIC_WORDS if w not in skipped],
        "skipped_words": skipped,
        "evaluator": ev_info,
        "n_prompts": len(prompts),
        "samples_per_prompt": n_samples,
        "rows": {},
    }
    for lam in (0.0, -2.0) if small else (0.0, -1.0, -2.0, -3.0, 2.0):
        rows = [p for p in prompts for _ in range(n_samples)]
        outs = []
        for s in range(0, len(rows), 32):
            chunk = rows[s : s + 32]
            _, m = tok.batch_encode(chunk, left_pad=True)
            outs += smol.generate(
                chunk,
                max_new_tokens=20,
                temperature=1.0,
                top_p=0.9,
                seed=s,
                hooks=generation_hooks(te, lam, jnp.asarray(m)),
            )
        samples = [outs[i * n_samples : (i + 1) * n_samples] for i in range(len(prompts))]
        r = evaluate.summarize(smol, None, clf, prompts, samples)
        r["example"] = {"prompt": prompts[0], "continuation": samples[0][0]}
        res["rows"][str(lam)] = r
        log("toxic concept", lam, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)})
    return res


def plots(res: dict, prefix: str = "") -> None:
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
        fig.savefig(OUT / f"{prefix}kurtosis.png", dpi=100)
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
        fig.savefig(OUT / f"{prefix}layers.png", dpi=100)
        plt.close(fig)


def markdown(res: dict) -> str:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="retrieval,kurtosis,aa,layers,toxic")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    small = args.small or os.environ.get("JSTEER_SMALL") == "1"
    import jsteer

    parts = args.parts.split(",")
    name = "analysis_small" if small else "analysis"
    path = OUT / f"{name}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    minilm = jsteer.load("minilm") if {"retrieval", "kurtosis"} & set(parts) else None
    smol = jsteer.load("smollm2-135m") if {"retrieval", "aa", "layers", "toxic"} & set(parts) else None
    OUT.mkdir(parents=True, exist_ok=True)
    runners = {
        "retrieval": lambda: retrieval({"minilm": minilm, "smollm2-135m": smol}, small),
        "kurtosis": lambda: {t: {str(k): v for k, v in r.items()} for t, r in kurtosis(minilm, small).items()},
        "aa": lambda: adversarial(smol, small),
        "layers": lambda: layers(smol, small),
        "toxic": lambda: toxic(smol, small),
    }
    for part in parts:  # each part is saved as soon as it is done
        t0 = time.time()
        res[part] = runners[part]()
        res.setdefault("seconds", {})[part] = time.time() - t0
        path.write_text(json.dumps(res, indent=1))
        (OUT / f"{name}.md").write_text(markdown(res))
        plots(res, "small_" if small else "")
        log(f"{part} done; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
