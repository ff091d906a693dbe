"""Train the demo's shipped sentiment steer (``jsteer/assets/sentiment_steer_r32.safetensors``).

    PYTHONPATH=. .venv/bin/python experiments/demo_steer.py        # ~5 min on the 2-core CPU

The recipe is ``steer_sweep.py``'s config ``r32``, exactly: the main run's 1600 class-balanced
SST-5 texts of the steer half of train (``jsteer.steer.data.sentiment_steer_texts``, binary
values, hidden states cut at 64 tokens), rank 32, 150 steps, lr 1e-2, l2 1e-6, init 1e-2,
batch 32, 768 tokens per batch, seed 0, a domain-shift ("dummy") steer trained alongside. The
sweep scored that recipe with the dummy steer off, so the artifact keeps only the sentiment steer
(rank 32: 2 x 576 x 32 floats, ~150 KB). Its evaluation numbers are the sweep's committed ``r32``
row (``experiments/results/steer/sweep_smollm2.json``: positivity and perplexity rise of
SmolLM2's continuations of 10 held-out neutral prompts x 5 samples at each steer value, by the
MiniLM sentiment evaluator); this script retrains the recipe and records the new W's Frobenius
norm beside the sweep's, so that the two can be compared. Writes the artifact and its card
(``sentiment_steer_r32.json``: command, base model identity, training time, evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np

from jsteer.steer import data as steer_data
from jsteer.steer import protocol
from jsteer.steer.protocol import BATCH, MAX_LEN, STEER_TEXTS, parse_config
from jsteer.workspace import ROOT, log, write_json

CONFIG = "r32"
SWEEP = protocol.RESULTS / "sweep_smollm2.json"
ASSETS = ROOT / "jsteer" / "assets"
COMMAND = "PYTHONPATH=. .venv/bin/python experiments/demo_steer.py"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/steer_exp2", help="hidden-state cache (shared with steer_sweep.py)")
    ap.add_argument("--out", default=str(ASSETS / "sentiment_steer_r32.safetensors"))
    args = ap.parse_args(argv)

    import jsteer
    from jsteer.steer import artifact, head, train

    t_start = time.time()
    cfg = parse_config(CONFIG)
    lm = jsteer.load("smollm2-135m")
    emb = np.asarray(lm.output_embeddings(), np.float32)
    t0 = time.time()
    cache = steer_data.cached_hidden(
        lm,
        pathlib.Path(args.work) / "cache_sentiment_labels.npz",
        lambda: steer_data.sentiment_steer_texts(STEER_TEXTS),
        MAX_LEN,
        BATCH,
    )
    cache_s = time.time() - t0
    tcfg = protocol.sweep_train_config(cfg)
    params, hist = train.train(dataclasses.replace(cache, values=cache.values[:, 0:1]), emb, tcfg, progress=True)
    w = np.asarray(head.full_matrix({k: jnp.asarray(v) for k, v in params.items()}))
    norm = float(np.linalg.norm(w[0]))
    sweep = json.loads(SWEEP.read_text())
    row = sweep["configs"][CONFIG]
    log(f"W_fro_norm {norm:.2f} (the sweep's {CONFIG}: {row['W_fro_norm']:.2f}); final loss {hist['final_loss']:.4f}")

    user = {k: np.asarray(v)[:1] for k, v in params.items()}  # drop the dummy steer: scored off
    rel = lambda p: str(pathlib.Path(p).resolve().relative_to(ROOT))  # noqa: E731
    train_info = {
        "recipe": f"experiments/steer_sweep.py config {CONFIG}",
        "config": cfg,
        "texts": cache.num_texts,
        "tokens": cache.num_tokens,
        "max_len": MAX_LEN,
        "batch_size": BATCH,
        "tokens_per_batch": 768,
        "init_scale": 1e-2,
        "seed": tcfg.seed,
        "final_loss": hist["final_loss"],
        "dummy_dropped": "a domain-shift steer was trained alongside and dropped (the evaluation ran with it off)",
    }
    artifact.save(
        args.out,
        user,
        base_model=lm.identity,
        hidden_size=emb.shape[1],
        vocab_size=emb.shape[0],
        eps0=protocol.EPS0,
        dummy=False,
        steer_names=["sentiment"],
        extra=train_info,
    )
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
        commit = git("rev-parse", "HEAD") + (" (with uncommitted changes)" if git("status", "--porcelain") else "")
    except OSError:
        commit = None
    table = {v: {"positivity": r["positivity"], "ppl_rise": round(r["ppl_rise"], 4)} for v, r in row["table"].items()}
    card = {
        "artifact": rel(args.out),
        "command": COMMAND,
        "code_commit": commit,
        "base_model": {"name": "smollm2-135m", "identity": lm.identity},
        "kind": "lowrank",
        "rank": cfg["rank"],
        "eps0": protocol.EPS0,
        "value_unit": "steer values are in units of eps0 (the demo's -v / +v)",
        "train": train_info,
        "timing_seconds": {
            "hidden_cache": round(cache_s, 1),
            "train_steps": round(hist["seconds"], 1),
            "total": round(time.time() - t_start, 1),
        },
        "W_fro_norm": norm,
        "evaluation": {
            "source": f"{rel(SWEEP)} configs.{CONFIG} (committed; the same recipe, data and seed)",
            "W_fro_norm_there": row["W_fro_norm"],
            "setup": {k: sweep["setup"][k] for k in ("prompts", "samples_per_prompt", "max_new_tokens", "top_p")},
            "evaluator": "MiniLM sentiment classifier (experiments/steer_evaluators.py); positivity = share "
            "of continuations it calls positive",
            "unsteered": {"positivity": sweep["base"]["positivity"], "ppl_mean": sweep["base"]["ppl_mean"]},
            "table": table,
            "chosen": row["chosen"],
        },
    }
    card_path = pathlib.Path(args.out).with_suffix(".json")
    write_json(card_path, card)
    log(f"wrote {args.out} ({pathlib.Path(args.out).stat().st_size / 1e3:.0f} KB) and {card_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
