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

Writes experiments/results/typevec/analysis.json (+ analysis.md, kurtosis.png, layers.png); the tables
and plots are :mod:`jsteer.typevec.analysis_report` (notebooks/type_embeddings.ipynb shows the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from jsteer.data.buckets import PROBE
from jsteer.typevec.analysis_report import OUT, markdown, plots
from jsteer.workspace import DATA, ROOT, log

KG = DATA / "type_embedding" / "kg_samples"
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
