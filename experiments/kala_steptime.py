"""Measure train-step time of fine-tuning vs relational KALA (MiniLM) to size a protocol.

    XLA_FLAGS=... python experiments/kala_steptime.py --dataset conll --train-size 512 --steps 6
Prints the subword length distribution and the median step time per method.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from jsteer.kala import protocol as kala_ner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="conll")
    ap.add_argument("--train-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["finetune", "relational"])
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(kala_ner.JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import jsteer
    from jsteer.data import ner as ner_lib
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.model import KalaConfig

    spec = kala_ner.DATASETS[args.dataset]
    gdir = kala_ner.ensure_graph(args.dataset)
    lm = jsteer.load("minilm")
    t0 = time.time()
    data = pipeline.load_ner_data(kala_ner.DATA / spec["train"], kala_ner.DATA / spec["test"], gdir, lm.tokenizer,
                                  labels=getattr(ner_lib, spec["labels"]), scheme=spec["scheme"], max_len=512,
                                  train_size=args.train_size, test_size=200)
    lens = np.array([len(e["input_ids"]) for e in data.train])
    print(f"load {time.time() - t0:.0f}s; subword lengths: mean {lens.mean():.1f} p50 {np.median(lens):.0f} "
          f"p90 {np.percentile(lens, 90):.0f} p99 {np.percentile(lens, 99):.0f} max {lens.max()} "
          f"<=32 {np.mean(lens <= 32):.3f} <=64 {np.mean(lens <= 64):.3f}", flush=True)
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
    data = pipeline.load_ner_data(kala_ner.DATA / spec["train"], kala_ner.DATA / spec["test"], gdir, lm.tokenizer,
                                  labels=getattr(ner_lib, spec["labels"]), scheme=spec["scheme"],
                                  max_len=args.max_len, train_size=args.train_size, test_size=200)
    out = {}
    for m in args.methods:
        model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(method=m), memory)
        cfg = ktrain.TrainConfig(lr=1e-4, kala_lr=1e-3, max_steps=args.steps, max_len=args.max_len,
                                 batch_size=args.batch_size)
        t1 = time.time()
        fit = ktrain.fit(model, params, data.train, cfg)
        out[m] = dict(median_step=fit.median_step_seconds, compile=fit.compile_seconds, wall=time.time() - t1)
        print(m, json.dumps(out[m]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
