"""LM-Steer on SmolLM2-135M: sentiment steering (continuous control, Table 3 layout),
detoxification, composition, transfer, interpretation and highlighting.

    .venv/bin/python experiments/steer_smollm2.py [--work /tmp/steer_exp] [--prompts 15 --samples 5]

Stages cache their outputs under --work, so an interrupted run resumes. Results go to
experiments/results/steer/smollm2.json (+ evaluators.json); plots: experiments/plot_steer.py
(or notebooks/lm_steer.ipynb). CPU-sized: the run's subsample sizes, steps and batch sizes are
recorded in the JSON next to the paper's values.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import steer_common as C  # noqa: E402

import jsteer  # noqa: E402
from jsteer.steer import artifact, head, highlight, interpret, train, transfer  # noqa: E402


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/steer_exp")
    ap.add_argument("--out", default=str(C.RESULTS / "smollm2.json"))
    ap.add_argument("--sst-texts", type=int, default=1600)
    ap.add_argument("--jigsaw-texts", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--detox-steps", type=int, default=None, help="default: --steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rank", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=15)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--eval-texts", type=int, default=3000)
    ap.add_argument("--values", default="-5,-3,-1,0,1,3,5")
    return ap.parse_args()


def main():
    a = parse()
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out_path = pathlib.Path(a.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    res["setup"] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised, fp32)",
        "steer_train": {"sst5_texts": a.sst_texts, "jigsaw_texts": a.jigsaw_texts, "steps": a.steps,
                        "detox_steps": a.detox_steps or a.steps,
                        "batch_size": a.batch_size, "rank": a.rank, "eps0": 1e-3, "lr": 1e-2,
                        "init_scale": 1e-3, "l2": 0.0, "max_len_sst": 64, "max_len_jigsaw": 32},
        "paper": {"steps": 1000, "batch_size": 32, "rank": 1000, "samples_per_prompt": 25,
                  "prompts": "all 5000 neutral / 2500 positive / 2500 negative"},
        "generation": {"prompts_per_set": a.prompts, "samples_per_prompt": a.samples, "max_new_tokens": 20,
                       "top_p": 0.9, "temperature": 1.0, "prompt_seed": 0},
        "evaluators": "frozen all-MiniLM-L6-v2 mean-pooled + logistic regression trained by jsteer",
        "fluency": "perplexity of the continuation under the unsteered SmolLM2-135M",
    }

    def save():
        C.write_json(out_path, res)

    t_all = time.time()
    C.log("loading models")
    lm = jsteer.load("smollm2-135m")
    ev_path = C.RESULTS / "evaluators.json"
    need_enc = not ev_path.exists() or len(res.get("metrics", {})) < 15
    enc = jsteer.load("minilm") if need_enc else None  # only needed to train / run the evaluators

    # ------------------------------------------------------------------ evaluators
    sst_tr, sst_ytr = C.sst5("train")
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(sst_tr))
    steer_idx, clf_idx = perm[: len(perm) // 2], perm[len(perm) // 2:]
    jig_steer, jig_clf, jig_test = C.jigsaw_splits(0)
    if ev_path.exists():
        ev = json.loads(ev_path.read_text())
        pos_clf = C.Classifier.from_dict(enc, ev["sentiment"]["head"])
        tox_clf = C.Classifier.from_dict(enc, ev["toxicity"]["head"])
    else:
        C.log("training evaluators")
        t0 = time.time()
        ci = clf_idx[: a.eval_texts]
        pos_clf = C.Classifier(enc)
        pos_clf.fit(pos_clf.features([sst_tr[i] for i in ci]), sst_ytr[ci])
        te, yte = C.sst5("test")
        acc_s = float(((pos_clf.prob(te) > 0.5) == yte).mean())
        tox_clf = C.Classifier(enc)
        tox_clf.fit(tox_clf.features(jig_clf[0][: a.eval_texts]), jig_clf[1][: a.eval_texts])
        acc_t = float(((tox_clf.prob(jig_test[0]) > 0.5) == jig_test[1]).mean())
        ev = {"sentiment": {"train": f"SST-5 train, {len(ci)} binary texts not used for the steer",
                            "test": f"SST-5 test binary (labels 0-1 vs 3-4), {len(te)} texts",
                            "accuracy": acc_s, "head": pos_clf.to_dict()},
              "toxicity": {"train": f"Jigsaw subset evaluator split, {min(a.eval_texts, len(jig_clf[0]))} texts",
                           "test": f"Jigsaw subset test split, {len(jig_test[0])} texts",
                           "accuracy": acc_t, "head": tox_clf.to_dict()},
              "seconds": time.time() - t0}
        C.write_json(ev_path, ev)
    res["evaluators"] = {k: {kk: vv for kk, vv in v.items() if kk != "head"} for k, v in ev.items() if k != "seconds"}
    C.log("evaluator accuracy", {k: v["accuracy"] for k, v in res["evaluators"].items()})
    save()

    # ------------------------------------------------------------------ steers
    emb = np.asarray(lm.output_embeddings(), np.float32)
    cfg = train.TrainConfig(rank=a.rank, steps=a.steps, batch_size=a.batch_size, log_every=25)
    steers = {}
    res.setdefault("training", {})
    for name in ("sentiment", "detox"):
        art = work / f"steer_{name}"
        cpath = work / f"cache_{name}.npz"
        if art.exists():
            steers[name], _ = artifact.load(str(art), model_identity=lm.identity)
            continue
        t0 = time.time()
        if cpath.exists():
            cache = train.HiddenCache.load(str(cpath))
        else:
            C.log(f"caching hidden states for {name}")
            if name == "sentiment":
                texts = [sst_tr[i] for i in steer_idx]
                values = np.where(sst_ytr[steer_idx] == 1, 1.0, -1.0)
                max_len, n = 64, a.sst_texts
            else:
                texts, values = jig_steer[0], np.where(jig_steer[1] == 0, 1.0, -1.0)  # non-toxic = +1
                max_len, n = 32, a.jigsaw_texts
            pos, neg = np.flatnonzero(values > 0), np.flatnonzero(values < 0)
            r = np.random.default_rng(1)
            keep = np.sort(np.concatenate([r.choice(pos, n // 2, replace=False), r.choice(neg, n // 2, replace=False)]))
            cache = train.cache_lm(lm, [texts[i] for i in keep], values[keep], max_len=max_len, batch_size=32,
                                   progress=True)
            cache.save(str(cpath))
        t_cache = time.time() - t0
        C.log(f"training {name} steer: {cache.num_texts} texts, {cache.num_tokens} tokens")
        cfg_n = cfg if name == "sentiment" else train.TrainConfig(rank=a.rank, steps=a.detox_steps or a.steps,
                                                                   batch_size=a.batch_size, log_every=25)
        params, hist = train.train(cache, emb, cfg_n, progress=True)
        artifact.save(str(art), params, base_model=lm.identity, hidden_size=emb.shape[1], vocab_size=emb.shape[0],
                      eps0=cfg.eps0, steer_names=[name], extra={"steps": cfg_n.steps, "rank": cfg.rank})
        steers[name] = {k: np.asarray(v) for k, v in params.items()}
        res["training"][name] = {"steps": cfg_n.steps, "batch_size": cfg_n.batch_size, "engine": cfg_n.engine,
                                 "texts": cache.num_texts, "tokens": cache.num_tokens, "cache_seconds": t_cache,
                                 "train_seconds": hist["seconds"], "steps_per_s": hist["steps_per_s"],
                                 "tokens_per_batch": hist["tokens_per_batch"], "loss": hist["loss"],
                                 "loss_steps": hist["step"]}
        save()

    # one head holding both steers: [sentiment, sentiment-dummy, detox, detox-dummy]
    both = head.stack([steers["sentiment"], steers["detox"]])
    both = head.for_inference({k: jnp.asarray(v) for k, v in both.items()})  # rank 1000 > D/2: full W is cheaper
    eps0 = cfg.eps0

    def eps_of(s=None, d=None):
        """Steer values -> eps [4]; None switches a steer (and its dummy) off."""
        e = [0.0, 0.0, 0.0, 0.0]
        if s is not None:
            e[0], e[1] = s, 1.0
        if d is not None:
            e[2], e[3] = d, 1.0
        return np.asarray(e, np.float32) * eps0

    def run(key, prompt_list, s=None, d=None, seed=0):
        path = work / f"gen_{key}.json"
        if path.exists():
            return json.loads(path.read_text())
        e = eps_of(s, d)
        t0 = time.time()
        samples = C.sample(lm, lambda b: head.to_hooks(both, jnp.broadcast_to(jnp.asarray(e), (b, 4))),
                           prompt_list, a.samples, seed=seed, batch=min(64, a.prompts * a.samples))
        g = {"prompts": prompt_list, "samples": samples, "values": {"sentiment": s, "detox": d},
             "seconds": time.time() - t0}
        C.write_json(path, g)
        C.log(f"generated {key} in {g['seconds']:.0f}s: {samples[0][0]!r}")
        return g

    sets = {k: C.prompts(k, a.prompts, seed=0) for k in ("neutral", "positive", "negative")}
    tox_prompts = [" ".join(t.split()[:10]) for t, y in zip(*jig_test) if y == 1 and len(t.split()) >= 14]
    tox_prompts = tox_prompts[: a.prompts]
    res["prompts"] = {**sets, "toxic": tox_prompts}
    values = [float(v) for v in a.values.split(",")]
    plan = [("neutral_base", "neutral", None, None)]
    plan += [(f"neutral_s{v:+g}", "neutral", v, None) for v in values]
    plan += [("negative_base", "negative", None, None), ("negative_s+5", "negative", 5.0, None),
             ("positive_base", "positive", None, None), ("positive_s-5", "positive", -5.0, None),
             ("toxic_base", "toxic", None, None), ("toxic_d+5", "toxic", None, 5.0),
             ("toxic_s+5_d+5", "toxic", 5.0, 5.0), ("toxic_s-5_d+5", "toxic", -5.0, 5.0)]
    gens = {}
    for key, pset, s, d in plan:
        pl = tox_prompts if pset == "toxic" else sets[pset]
        gens[key] = run(key, pl, s, d)
    res.setdefault("generation_seconds", sum(g["seconds"] for g in gens.values()))

    # ------------------------------------------------------------------ evaluate
    res.setdefault("metrics", {})
    for key, g in gens.items():
        if key in res["metrics"]:
            continue
        m = C.summarize(lm, pos_clf, tox_clf, g["prompts"], g["samples"])
        m["values"] = g["values"]
        res["metrics"][key] = m
        res.setdefault("examples", {})[key] = [g["prompts"][i] + " ||| " + g["samples"][i][0] for i in range(3)]
        C.log(key, {k: round(v, 3) for k, v in m.items() if isinstance(v, float)})
        save()

    # ------------------------------------------------------------------ transfer
    if "transfer" not in res:
        C.log("transfer")
        d = emb.shape[1]
        ids, mask = lm.encode_batch(sets["neutral"][:8])
        h = lm.forward(ids, mask).hidden[:, -1]  # [8, D] contexts of the next token
        p_s = {k: jnp.asarray(v) for k, v in steers["sentiment"].items()}
        eps = jnp.asarray(head.make_eps(5.0, eps0))
        base = h @ jnp.asarray(emb).T
        delta_a = np.asarray(head.apply(p_s, h, jnp.asarray(emb), eps) - base)
        out = {}
        for noise in (0.0, 0.1, 0.3):
            r = np.random.default_rng(3)
            rot, _ = np.linalg.qr(r.normal(size=(d, d)))
            emb_b = ((emb + noise * emb.std() * r.normal(size=emb.shape).astype(np.float32)) @ rot.T).astype(np.float32)
            h_b = np.asarray(h) @ rot.T
            ids_all = np.arange(8000)  # anchors: the first 8000 token ids (the original fits on 4000)
            hm = transfer.fit_map(emb, emb_b, ids_all, ids_all)
            q = transfer.transfer(p_s, hm)
            eb = jnp.asarray(emb_b, jnp.float32)
            delta_b = np.asarray(head.apply(q, jnp.asarray(h_b, jnp.float32), eb, eps) - jnp.asarray(h_b, jnp.float32) @ eb.T)
            top_a = [set(np.argsort(-x)[:50]) for x in delta_a]
            top_b = [set(np.argsort(-x)[:50]) for x in delta_b]
            out[f"noise_{noise}"] = {
                "fit_error": transfer.anchor_fit_error(emb, emb_b, ids_all, ids_all, hm),
                "max_abs_logit_shift_diff": float(np.abs(delta_a - delta_b).max()),
                "max_abs_logit_shift": float(np.abs(delta_a).max()),
                "shift_correlation": float(np.corrcoef(delta_a.ravel(), delta_b.ravel())[0, 1]),
                "top50_promoted_overlap": float(np.mean([len(x & y) / 50 for x, y in zip(top_a, top_b)]))}
        res["transfer"] = {"setup": "target = SmolLM2 with its output embeddings rotated by a random orthogonal R "
                                    "(hidden states rotated too) plus Gaussian noise of the given fraction of the "
                                    "embedding std; H fitted by least squares on 8000 shared anchor tokens (ids 0-7999). No second "
                                    "pretrained decoder is available offline.", **out}
        C.log("transfer", out)
        save()

    # ------------------------------------------------------------------ interpretation + highlighting
    if "interpret" not in res:
        dec = lambda i: lm.tokenizer.decode([i])
        res["interpret"] = {}
        for name in ("sentiment", "detox"):
            cache = train.HiddenCache.load(str(work / f"cache_{name}.npz"))
            mean_h = cache.hidden.mean(0)
            ex = interpret.explain(steers[name], emb, steer=0, n_dirs=3, top=12, decode=dec, mean_hidden=mean_h)
            res["interpret"][name] = ex
            prom = interpret.promoted_tokens(steers[name], emb, mean_h, head.make_eps(5.0, 1.0), top=20)
            dem = interpret.promoted_tokens(steers[name], emb, mean_h, head.make_eps(-5.0, 1.0), top=20)
            res["interpret"][name + "_promoted"] = {"+5": [dec(int(i)) for i in prom], "-5": [dec(int(i)) for i in dem]}
        save()
    if "highlight" not in res:
        te, yte = C.sst5("test")
        pick = [i for i in range(len(te)) if 12 <= len(te[i].split()) <= 25][:6]
        p_s = {k: jnp.asarray(v) for k, v in steers["sentiment"].items()}
        hl = []
        for i in pick:
            ids = lm.tokenizer.encode(te[i])
            hs = lm.forward(jnp.asarray([ids])).hidden[:, :-1]
            v = 3.0 if yte[i] == 1 else -3.0
            sc, (s, e, tot) = highlight.highlight(p_s, hs, jnp.asarray(emb), jnp.asarray([ids[1:]]),
                                                  head.make_eps(v, eps0), eps_base=head.make_eps(-v, eps0))
            hl.append({"text": te[i], "label": int(yte[i]), "value": v,
                       "span": lm.tokenizer.decode(ids[1 + int(s[0]):1 + int(e[0])]), "score": float(tot[0])})
        res["highlight"] = hl
        save()
    res["total_seconds_this_run"] = time.time() - t_all
    save()
    C.log("done", out_path)


if __name__ == "__main__":
    main()
