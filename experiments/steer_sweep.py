"""Held-out sweep of the sentiment steer's training recipe (rank, steps, lr, l2, steer values) on SmolLM2-135M.

    # sweep_smollm2.json (+ the main run's r1000):
    .venv/bin/python experiments/steer_sweep.py --configs r32,r8,r4,r8_s400
    .venv/bin/python experiments/steer_sweep.py --configs r1000,blacklist,offset --strengths 1,2,3,5 \
        --work /tmp/steer_exp_bl --out experiments/results/steer/sweep_smollm2_baselines.json
    .venv/bin/python experiments/steer_sweep.py --configs r1000,r1000_graded,r1000_graded_neutral,r1000_neutral \
        --strengths 1,1.25,1.5,1.75,2,3 --out experiments/results/steer/sweep_smollm2_graded.json
    .venv/bin/python experiments/steer_sweep.py --configs r1000_self --strengths 1,2,3,5,8 --work /tmp/steer_self \
        --out experiments/results/steer/sweep_smollm2_self.json         # ~15 min with the evaluators cached
    .venv/bin/python experiments/steer_sweep.py --configs r1000_self_s50,r1000_self_s400 --strengths 1,1.5,2,3,5 \
        --work /tmp/steer_self --out experiments/results/steer/sweep_smollm2_self_steps.json
    .venv/bin/python experiments/steer_sweep.py --configs r32_self,r8_self,r1000_self_s250 --strengths 1,2,3,4 \
        --work /tmp/steer_self --out experiments/results/steer/sweep_smollm2_self_rank.json
    .venv/bin/python experiments/steer_sweep.py --configs r32_self,r64_self,r16_self --strengths 3,4,5,6,8 \
        --samples 10 --test --work /tmp/steer_self --out experiments/results/steer/sweep_smollm2_self_lowrank.json
    .venv/bin/python experiments/steer_sweep.py --configs r32_self --strengths 3,4,5,6,8 --samples 25 --test \
        --work /tmp/steer_self --out experiments/results/steer/sweep_smollm2_self_lowrank25.json

Every config trains a sentiment steer from a hidden-state cache of the main run's 1600 SST-5
texts (``jsteer.steer.data.sentiment_steer_texts``; built once under ``--work``) and is scored on the
*held-out* neutral prompts of that run only (``prompts.held_out_select`` of its JSON; never the
reported test prompts), dummy off, at
steer values +-``--strengths`` x eps0: positivity (the MiniLM evaluator) and perplexity rise under
the unsteered model, the same generation settings and seeds as the main run's strength choice.
A config's summary follows the main run's rule (``steer_smollm2.SELECTION_RULE``): per
direction the best positivity among values with a perplexity rise <= 30%, and their gap.
``--test`` then scores those two chosen values once on the main run's reported neutral test
prompts (against the unsteered model on the same prompts and samples), so a recipe's held-out
choice gets a test number without anything being chosen on the test prompts.
Writes ``--out`` (default experiments/results/steer/sweep_smollm2.json; finished configs are skipped
on rerun). The main run's own steer is listed as ``main_run`` when the evaluator is the one that
scored it (the evaluator artifact is cached; a fresh machine retrains it, and then ``r1000`` is
the main recipe's rerun).

Config names: ``r<rank>`` (``rfull``: a full-rank W), or ``blacklist`` / ``offset`` (the issue's
baselines: a learned logit offset / context-vector offset, trained at ``train.BASELINE_EPS0`` and
decoded through the same steer hook, their values in units of that eps0), then optional ``_s<steps>``,
``_lr<lr>``, ``_l<l2>``, ``_graded``, ``_neutral``, ``_self``; defaults are the main run's (150 steps, lr 1e-2,
l2 1e-6, init 1e-2, binary steer values: SST-5 labels 3-4 -> +1, 0-1 -> -1, as the issue specifies).
``_graded`` trains on the same texts with the original LM-Steer code's values label / 2 - 1
(-1, -0.5, +0.5, +1). ``_neutral`` adds NEUTRAL_TEXTS texts of SST-5's neutral class at value 0
(the original code trains on all five classes; only the dummy steer fits these), about the
original's share of them (1624 of 8544). ``_self`` trains on SELF_TEXTS on-policy texts instead
(``jsteer.steer.data.self_generated_texts``): SmolLM2's own continuations of other neutral prompts,
the most and least positive by a labeler trained on the same 1600 SST-5 steer texts
(``jsteer.steer.steer_eval.get_labeler``), so the steer learns sentiment inside the model's own
distribution rather than SST-5's (whose domain shift the dummy steer exists to absorb).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

from jsteer.steer import data as steer_data
from jsteer.steer import evaluate as steer_eval
from jsteer.steer import protocol
from jsteer.steer.protocol import (
    BATCH,
    DEFAULTS,
    MAX_LEN,
    MAX_RISE,
    SELF_TEXTS,
    STEER_TEXTS,
    best_within_limit,
    parse_config,
)
from jsteer.workspace import log, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="r1000,r32,r8")
    ap.add_argument("--strengths", default="1,2,3,5")
    ap.add_argument("--work", default="/tmp/steer_exp2")
    ap.add_argument("--main-json", default=str(protocol.RESULTS / "smollm2.json"))
    ap.add_argument("--out", default=str(protocol.RESULTS / "sweep_smollm2.json"))
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--gen-batch", type=int, default=50)
    ap.add_argument(
        "--test",
        action="store_true",
        help="also score each config's held-out choice on the main run's reported neutral test "
        "prompts (a config already in --out is retrained for it: same seed, same steer)",
    )
    args = ap.parse_args(argv)
    configs = {n: parse_config(n) for n in args.configs.split(",")}
    strengths = [float(x) for x in args.strengths.split(",")]

    import jsteer
    from jsteer.steer import head, train

    main_res = json.loads(pathlib.Path(args.main_json).read_text())
    sel = main_res["prompts"]["held_out_select"]
    out_path = pathlib.Path(args.out)
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    scored_by = res.get("setup", {}).get("evaluator", "not recorded") if res.get("base") else None
    res["setup"] = {
        "prompts": f"{len(sel)} held-out neutral prompts of {pathlib.Path(args.main_json).name}",
        "samples_per_prompt": args.samples,
        "max_new_tokens": 20,
        "top_p": 0.9,
        "seed": 0,
        "dummy": "off",
        "strengths": strengths,
        "max_ppl_rise": MAX_RISE,
        "texts": f"the main run's {STEER_TEXTS} SST-5 steer texts"
        if not any(c.get("data") == "self" for c in configs.values())
        else f"{SELF_TEXTS} of SmolLM2's own continuations of other neutral prompts, labelled by a "
        f"classifier trained on the main run's {STEER_TEXTS} SST-5 steer texts",
        "init_scale": 1e-2,
        "eps0": 1e-3,
        "batch_size": BATCH,
        "tokens_per_batch": 768,
    }
    res.setdefault("configs", {})
    lm = jsteer.load("smollm2-135m")
    pos_clf = steer_eval.get("sentiment", jsteer.load("minilm"))
    clf = {k: pos_clf.meta.get(k) for k in ("accuracy", "epochs", "steps")}
    if scored_by not in (None, clf):
        raise SystemExit(
            f"{out_path} was scored by another sentiment evaluator ({scored_by}; now {clf}): "
            "its rows would not compare with new ones; write to a new --out"
        )
    res["setup"]["evaluator"] = clf
    emb = np.asarray(lm.output_embeddings(), np.float32)
    work = pathlib.Path(args.work)
    cache = steer_data.cached_hidden(
        lm,
        work / "cache_sentiment_labels.npz",  # values: [binary, graded]
        lambda: steer_data.sentiment_steer_texts(STEER_TEXTS),
        MAX_LEN,
        BATCH,
    )

    def evaluate(params, value, eps0=1e-3, prompt_list=sel):
        eps = jnp.broadcast_to(jnp.asarray([value * eps0, 0.0], jnp.float32), (args.gen_batch, 2))
        hooks = head.to_hooks(params, eps)
        t0 = time.time()
        samples = steer_eval.sample(
            lm,
            lambda b: hooks if b == args.gen_batch else head.to_hooks(params, jnp.broadcast_to(eps[:1], (b, 2))),
            prompt_list,
            args.samples,
            seed=0,
            batch=args.gen_batch,
        )
        m = steer_eval.summarize(lm, pos_clf, None, prompt_list, samples)
        m["seconds"] = time.time() - t0
        m["example"] = prompt_list[0] + " ||| " + samples[0][0]
        return m

    zero = head.init(jnp.zeros((2,), jnp.uint32), emb.shape[1], 2, rank=8, scale=0.0)  # the unsteered model
    if "base" not in res:
        res["base"] = evaluate(zero, 0.0)
        write_json(out_path, res)
    base_ppl = res["base"]["ppl_mean"]
    log("base", {k: round(v, 3) for k, v in res["base"].items() if isinstance(v, float)})
    test_prompts = main_res["prompts"]["neutral"]
    if args.test and "base_test" not in res:
        res["base_test"] = evaluate(zero, 0.0, prompt_list=test_prompts)
        res["base_test"]["prompts"] = (
            f"the {len(test_prompts)} reported neutral test prompts of {pathlib.Path(args.main_json).name}"
        )
        write_json(out_path, res)

    def score_test(name, row, params, eps0):
        """The held-out choice, scored once on the reported test prompts (nothing is chosen there)."""
        row["test"] = {}
        for key, v in (("positive", row["chosen"]["positive"]), ("negative", -row["chosen"]["negative"])):
            m = evaluate(params, v, eps0, prompt_list=test_prompts)
            m["ppl_rise"] = m["ppl_mean"] / res["base_test"]["ppl_mean"] - 1
            row["test"][key] = dict(m, value=v)
            log(name, "test", f"{v:+g}", f"pos {m['positivity']:.2f} rise {m['ppl_rise']:+.2f}")

    def choose(row):
        pv, pr = best_within_limit(row["table"], strengths, 1.0)
        nv, nr = best_within_limit(row["table"], strengths, -1.0)
        row["chosen"] = {
            "positive": pv,
            "negative": nv,
            "positivity_pos": pr["positivity"],
            "positivity_neg": nr["positivity"],
            "gap": pr["positivity"] - nr["positivity"],
        }

    # the main run's steer (r1000, 150 steps), already scored on these prompts by its strength choice
    # (only comparable when scored by the same evaluator)
    sel_table = main_res["strength_selection"]["sentiment"]
    same_clf = clf == {k: main_res["evaluators"]["sentiment"].get(k) for k in clf}
    if same_clf and all(f"off/s{sg * v:+g}" in sel_table for v in strengths for sg in (1, -1)):
        row = {
            "config": dict(DEFAULTS, rank=1000),
            "W_fro_norm": main_res["training"]["sentiment"]["W_fro_norm"]["steer"],
            "source": "steer_smollm2.py strength_selection (dummy off)",
            "table": {f"{sg * v:+g}": sel_table[f"off/s{sg * v:+g}"] for v in strengths for sg in (1, -1)},
        }
        choose(row)
        res["configs"]["main_run"] = row

    @functools.lru_cache(maxsize=None)
    def self_cache():
        """The on-policy texts' hidden states, built once per run (every '_self' config trains on them)."""
        labeler = steer_eval.get_labeler(pos_clf.enc, STEER_TEXTS)
        res.setdefault("labelers", {})[labeler.meta["name"]] = {
            k: labeler.meta.get(k) for k in ("accuracy", "test_texts", "train_texts", "epochs", "train")
        }
        exclude = [p for ps in main_res["prompts"].values() for p in ps]
        texts = lambda: steer_data.cached_self_texts(lm, labeler, SELF_TEXTS, exclude, work)  # noqa: E731
        return steer_data.cached_hidden(lm, work / f"cache_self{SELF_TEXTS}.npz", texts, MAX_LEN, BATCH)

    for name, cfg in configs.items():
        if name in res["configs"] and (not args.test or "test" in res["configs"][name]):
            continue
        tcfg = protocol.sweep_train_config(cfg)
        eps0 = tcfg.eps0
        col = ["binary", "graded"].index(cfg["labels"])
        data = cache
        if cfg.get("data") == "self":
            data = self_cache()
        if cfg["neutral_texts"]:
            n_neutral = cfg["neutral_texts"]
            neutral = steer_data.cached_hidden(
                lm,
                work / f"cache_sentiment_neutral{n_neutral}.npz",
                lambda n=n_neutral: steer_data.sentiment_neutral_texts(n),
                MAX_LEN,
                BATCH,
            )
            data = train.HiddenCache.concat([cache, neutral])
        params, hist = train.train(dataclasses.replace(data, values=data.values[:, col : col + 1]), emb, tcfg)
        if name in res["configs"]:  # scored on held-out before: only the test scores are new
            row = res["configs"][name]
            score_test(name, row, params, eps0)
            write_json(out_path, res)
            continue
        row = {
            "config": cfg,
            "eps0": eps0,
            "train_seconds": hist["seconds"],
            "final_loss": hist["final_loss"],
            "table": {},
        }
        if tcfg.kind == "steer":
            w = np.asarray(head.full_matrix({k: jnp.asarray(v) for k, v in params.items()}))
            row["W_fro_norm"] = float(np.linalg.norm(w[0]))
        else:  # the user steer's offset b [V] or v [D]
            row["param_fro_norm"] = float(np.linalg.norm(np.asarray(next(iter(params.values())))[0]))
        for v in strengths:
            for sgn in (1.0, -1.0):
                m = evaluate(params, sgn * v, eps0)
                m["ppl_rise"] = m["ppl_mean"] / base_ppl - 1
                row["table"][f"{sgn * v:+g}"] = m
                log(name, f"{sgn * v:+g}", f"pos {m['positivity']:.2f} rise {m['ppl_rise']:+.2f}")
        choose(row)
        if args.test:
            score_test(name, row, params, eps0)
        res["configs"][name] = row
        log(name, row["chosen"])
        write_json(out_path, res)
    print(
        "\n| config | param norm | + value | positivity | - value | positivity | gap |\n|---|---|---|---|---|---|---|"
    )
    for name, row in res["configs"].items():
        c = row["chosen"]
        norm = row.get("W_fro_norm", row.get("param_fro_norm"))
        print(
            f"| {name} | {norm:.0f} | +{c['positive']:g} | {c['positivity_pos']:.2f} | "
            f"-{c['negative']:g} | {c['positivity_neg']:.2f} | {c['gap']:.2f} |"
        )
    tested = {n: r["test"] for n, r in res["configs"].items() if "test" in r}
    if tested:
        b = res["base_test"]
        print(
            f"\nOn the reported test prompts (unsteered: positivity {b['positivity']:.2f}, "
            f"ppl {b['ppl_mean']:.2f}):\n"
            "| config | + value | positivity | ppl rise | - value | positivity | ppl rise |"
            "\n|---|---|---|---|---|---|---|"
        )
        for n, t in tested.items():
            p, m = t["positive"], t["negative"]
            print(
                f"| {n} | {p['value']:+g} | {p['positivity']:.2f} | {p['ppl_rise']:+.0%} | "
                f"{m['value']:+g} | {m['positivity']:.2f} | {m['ppl_rise']:+.0%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
