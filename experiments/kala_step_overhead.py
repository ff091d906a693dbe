"""Per-step cost of KALA over plain fine-tuning, measured interleaved (robust to machine drift).

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        python experiments/kala_step_overhead.py            # -> experiments/results/kala/step_overhead.json

kala_walltime.py times whole fits, one process after another; on this VM a process's KALA steps
run a few percent faster or slower than the next process's (same config, same values), which is
as large as the margin to the <= 1.15x target. Here one process compiles the train step (AdamW,
clipping, donated state: what :func:`jsteer.kala.train.fit` runs) of fine-tuning, point-wise and
relational KALA (+ entity dropout) once each, on the same CoNLL-2003 batches as
``walltime.json``'s protocol, and times them in rounds (a few steps of each method per round), so
drift hits all methods alike. Per length bucket T (the shapes a run trains on: 32 and 64
subwords, B = 16) and two backbones:

- ``minilm``: the embedded all-MiniLM-L6-v2 (6 layers, hidden 384; KFM at layers 3 and 5);
- ``bert-base``: BERT-base's shape (12 layers, hidden 768; KFM at layers 9 and 11, the paper's
  setting), randomly initialised: a step's time does not depend on the weights' values, and
  BERT-base weights are not available offline.

Also reported: each model's trainable parameters (the knowledge module's AdamW update is
bandwidth-bound, so its cost follows its size). ``--length-stats [DATASET]`` only prints the
protocol training subset's subword length distribution (the protocol's ``max_len`` and length
buckets come from it; formerly ``kala_steptime.py``, which also timed non-interleaved steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

from jsteer.kala import protocol
from jsteer.kala.protocol import COMMON, PROTOCOL

OUT = protocol.OUT / "step_overhead.json"
VARIANTS = ("finetune", "pointwise", "relational_edrop")


def step_fn(model, params, cfg, total: int):
    """The jitted, donated AdamW train step :func:`jsteer.kala.train.fit` runs (its Trainer's), and its state."""
    from jsteer.kala import train as ktrain

    trainer = ktrain.make_trainer(model, params, cfg, total, progress=False)  # copies params: never donates them
    step = trainer.step_fn(total)

    def f(state, frozen, batch, rng):  # rng unused: the Trainer's step folds its seed with the step number
        state, metrics = step(state, frozen, batch)
        return state, frozen, metrics["loss"]

    return f, [trainer.state, trainer.frozen]


def measure(backbone: str, lengths, rounds: int, per_round: int) -> dict:
    """{T: {variant: median step seconds}} and trainable parameter counts, interleaved."""
    import jax
    import jax.numpy as jnp

    import jsteer
    from jsteer.backbones.bert import BertConfig
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig

    proto = PROTOCOL["conll"]
    lm = jsteer.load("minilm")  # its tokenizer (BERT's uncased vocabulary) serves both backbones
    data = protocol.load_data(
        "conll", lm.tokenizer, max_len=proto["max_len"], train_size=proto["train_size"], test_size=1
    )
    if backbone == "minilm":
        config, encoder = lm.config, lm.params["encoder"]
        memory = protocol.cached_memory(protocol.graph_key("conll"), lm, data, proto["train_size"], proto["max_len"])
    else:
        config, encoder, memory = BertConfig(), None, None  # random init (memory too)
    cfg = protocol.train_config("conll", seed=0)
    total = cfg.total_steps(len(data.train))
    out: dict = {"params": {}, "steps": {}}
    methods = {}
    for v in VARIANTS:
        model, params = pipeline.build_model(
            config, encoder, data, KalaConfig(**protocol.variant_config(v)), memory, seed=0
        )
        out["params"][v] = ktrain.count_params(params)
        methods[v] = (model, *step_fn(model, params, cfg, total))
    for t in lengths:
        steps = {}
        for v, (model, f, state) in methods.items():
            stream = ktrain._Endless.for_model(model, data.train, cfg, "ner")
            batches = [
                jax.tree.map(jnp.asarray, b)
                for b in itertools.islice((b for b in stream if b["input_ids"].shape[1] == t), per_round)
            ]
            state[0], state[1], loss = f(state[0], state[1], batches[0], jax.random.PRNGKey(0))  # compile
            float(loss)
            steps[v] = (f, state, batches)
        times = {v: [] for v in steps}
        for r in range(rounds):
            for v, (f, state, batches) in steps.items():
                for i, b in enumerate(batches):
                    t0 = time.perf_counter()
                    state[0], state[1], loss = f(state[0], state[1], b, jax.random.PRNGKey(r * per_round + i))
                    float(loss)
                    times[v].append(time.perf_counter() - t0)
        med = {v: float(np.median(x)) for v, x in times.items()}
        out["steps"][str(t)] = {
            v: {
                "median_step_seconds": med[v],
                "ratio_to_finetune": med[v] / med["finetune"],
                "steps_timed": len(times[v]),
            }
            for v in med
        }
        print(
            backbone, f"T={t}", {v: f"{med[v] * 1e3:.1f} ms ({med[v] / med['finetune']:.3f}x)" for v in med}, flush=True
        )
    return out


def length_stats(dataset: str, train_size: int) -> str:
    """The subword length distribution of a protocol training subset, uncut (max_len 512): which
    length buckets a run's batches will take."""
    import jsteer

    lm = jsteer.load("minilm")
    data = protocol.load_data(dataset, lm.tokenizer, max_len=512, train_size=train_size, test_size=200)
    lens = np.array([len(e["input_ids"]) for e in data.train])
    return (
        f"{dataset}, {len(lens)} training sentences: subword lengths mean {lens.mean():.1f} p50 "
        f"{np.median(lens):.0f} p90 {np.percentile(lens, 90):.0f} p99 {np.percentile(lens, 99):.0f} max "
        f"{lens.max()} <=32 {np.mean(lens <= 32):.3f} <=64 {np.mean(lens <= 64):.3f}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbones", nargs="+", choices=("minilm", "bert-base"), default=["minilm", "bert-base"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=4, help="steps of each method per round (distinct batches)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--length-stats",
        nargs="?",
        const="conll",
        choices=sorted(protocol.DATASETS),
        default=None,
        metavar="DATASET",
        help="only print the subword length distribution of the protocol's training "
        "subset of DATASET (default conll; what kala_steptime.py printed)",
    )
    args = ap.parse_args(argv)
    if args.length_stats:
        ds = args.length_stats
        print(length_stats(ds, PROTOCOL[ds]["train_size"]))
        return 0
    res = {
        "protocol": {
            "dataset": "conll",
            **PROTOCOL["conll"],
            **COMMON,
            "rounds": args.rounds,
            "per_round": args.per_round,
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "backbones": {b: measure(b, args.lengths, args.rounds, args.per_round) for b in args.backbones},
    }
    out = pathlib.Path(args.out)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
