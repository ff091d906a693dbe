"""LM-Steer benchmarks (CPU): steered vs unsteered generation speed, and training steps/s
with cached hidden states vs a full frozen forward per step (the original's way).

    .venv/bin/python experiments/bench_steer.py [--small] [--reps 3]

--small uses the toy LLaMA (seconds; for CI / the notebook) instead of SmolLM2-135M.
Timings interleave the variants (A B A B ...) so background load hits both alike; each
number is the median over --reps after one warm-up (compile) call.
Writes experiments/results/steer/bench.json (or bench_small.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jsteer import perf
from jsteer.data.buckets import bucket
from jsteer.steer import data as steer_data
from jsteer.steer import head, protocol, toy, train
from jsteer.train import data_mesh
from jsteer.workspace import log, write_json


def timed(fn):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-texts", type=int, default=16)
    ap.add_argument("--rank", type=int, default=1000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-train", action="store_true", help="generation benchmark only")
    a = ap.parse_args()
    if a.small:
        lm = toy.lm(0)
        texts = toy.corpus(64, seed=0)[0]
        rank = min(a.rank, 16)
    else:
        import jsteer

        lm = jsteer.load("smollm2-135m")
        texts, _ = steer_data.sst5("train")
        texts = [t for t in texts if 15 <= len(t.split()) <= 30]
        rank = a.rank
    d, v = lm.config.hidden_size, lm.config.vocab_size
    res = {
        "model": "toy" if a.small else "SmolLM2-135M",
        "rank": rank,
        "reps": a.reps,
        "machine": perf.machine(),
        "jax": jax.__version__,
    }

    # ----------------------------------------------------------- generation
    prompts = (
        ["the movie was", "we saw the film and it"] * (a.batch // 2)
        if a.small
        else ["The movie was", "I think that the new"] * (a.batch // 2)
    )
    p = head.init(jax.random.PRNGKey(0), d, 2, rank=rank, scale=0.05)
    eps = head.make_eps(np.full((a.batch, 1), 5.0), 1e-3)
    hooks = head.to_hooks(p, eps)  # the default decoding path: cheapest exact form (expanded when 2R >= D)
    hooks_lowrank = head.to_hooks(p, eps, cheapest=False)  # forced low rank, for comparison
    gen = {
        "plain": lambda: lm.generate(prompts, max_new_tokens=a.new_tokens, hooks=None),
        "steered": lambda: lm.generate(prompts, max_new_tokens=a.new_tokens, hooks=hooks),
        "steered_lowrank": lambda: lm.generate(prompts, max_new_tokens=a.new_tokens, hooks=hooks_lowrank),
    }
    for f in gen.values():
        f()  # compile
    times = {k: [] for k in gen}
    for _ in range(a.reps):
        for k, f in gen.items():
            times[k].append(timed(f))
    tok = a.batch * a.new_tokens
    res["generation"] = {
        k: {"seconds": float(np.median(t)), "tokens_per_s": tok / float(np.median(t))} for k, t in times.items()
    }
    res["generation"]["overhead_pct"] = 100 * (np.median(times["steered"]) / np.median(times["plain"]) - 1)
    res["generation"]["overhead_lowrank_pct"] = 100 * (
        np.median(times["steered_lowrank"]) / np.median(times["plain"]) - 1
    )
    res["generation"]["steered_form"] = "full W" if hooks.steer.w is not None else f"low rank {rank}"
    res["generation"]["setting"] = (
        f"greedy, batch {a.batch}, {a.new_tokens} new tokens, S=2 steers of rank {rank}; "
        f"'steered': head.to_hooks default (cheapest exact form: "
        f"{res['generation']['steered_form']}); 'steered_lowrank': forced P1 P2^T form"
    )
    log("generation", res["generation"])

    out = a.out or str(protocol.RESULTS / ("bench_small.json" if a.small else "bench.json"))
    if a.skip_train:
        old = json.loads(pathlib.Path(out).read_text()) if pathlib.Path(out).exists() else {}
        res["training"] = old.get("training")
        write_json(out, res)
        return
    # ----------------------------------------------------------- training step
    texts = texts[: a.train_texts]
    values = np.where(np.arange(len(texts)) % 2 == 0, 1.0, -1.0).astype(np.float32)
    encs, values, _ = train.encode_texts(lm.tokenizer, texts, values, max_len=64)
    t_len = bucket(max(len(e) for e in encs), (16,), "multiple")
    ids = np.zeros((len(encs), t_len), np.int32)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1
    cfg = train.TrainConfig(rank=rank, batch_size=len(encs))
    emb = jnp.asarray(lm.output_embeddings())

    def hidden_fn(bp, i, m):
        return lm.module.apply({"params": bp}, i, m).hidden

    t0 = time.perf_counter()
    cache = train.cache_hidden(jax.jit(lambda i, m: hidden_fn(lm.params, i, m)), encs, values, batch_size=len(encs))
    res_cache_s = time.perf_counter() - t0
    budget = int(-(-cache.num_tokens // 64) * 64)  # every token of these texts (same objective as below)
    params = train.init_params(cfg, d, v, 1)
    rng = np.random.default_rng(0)
    b_cached = train.sample_batch(cache, rng, cfg.batch_size, budget)
    b_full = {"ids": ids, "mask": mask, "values": values[:, None]}
    # each form trains its own copy on the engine train() uses (one device: the step, not the mesh, is timed)
    one = jax.devices()[:1]
    tr_cached = train.make_trainer(cfg, {"steer": params, "embedding": emb}, mesh=data_mesh(one))
    tr_full = train.make_trainer(
        cfg,
        {"steer": params, "embedding": emb, "backbone": lm.params},
        train.forward_loss_fn(hidden_fn, cfg),
        mesh=data_mesh(one),
    )
    steps = {
        "cached": lambda: tr_cached.train_step(b_cached, cfg.steps)["loss"],
        "full_forward": lambda: tr_full.train_step(b_full, cfg.steps)["loss"],
    }
    # same objective: both losses agree on the same texts
    l_c, l_f = float(steps["cached"]()), float(steps["full_forward"]())
    times = {k: [] for k in steps}
    for _ in range(a.reps):
        for k, f in steps.items():
            times[k].append(timed(f))
    res["training"] = {
        k: {"seconds_per_step": float(np.median(t)), "steps_per_s": 1.0 / float(np.median(t))} for k, t in times.items()
    }
    res["training"]["speedup"] = float(np.median(times["full_forward"]) / np.median(times["cached"]))
    res["training"]["setting"] = (
        f"{len(encs)} texts per step, {int(mask.sum())} real tokens "
        f"(padded to {ids.size} for the full forward, {budget} packed rows cached)"
    )
    res["training"]["loss_cached"], res["training"]["loss_full_forward"] = l_c, l_f
    res["training"]["one_time_cache_seconds_for_these_texts"] = res_cache_s
    log("training", res["training"])
    write_json(out, res)
    log("wrote", out)


if __name__ == "__main__":
    main()
