"""KALA on NER with MiniLM: the paper's Tables 1-3, Figure 4, the layer sweep and Table 11.

    python experiments/kala_ner.py --dataset conll --groups main --seeds 0 1 2
    python experiments/kala_ner.py --dataset ncbi --groups ablation layers --seeds 0

The protocol of the saved results (experiments/results/kala/ner_*.json; each dataset has its own
subset sizes, length and epochs, so one call per dataset; runs go seed-major, so an interrupted sweep
still has every variant's first seeds)::

    P="--batch-size 16 --lr 3e-4 --kala-lr 1e-3 --seeds 0 1 2"
    CONLL="--dataset conll --train-size 3000 --test-size 1000 --max-len 64 --epochs 2"
    NCBI="--dataset ncbi --train-size 700 --test-size 400 --max-len 128 --epochs 3"
    python experiments/kala_ner.py $CONLL $P --groups main --memory
    python experiments/kala_ner.py $CONLL $P --groups edrop --graph-rungs 2
    python experiments/kala_ner.py $NCBI $P --groups main ablation layers --memory
    python experiments/kala_ner.py $NCBI $P --groups edrop --graph-rungs 2

The whole-data runs (``ner_<dataset>_full.json``: every training and test sentence, the same
hyper-parameters, fine-tuning and the headline variant; about 2 hours for both datasets on 2 cores)::

    F="--train-size 100000 --test-size 100000 --groups main edrop --variants finetune relational_edrop"
    python experiments/kala_ner.py --dataset conll --max-len 64 --epochs 2 $P $F \
        --out experiments/results/kala/ner_conll_full.json
    python experiments/kala_ner.py --dataset ncbi --max-len 128 --epochs 3 $P $F \
        --out experiments/results/kala/ner_ncbi_full.json

NCBI-Disease on the whole data with the defined-term graph (``--graph-strategy abbreviation``,
:mod:`jsteer.kala.builder`) instead of the frequent-n-gram one; the two variants in two processes
side by side (one per core; each run's result is merged into the file as it ends)::

    A="--dataset ncbi --max-len 128 --epochs 3 --train-size 100000 --test-size 100000 --graph-strategy abbreviation"
    for V in "main --variants finetune --memory" "edrop --variants relational_edrop"; do
        python experiments/kala_ner.py $A $P --groups $V \
            --out experiments/results/kala/ner_ncbi_full_abbreviation.json &
    done; wait

The entity-dropout rate sweep on the dev split (``ner_<dataset>_dev.json``; the test runs' protocol;
``--graph-rungs`` only changes padding, the sweeps ran with the default 0)::

    python experiments/kala_ner.py $CONLL $P --eval-split dev --groups main edrop edrop_rates \
        --variants finetune relational_edrop relational_edrop10 relational_edrop50
    python experiments/kala_ner.py $NCBI $P --eval-split dev --groups main edrop edrop_rates \
        --variants finetune relational_edrop relational_edrop10 relational_edrop50 --memory

Groups (each run is one (variant, seed); finished runs in the output JSON are skipped, so an
interrupted sweep resumes):

- ``main``: plain fine-tuning, +one extra transformer layer ("more params"), KALA point-wise,
  KALA relational (KFM on the default layers 3 and 5 of MiniLM's 6). Table 1/2 + Table 11.
- ``ablation``: relational KALA with only gamma or only beta (Table 3).
- ``layers``: relational KALA with KFM on other layer sets (the layer-location sweep).
- ``edrop``: relational / point-wise KALA with entity dropout 0.3 (``KalaConfig.entity_dropout``:
  training nodes made null at random, as out-of-vocabulary test entities are).
- ``edrop_rates``: relational KALA with entity dropout 0.1 / 0.5 (with ``edrop``'s 0.3: the rate
  sweep), for choosing the rate with ``--eval-split dev`` (scores on a ``--test-size`` subset of
  the dev split, written to ``ner_<dataset>_dev.json``; the test split plays no part).

Every run also reports F1 on seen / unseen test contexts (Figure 4; see
:meth:`jsteer.kala.pipeline.NERData.subsets`), training wall time, examples/s, and (seed 0 of
``main``) the bytes XLA plans for one train step.

The knowledge graph comes from ``jsteer kala build-graph`` over the dataset's train + dev +
test token columns (no labels): capitalised-run lexicon for CoNLL-2003, frequent-n-gram lexicon
for NCBI-Disease; pattern-based within-sentence facts.

Budget (2 CPU cores shared with other jobs; run with ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`` there, which wastes less under contention): the training set is a
seeded random subset of ``--train-size`` sentences, the test set a subset of ``--test-size``
sentences of the official test split; ``--epochs`` epochs of batch ``--batch-size`` at length <=
``--max-len`` (length-bucketed; 99.6% of CoNLL-2003 training sentences fit 64 MiniLM subwords,
NCBI-Disease sentences are longer, hence 128 there). A short schedule (2 epochs on CoNLL-2003, 3 on
NCBI-Disease) with a higher lr than the paper's 5e-5 and batch 16 (more updates per CPU-second),
the same for every method. These subsets are far below the paper's full-data runs, so absolute F1
is lower; all methods share them. The protocol's pieces (data sets, variants, graphs, caches, one
run) are :mod:`jsteer.kala.protocol`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from jsteer.kala import protocol
from jsteer.kala.protocol import DATASETS, JAX_CACHE, LOGS, OUT, VARIANTS, graph_key


def per_dataset(values: list, datasets: list[str], name: str) -> dict:
    """One value for every dataset, or one per dataset (in ``--dataset`` order)."""
    if len(values) == 1:
        return {d: values[0] for d in datasets}
    if len(values) != len(datasets):
        raise SystemExit(f"--{name}: give one value or one per dataset ({len(datasets)}), got {values}")
    return dict(zip(datasets, values))


def main(argv=None) -> int:
    from jsteer.kala.mining import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dataset",
        nargs="+",
        choices=sorted(DATASETS),
        required=True,
        help="one or more datasets; runs go seed-major (seed 0 of every dataset first)",
    )
    ap.add_argument("--groups", nargs="+", default=["main"], choices=sorted(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--train-size", nargs="+", type=int, default=[400], help="one, or one per dataset")
    ap.add_argument("--test-size", nargs="+", type=int, default=[400], help="one, or one per dataset")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--kala-lr", type=float, default=1e-3)
    ap.add_argument("--graph-rungs", type=int, default=0, help="TrainConfig.graph_rungs (smaller graph buckets)")
    ap.add_argument("--max-len", nargs="+", type=int, default=[128], help="one, or one per dataset")
    ap.add_argument(
        "--graph-strategy",
        default=None,
        choices=STRATEGIES,
        help="the graph's lexicon strategy (jsteer.kala.builder), default: the dataset's (capitalised for "
        "conll, frequent for ncbi); another one builds runs/kala_graphs/<dataset>_<strategy>",
    )
    ap.add_argument("--model", default="minilm")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help="run only these variants of the groups, in this order (default: all, in table order)",
    )
    ap.add_argument(
        "--memory",
        nargs="*",
        default=None,
        help="variants whose step memory to measure (an extra compile; default: every main variant)",
    )
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="only measure each variant's step memory (compile, no training) into the JSON's "
        "'step_memory' (first seed's first batch: the same shapes for every variant)",
    )
    ap.add_argument(
        "--eval-split",
        choices=("test", "dev"),
        default="test",
        help="score on the official test split, or on the dev split to choose settings without "
        "touching test (default output ner_<dataset>_dev.json; --test-size then sizes dev)",
    )
    ap.add_argument("--out", default=None, help="output JSON (only with a single dataset)")
    ap.add_argument("--backfill", action="store_true", help="only fill median step times from the run logs")
    args = ap.parse_args(argv)
    if args.out and len(args.dataset) > 1:
        ap.error("--out needs a single --dataset")
    if args.backfill:
        for d in args.dataset:
            protocol.backfill_step_times(pathlib.Path(args.out) if args.out else OUT / f"ner_{d}.json", d)
        return 0

    import jax

    jax.config.update("jax_compilation_cache_dir", str(JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import jsteer
    from jsteer.kala import train as ktrain

    sizes = per_dataset(args.train_size, args.dataset, "train-size")
    tests = per_dataset(args.test_size, args.dataset, "test-size")
    lens = per_dataset(args.max_len, args.dataset, "max-len")
    lm = jsteer.load(args.model)
    state = {}  # dataset -> its setup, made when its first run comes (an interrupted sweep skips the rest)

    todo = [(g, v, kw) for g in args.groups for v, kw in VARIANTS[g]]
    if args.variants is not None:
        known = {v for _, v, _ in todo}
        bad = [v for v in args.variants if v not in known]
        if bad:
            ap.error(f"unknown variants {bad} for groups {args.groups}")
        todo = sorted([t for t in todo if t[1] in args.variants], key=lambda t: args.variants.index(t[1]))
    for seed in args.seeds[:1] if args.memory_only else args.seeds:
        for name in args.dataset:
            for group, variant, kw in todo:
                if name not in state:
                    state[name] = protocol.setup_dataset(
                        name,
                        lm,
                        model=args.model,
                        train_size=sizes[name],
                        test_size=tests[name],
                        max_len=lens[name],
                        epochs=args.epochs,
                        batch_size=args.batch_size,
                        lr=args.lr,
                        kala_lr=args.kala_lr,
                        eval_split=args.eval_split,
                        graph_strategy=args.graph_strategy,
                        out=args.out,
                    )
                data, memory, subsets, out_path, results = state[name]
                cfg = ktrain.TrainConfig(
                    lr=args.lr,
                    kala_lr=args.kala_lr,
                    epochs=args.epochs,
                    max_len=lens[name],
                    batch_size=args.batch_size,
                    seed=seed,
                    graph_rungs=args.graph_rungs,
                )
                if args.memory_only:  # the default graph buckets (graph_rungs 0), whatever --graph-rungs says
                    cfg = dataclasses.replace(cfg, graph_rungs=0)
                    protocol.measure_memory_only(lm, data, memory, variant, kw, cfg, out_path, results)
                    continue
                if any((r["variant"], r["seed"]) == (variant, seed) for r in results["runs"]):
                    continue
                measure = seed == 0 and (group == "main" if args.memory is None else variant in args.memory)
                fit, run = protocol.run_variant(
                    lm,
                    data,
                    memory,
                    subsets,
                    cfg,
                    group=group,
                    variant=variant,
                    kw=kw,
                    measure_memory=measure,
                    log_path=LOGS / f"{graph_key(name, args.graph_strategy)}_{variant}_{seed}.jsonl",
                )
                if run is None:  # a truncated run is not a result
                    print(
                        f"{name} {variant} seed {seed}: stopped by SIGTERM after {fit.steps} steps; not recorded",
                        flush=True,
                    )
                    return 143
                protocol.save_run(out_path, results, run)
                print(
                    f"{name} {variant} seed {seed}: F1 {run['f1']:.2f} (seen {run.get('f1_seen', 0):.1f}"
                    f" unseen {run.get('f1_unseen', 0):.1f}) loss {fit.losses[-1]:.3f} "
                    f"{fit.examples_per_second:.1f} ex/s train {fit.train_seconds:.0f}s "
                    f"wall {run['wall_seconds']:.0f}s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
