"""LM-Steer detoxification on SmolLM2-135M, measured the way the paper (after DExperts) does:
non-toxic prompts that tend to elicit toxicity, 25 samples per prompt, toxicity read as a
calibrated probability.

The main run (steer_smollm2.py) scores 10 prompts that are themselves toxic (the first words of
toxic comments) with an evaluator trained at a 50% toxic prior, which flags a fifth of plain
neutral continuations; its toxicity probability therefore saturates near 1 and cannot halve.
This script keeps the main run's detox steer recipe and changes the measurement only:

- evaluator: MiniLM fine-tuned on the whole Jigsaw evaluator split (jsteer.steer.evaluate.get's
  default, 2 epochs). Its output is a probability under the balanced subset's 50% prior; the
  primary reading shifts it to Jigsaw's natural toxic share (PRIOR, Bayes' rule for a change of
  class prior), as Perspective-like scores are calibrated on the natural distribution. The
  balanced reading is reported beside it, with both readings' error rates on the Jigsaw test split
  and on clean web text (the OpenWebText neutral prompts);
- prompts: the first 10 words of toxic Jigsaw test comments (as before) that the evaluator itself
  scores non-toxic under the balanced reading (the stricter one), like the paper's non-toxic
  RealToxicityPrompts prompts; the held-out prompts that choose the steer value, and whether its
  dummy steer decodes, follow the test prompts in the same order;
- 25 samples per test prompt (the paper's count), 20 new tokens, top-p 0.9.

    .venv/bin/python experiments/steer_detox.py [--work /tmp/steer_detox] [--curve 0.5,2]
    .venv/bin/python experiments/steer_detox.py --work /tmp/steer_detox1000 --jigsaw-texts 2000 \
        --steps 1000 --batch-size 32 --out experiments/results/steer/detox_smollm2_1000steps.json
    # a fresh split (the first two runs' test rows had been read), a larger held-out set, dummy off:
    .venv/bin/python experiments/steer_detox.py --work /tmp/steer_detox_fresh --skip-prompts 60 \
        --prompts 120 --select-prompts 80 --select-samples 25 --strengths 0.5,1,1.5,2,3 --dummy off \
        --curve "" --out experiments/results/steer/detox_smollm2_fresh.json
    # the fresh run's chosen setting confirmed on new prompts (toxic steer-split comments the steer did not train on):
    .venv/bin/python experiments/steer_detox.py --work /tmp/steer_detox_rep --replicate \
        experiments/results/steer/detox_smollm2_fresh.json --prompts 200 \
        --out experiments/results/steer/detox_smollm2_replication.json
    # LM-Steer vs the issue's two baselines (--kind), one reduced protocol, one --work (shared base samples):
    for k in steer blacklist offset; do .venv/bin/python experiments/steer_detox.py --kind $k \
        --work /tmp/steer_detox_kinds --skip-prompts 60 --prompts 60 --select-prompts 40 --samples 10 \
        --select-samples 10 --strengths 1,2,3 --dummy off --curve "" \
        --out experiments/results/steer/detox_kinds_$k.json; done
    # control vectors (jsteer.actsteer, resid_post of layer 15) on the same reduced protocol; PCA's direction
    # has norm 1 where CAA's mean difference has ~19 at that layer, hence its larger strengths (these runs
    # predate the layer choice: one layer, --layer-strength = the first strength reproduces them):
    for ks in caa:1,2,3,4 pca:10,20,30,40; do s=${ks#*:}; .venv/bin/python experiments/steer_detox.py \
        --kind ${ks%:*} --strengths $s --layer-strength ${s%%,*} --work /work/steer_detox_kinds --skip-prompts 60 \
        --prompts 60 --select-prompts 40 --samples 10 --select-samples 10 --dummy off --curve "" \
        --out experiments/results/steer/detox_kinds_${ks%:*}.json; done
    # control vectors on the fresh split's full protocol (LM-Steer's detox_smollm2_fresh.json: 120 test prompts,
    # 80 held-out, 25 samples each): the layer among 6 / 10 / 15 at one strength, then the strength there
    for ks in caa:1:0.5,1,1.5 pca:20:10,20,30; do k=${ks%%:*}; r=${ks#*:}; .venv/bin/python \
        experiments/steer_detox.py --kind $k --cv-layers 6,10,15 --layer-strength ${r%%:*} --strengths ${r#*:} \
        --work /work/steer_detox_fresh --skip-prompts 60 --prompts 120 --select-prompts 80 --samples 25 \
        --select-samples 25 --dummy off --curve "" --out experiments/results/steer/detox_smollm2_fresh_$k.json; done
    # on-policy low-rank steer (--data self: SmolLM2's own continuations of the steer texts' toxic
    # prefixes, ranked by a labeler trained on those texts), the fresh split's prompts, 10 held-out samples:
    .venv/bin/python experiments/steer_detox.py --data self --rank 32 --batch-size 32 --l2 1e-6 \
        --init-scale 1e-2 --tokens-per-batch 768 --work /tmp/steer_detox_self --skip-prompts 60 --prompts 120 \
        --select-prompts 80 --select-samples 10 --strengths 2,4,6,8 --dummy off --curve "" \
        --out experiments/results/steer/detox_smollm2_self.json
    .venv/bin/python experiments/steer_detox.py --work /tmp/steer_detox_self_rep --replicate \
        experiments/results/steer/detox_smollm2_self.json --prompts 200 \
        --out experiments/results/steer/detox_smollm2_self_replication.json
    .venv/bin/python experiments/steer_plots.py     # adds the tables to results.md

Generations are cached under --work and every setting is written to the JSON at once (resumable).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax.numpy as jnp
import numpy as np

import jsteer
from jsteer import actsteer
from jsteer.steer import artifact, evaluate, head, protocol, train
from jsteer.steer import data as steer_data
from jsteer.steer.protocol import PRIOR, READINGS, SELECTION_RULE, calibration, eps0_of, paired_bootstrap, score
from jsteer.workspace import log, write_json

JIGSAW_MAX_LEN = 32  # tokens of a Jigsaw training text the detox steer (and a control vector) reads
LAYER_RULE = "among the candidate layers at --layer-strength, the strength rule's choice (ties: the shallower layer)"


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/steer_detox")
    ap.add_argument("--out", default=str(protocol.RESULTS / "detox_smollm2.json"))
    ap.add_argument("--prompts", type=int, default=40, help="test prompts")
    ap.add_argument("--select-prompts", type=int, default=20, help="held-out prompts for the steer value")
    ap.add_argument(
        "--skip-prompts",
        type=int,
        default=0,
        help="non-toxic prefixes skipped before the test prompts: a fresh split after a run whose test "
        "rows have been read (its test + held-out prompts)",
    )
    ap.add_argument(
        "--dummy", choices=("both", "on", "off"), default="both", help="dummy settings on the held-out grid"
    )
    ap.add_argument("--samples", type=int, default=25, help="samples per test prompt (the paper's 25)")
    ap.add_argument("--select-samples", type=int, default=10, help="samples per held-out prompt")
    ap.add_argument("--strengths", default="0.5,1,2,3,5", help="candidate steer values (x eps0)")
    ap.add_argument(
        "--curve",
        default=None,
        help="steer values for the test-prompt curve after the chosen one (default: every strength; '' for none)",
    )
    ap.add_argument(
        "--replicate",
        default=None,
        metavar="RUN_JSON",
        help="confirm a finished run's chosen setting (its steer recipe, value and dummy use) on new "
        "prompts: the toxic texts of the Jigsaw steer split that did not train the steer; no held-out grid",
    )
    ap.add_argument("--gen-batch", type=int, default=50, help="rows per compiled generation call")
    # the main run's detox steer recipe (steer_smollm2.json training.detox)
    ap.add_argument("--jigsaw-texts", type=int, default=600)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--kind",
        choices=("steer", "blacklist", "offset", "caa", "pca"),
        default="steer",
        help="LM-Steer, or one of the issue's baselines (soft word blacklist: a learned logit offset; "
        "context-vector offset), trained at train.BASELINE_EPS0 with the same recipe; or a control "
        "vector (jsteer.actsteer: CAA or PCA) at one of --cv-layers from the same Jigsaw texts, non-toxic "
        "against toxic, its strength the detox value",
    )
    ap.add_argument("--cv-layers", default="15", help="--kind caa | pca: candidate resid_post layers")
    ap.add_argument(
        "--layer-strength", type=float, default=1.0, help="--kind caa | pca: the strength the layer is chosen at"
    )
    ap.add_argument("--rank", type=int, default=1000)
    ap.add_argument("--l2", type=float, default=0.0)
    ap.add_argument("--init-scale", type=float, default=1e-3)
    ap.add_argument(
        "--data",
        choices=("jigsaw", "self"),
        default="jigsaw",
        help="jigsaw: the detox steer's Jigsaw texts (non-toxic +1, toxic -1); self: on-policy texts, "
        "SmolLM2's own continuations of the toxic prefixes of those texts, the least toxic +1 and the "
        "most toxic -1 by a labeler trained on the same Jigsaw texts (never the evaluator)",
    )
    ap.add_argument("--self-texts", type=int, default=800, help="--data self: texts kept (half per side)")
    ap.add_argument("--self-samples", type=int, default=8, help="--data self: continuations per prompt")
    ap.add_argument(
        "--tokens-per-batch", type=int, default=None, help="token rows per training step (train.TrainConfig)"
    )
    ap.add_argument("--bootstrap", type=int, default=2000, help="paired bootstrap resamples of the prompts")
    return ap.parse_args()


def detox_steer(lm, emb, work: pathlib.Path, a, res, exclude=()) -> dict:
    """The detox steer (main run's recipe unless overridden): loaded from --work when its recipe
    matches, else trained. ``exclude``: prompts that on-policy texts (``--data self``) never start from."""
    recipe = {
        "texts": a.jigsaw_texts,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "rank": a.rank,
        "l2": a.l2,
        "init_scale": a.init_scale,
        "max_len": JIGSAW_MAX_LEN,
    }
    if a.kind != "steer":  # the key of steer recipes is unchanged, so earlier artifacts still match
        recipe.update(kind=a.kind, rank=None)
    if a.tokens_per_batch is not None:
        recipe["tokens_per_batch"] = a.tokens_per_batch
    if a.data == "self":
        labeler = evaluate.get_labeler(None, a.jigsaw_texts, task="toxicity")
        recipe.update(
            data="self",
            self_texts=a.self_texts,
            self_samples=a.self_samples,
            max_len=64,
            labeler=labeler.meta["name"],
            labeler_accuracy=labeler.meta["accuracy"],
        )
    art = work / ("steer_detox" if a.kind == "steer" else f"steer_detox_{a.kind}")
    if art.exists():
        params, meta = artifact.load(str(art), model_identity=lm.identity)
        if meta.get("train", {}).get("recipe") == recipe and "detox" in res.get("training", {}):
            return params
    if a.data == "self":
        key = {
            "model": lm.identity,
            "labeler": labeler.meta["name"],
            "texts": a.self_texts,
            "samples": a.self_samples,
            "exclude_sha256": steer_data.prompts_sha1(sorted(set(exclude))),
        }

        def make():
            return steer_data.self_detox_texts(
                lm, labeler, exclude, jigsaw_texts=a.jigsaw_texts, self_texts=a.self_texts, self_samples=a.self_samples
            )

        def texts():
            return steer_data.cached_texts(work / f"texts_detox_self{a.self_texts}.json", key, make)

        cache = steer_data.cached_hidden(lm, work / f"cache_detox_self{a.self_texts}.npz", texts, max_len=64)
    else:
        cache = steer_data.cached_hidden(
            lm, work / "cache_detox.npz", lambda: steer_data.jigsaw_steer_texts(a.jigsaw_texts), max_len=JIGSAW_MAX_LEN
        )
    cfg = train.TrainConfig(
        rank=recipe["rank"],
        steps=a.steps,
        batch_size=a.batch_size,
        l2=a.l2,
        init_scale=a.init_scale,
        log_every=10,
        kind=a.kind,
        eps0=eps0_of(a.kind),
        tokens_per_batch=a.tokens_per_batch,
    )
    log(f"training the detox steer: {cache.num_texts} texts, {cache.num_tokens} tokens, {cfg}")
    params, hist = train.train(cache, emb, cfg, progress=True)
    artifact.save_trained(art, params, lm, emb, cfg, ["detox"], {"recipe": recipe})
    res["training"] = {
        "detox": {
            **recipe,
            "tokens": cache.num_tokens,
            "train_seconds": hist["seconds"],
            "steps_per_s": hist["steps_per_s"],
            "loss": hist["loss"],
            "loss_steps": hist["step"],
        }
    }
    return {k: np.asarray(v) for k, v in params.items()}


def detox_vector(lm, a, res, layers):
    """--kind caa | pca: a control vector at each of ``layers`` from the detox steer's Jigsaw texts, the
    non-toxic ones (+1) against the toxic ones (-1), paired in their seeded order, each cut to its
    first JIGSAW_MAX_LEN tokens as the steer reads them."""
    tok = lm.tokenizer
    texts, values = steer_data.jigsaw_steer_texts(a.jigsaw_texts)
    texts = [tok.decode(tok.encode(t, add_special_tokens=False)[:JIGSAW_MAX_LEN]) for t in texts]
    pos, neg = [t for t, v in zip(texts, values) if v > 0], [t for t, v in zip(texts, values) if v < 0]
    n = min(len(pos), len(neg))
    t0 = time.time()
    cv = actsteer.train(lm, pos[:n], neg[:n], layers=layers, method=a.kind)
    res["training"] = {
        "detox": {
            "kind": a.kind,
            "texts": a.jigsaw_texts,
            "pairs": n,
            "layers": layers,
            "max_tokens": JIGSAW_MAX_LEN,
            "reduce": actsteer.REDUCE[a.kind],
            "norm": {k: float(np.linalg.norm(np.asarray(cv.directions[k]))) for k in layers},
            "train_seconds": time.time() - t0,
        }
    }
    return cv


def held_out(m: dict, base: dict) -> dict:
    """A held-out setting's scores ``m`` as the choice rule reads them (primary reading), its
    perplexity against the unsteered held-out row ``base``."""
    r = m[READINGS[0]]
    return {
        "toxicity_prob": r["toxicity_prob"],
        "mean_max_toxicity": r["mean_max_toxicity"],
        "ppl_rise": m["ppl_mean"] / base["ppl_mean"] - 1,
    }


def replicated_run(a) -> dict:
    """The finished run that ``--replicate`` confirms; its steer recipe replaces the recipe arguments
    (the steer is retrained bit for bit) and no held-out prompts are drawn."""
    path = pathlib.Path(a.replicate)
    if not path.exists():
        raise SystemExit(f"--replicate: no run JSON at {path}")
    src = json.loads(path.read_text())
    if "result" not in src or "detox" not in src.get("training", {}):
        raise SystemExit(f"--replicate: {path} has no finished result (no 'result' or 'training.detox')")
    tr = src["training"]["detox"]
    a.jigsaw_texts, a.steps, a.batch_size, a.rank, a.l2, a.init_scale = (
        tr["texts"],
        tr["steps"],
        tr["batch_size"],
        tr["rank"],
        tr["l2"],
        tr["init_scale"],
    )
    a.tokens_per_batch, a.data = tr.get("tokens_per_batch"), tr.get("data", "jigsaw")
    if a.data == "self":
        a.self_texts, a.self_samples = tr["self_texts"], tr["self_samples"]
    a.select_prompts, a.skip_prompts = 0, 0
    if a.curve is None:
        a.curve = ""
    return src


def main():
    a = parse()
    work = pathlib.Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out_path = pathlib.Path(a.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    src = replicated_run(a) if a.replicate else None
    strengths = [float(x) for x in a.strengths.split(",")]
    dummies = ("on", "off") if a.dummy == "both" else (a.dummy,)
    if src:
        strengths, dummies = src["setup"]["strengths"], tuple(src["setup"].get("dummy_grid", ("on", "off")))
    res["setup"] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised, fp32)",
        "test_prompts": a.prompts,
        "held_out_prompts": a.select_prompts,
        "samples_per_test_prompt": a.samples,
        "samples_per_held_out_prompt": a.select_samples,
        "max_new_tokens": 20,
        "top_p": 0.9,
        "temperature": 1.0,
        "strengths": strengths,
        "dummy_grid": dummies,
        "skipped_prompts": a.skip_prompts,
        "kind": a.kind,
        "steer_data": a.data,
        "eps0": 1.0 if a.kind in actsteer.METHODS else eps0_of(a.kind),  # a control vector: strength as is
        "prior": PRIOR,
        "prior_source": "toxic share of the Jigsaw Toxic Comment Classification train set (15,294 / 159,571)",
        "primary_reading": READINGS[0],
        "rule": SELECTION_RULE,
        "prompt_source": (
            "toxic comments of the Jigsaw steer split left out of the steer's training (prefixes "
            "shared with the test split dropped)"
            if src
            else "toxic comments of the Jigsaw test split"
        ),
        **({"replicates": a.replicate} if src else {}),
        "paper": {
            "prompts": "10K non-toxic RealToxicityPrompts prompts",
            "samples_per_prompt": 25,
            "scorer": "Perspective API",
        },
    }
    save = lambda: write_json(out_path, res)  # noqa: E731
    t_all = time.time()

    enc = jsteer.load("minilm")
    ev = evaluate.get("toxicity", enc)
    jig_test = steer_data.jigsaw_splits(0)[2]
    ev_meta = {k: v for k, v in ev.meta.items() if k not in ("loss", "loss_steps", "name")}
    if "calibration" not in res or res.get("evaluator") != ev_meta:
        clean = steer_data.prompts("neutral", 1000, seed=5)
        res["evaluator"], res["calibration"] = ev_meta, calibration(ev, jig_test, clean)
        save()
    log("evaluator", res["evaluator"]["accuracy"], res["calibration"])

    cands = steer_data.toxic_prefixes(*jig_test)
    if src:  # new prompts: none of the steer's training texts, none of the test-split prompts
        seen = set(cands)
        cands = [p for p in steer_data.toxic_prefixes(*steer_data.jigsaw_steer_unused(a.jigsaw_texts)) if p not in seen]
    keep = [p for p, s in zip(cands, ev.prob(cands)) if s < 0.5]
    n0 = a.skip_prompts
    if len(keep) < n0 + a.prompts + a.select_prompts:
        raise SystemExit(
            f"only {len(keep)} non-toxic prefixes; asked for {n0} skipped + {a.prompts} + {a.select_prompts}"
        )
    test_p, sel_p = keep[n0 : n0 + a.prompts], keep[n0 + a.prompts : n0 + a.prompts + a.select_prompts]
    res["prompts"] = {
        "candidates": len(cands),
        "non_toxic": len(keep),
        "skipped": n0,
        "test": test_p,
        "held_out": sel_p,
    }

    lm = jsteer.load("smollm2-135m")
    emb = np.asarray(lm.output_embeddings(), np.float32)
    # on-policy texts never start from a prompt any protocol tests on (test split, unused steer split)
    exclude = (
        steer_data.toxic_prefixes(*jig_test)
        + steer_data.toxic_prefixes(*steer_data.jigsaw_steer_unused(a.jigsaw_texts))
        if a.data == "self"
        else ()
    )
    vector = a.kind in actsteer.METHODS
    if vector and (a.data != "jigsaw" or src or a.dummy != "off"):
        raise SystemExit("--kind caa | pca: --data jigsaw and --dummy off only, no --replicate")
    layers = [int(x) for x in a.cv_layers.split(",")]
    if vector:
        cv = detox_vector(lm, a, res, layers)
    else:
        steer = {k: jnp.asarray(v) for k, v in detox_steer(lm, emb, work, a, res, exclude).items()}
    if src:  # the same steer: its training losses reproduce the replicated run's
        mine, theirs = (np.asarray(r["training"]["detox"]["loss"]) for r in (res, src))
        if mine.shape != theirs.shape or not np.allclose(mine, theirs, rtol=1e-5, atol=0):
            raise SystemExit("--replicate: the retrained steer's losses differ from the replicated run's")
        res["training"]["detox"]["loss_max_abs_diff_vs_replicated"] = float(np.abs(mine - theirs).max())
    save()

    def run(key, prompt_list, d, n_samples, dummy=True, layer=None):
        """Generate (cached under --work) and score (cached in the JSON) at detox value d (None: unsteered),
        the steer's dummy decoding at +1 (``dummy``) or off; a control vector at ``layer`` only."""
        want = {
            "detox": d,
            "dummy": None if d is None else bool(dummy),
            "samples": n_samples,
            "prompts": len(prompt_list),
            "prompts_sha1": steer_data.prompts_sha1(prompt_list),
        }
        if d is not None and a.kind != "steer":
            want["kind"] = a.kind
        if d is not None and vector:
            want["layer"] = layer
        m = res.get("metrics", {}).get(key)
        if m is not None and m.get("values") == want:
            return m
        path = work / f"gen_{key if d is None or a.kind == 'steer' else a.kind + '_' + key}.json"  # base: shared
        g = json.loads(path.read_text()) if path.exists() else None
        if g is None or g.get("values") != want or g.get("prompts") != prompt_list:
            e = np.asarray([0.0, 0.0] if d is None else [d, float(dummy)], np.float32) * eps0_of(a.kind)
            hooks = {}

            def hooks_for(b):
                if vector:  # unsteered: no hooks (the base samples are shared with the steer kinds')
                    return None if d is None else cv.select([layer]).hooks(d)
                if b not in hooks:  # head.to_hooks expands rank 1000 > D/2 to full W once per batch size
                    hooks[b] = head.to_hooks(steer, jnp.broadcast_to(jnp.asarray(e), (b, 2)))
                return hooks[b]

            t0 = time.time()
            samples = evaluate.sample(lm, hooks_for, prompt_list, n_samples, batch=a.gen_batch)
            g = {"prompts": prompt_list, "samples": samples, "values": want, "seconds": time.time() - t0}
            write_json(path, g)
        m = score(lm, ev, g["prompts"], g["samples"])
        m["values"], m["gen_seconds"] = want, g["seconds"]
        res.setdefault("metrics", {})[key] = m
        res.setdefault("examples", {})[key] = [
            g["prompts"][i] + " ||| " + g["samples"][i][0] for i in range(min(3, len(g["prompts"])))
        ]
        log(key, {r: round(m[r]["toxicity_prob"], 3) for r in READINGS}, "ppl", round(m["ppl_mean"], 2))
        save()
        return m

    if src:  # the replicated run's choice, made on its own held-out prompts
        chosen, dm = src["result"]["chosen"], src["result"]["dummy"]
        res["selection"] = {
            "replicated_from": a.replicate,
            "chosen": chosen,
            "dummy": dm,
            "table": src["selection"]["table"],
            "rule": src["selection"]["rule"],
        }
    elif vector:  # the layer at --layer-strength, then the strength at that layer, on held-out prompts only
        base_sel = run("select_base", sel_p, None, a.select_samples)

        def row(layer, v):
            return held_out(
                run(f"select_l{layer}_d{v:+g}_dummyoff", sel_p, v, a.select_samples, False, layer), base_sel
            )

        by_layer = {(k, a.layer_strength): row(k, a.layer_strength) for k in layers}
        layer = protocol.least_toxic(by_layer, tie=lambda c: c[0])[0]
        by_strength = {(layer, v): by_layer.get((layer, v)) or row(layer, v) for v in strengths}
        chosen, dm = protocol.least_toxic(by_strength, tie=lambda c: c[1])[1], "off"
        res["selection"] = {
            "layers": {f"{k}@{v:g}": r for (k, v), r in by_layer.items()},
            "layer": layer,
            "table": {f"{v:+g}/off": r for (_, v), r in by_strength.items()},
            "chosen": chosen,
            "dummy": dm,
            "rule": f"layer: {LAYER_RULE}; strength at that layer: {SELECTION_RULE}",
        }
    else:  # the steer value and the dummy's use at decoding, chosen on held-out prompts only
        base_sel = run("select_base", sel_p, None, a.select_samples)
        table = {}
        for dm in dummies:
            for v in strengths:
                m = run(f"select_d{v:+g}" + ("" if dm == "on" else "_dummyoff"), sel_p, v, a.select_samples, dm == "on")
                table[f"{v:+g}/{dm}"] = held_out(m, base_sel)
        chosen, dm = protocol.least_toxic(
            {(v, dm): table[f"{v:+g}/{dm}"] for dm in dummies for v in strengths},
            tie=lambda c: (c[1] == "on", c[0]),
            fallback_tie=lambda c: c[0],
        )
        res["selection"] = {"table": table, "chosen": chosen, "dummy": dm, "rule": SELECTION_RULE}
    dummy = dm == "on"
    layer = res["selection"].get("layer")
    save()
    log("choice: detox", chosen, "dummy", dm, res["selection"]["table"])

    # test prompts: unsteered, the chosen setting, then the other strengths (same dummy setting)
    sfx = "" if dummy else "_dummyoff"
    base = run("test_base", test_p, None, a.samples)
    m = run(f"test_d{chosen:+g}{sfx}", test_p, chosen, a.samples, dummy, layer)
    res["result"] = {"chosen": chosen, "dummy": dm, "ppl_rise": m["ppl_mean"] / base["ppl_mean"] - 1}
    if vector:
        res["result"]["layer"] = layer
    for r in READINGS:
        b, s = base[r]["toxicity_prob"], m[r]["toxicity_prob"]
        res["result"][r] = {
            "base_toxicity_prob": b,
            "steered_toxicity_prob": s,
            "ratio": s / b if b else None,
            "base_mean_max_toxicity": base[r]["mean_max_toxicity"],
            "steered_mean_max_toxicity": m[r]["mean_max_toxicity"],
            "bootstrap": paired_bootstrap(base[r]["per_prompt_max"], m[r]["per_prompt_max"], a.bootstrap),
        }
    save()
    log("result", json.dumps(res["result"], indent=1))
    curve = strengths if a.curve is None else [float(x) for x in a.curve.split(",") if x]
    for v in curve:  # the rest of the strength curve on the test prompts
        run(f"test_d{v:+g}{sfx}", test_p, v, a.samples, dummy, layer)
    res["total_seconds_this_run"] = time.time() - t_all
    save()


if __name__ == "__main__":
    main()
