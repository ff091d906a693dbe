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
  sweep), for choosing the rate with ``--eval-split dev`` (scores on a ``--test-size`` subset of the dev split, written to
  ``ner_<dataset>_dev.json``; the test split plays no part).

Every run also reports F1 on seen / unseen test contexts (Figure 4; see
:meth:`jsteer.kala.pipeline.NERData.subsets`), training wall time, examples/s, and (seed 0 of
``main``) the bytes XLA plans for one train step.

The knowledge graph comes from ``jsteer kala build-graph`` over the dataset's train + dev +
test token columns (no labels): capitalised-run lexicon for CoNLL-2003, frequent-n-gram lexicon
for NCBI-Disease; pattern-based within-sentence facts.

Budget (2 CPU cores shared with other jobs; run with ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`` there, which wastes less under contention): the training set is a seeded random subset of ``--train-size``
sentences, the test set a subset of ``--test-size`` sentences of the official test split;
``--epochs`` epochs of batch ``--batch-size`` at length <= ``--max-len`` (length-bucketed; 99.6% of
CoNLL-2003 training sentences fit 64 MiniLM subwords, NCBI-Disease sentences are longer, hence 128
there). A short schedule (2 epochs on CoNLL-2003, 3 on NCBI-Disease) with a higher lr than the paper's 5e-5 and batch 16 (more
updates per CPU-second), the same for every method. These subsets are far
below the paper's full-data runs, so absolute F1 is lower; all methods share them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "experiments" / "results" / "kala"

# the settings that define a sweep's protocol: runs are comparable only when these agree
PROTOCOL_KEYS = ("train_size", "test_size", "epochs", "batch_size", "lr", "kala_lr", "max_len", "eval_split",
                 "graph_strategy")
PROTOCOL_DEFAULTS = {"eval_split": "test"}  # what setups written before the key existed used


def protocol_setting(setup: dict, key: str):
    """A sweep setup's value of protocol key ``key``, with the defaults of setups written before it existed."""
    if key == "graph_strategy" and key not in setup:  # older setups: their graph summary's
        return (setup.get("graph") or {}).get("strategy")
    return setup.get(key, PROTOCOL_DEFAULTS.get(key))


def protocol_diff(a: dict, b: dict) -> dict:
    """{key: (a's, b's)} of the protocol settings in which two sweeps' setups differ."""
    return {k: (protocol_setting(a, k), protocol_setting(b, k)) for k in PROTOCOL_KEYS
            if protocol_setting(a, k) != protocol_setting(b, k)}


def same_protocol(a: dict, b: dict) -> bool:
    """Whether two sweeps' setups share data subsets, evaluation split and training hyper-parameters."""
    return not protocol_diff(a, b)


def timed(runs: list[dict]) -> list[dict]:
    """The runs whose times count: those not marked ``timing_perturbed`` (another job shared the
    CPU during them; their scores still count), or all of them if every one is marked."""
    return [r for r in runs if not r.get("timing_perturbed")] or runs


DATASETS = {
    "conll": dict(train="conll2003/eng.train", dev="conll2003/eng.testa", test="conll2003/eng.testb",
                  scheme="iob1", labels="CONLL2003_LABELS", strategy="capitalised", min_count=2),
    "ncbi": dict(train="ncbi_disease/train.tsv", dev="ncbi_disease/devel.tsv", test="ncbi_disease/test.tsv",
                 scheme="iob2", labels="NCBI_DISEASE_LABELS", strategy="frequent", min_count=3),
}

VARIANTS = {
    "main": [("finetune", dict(method="finetune")), ("more_params", dict(method="more_params")),
             ("pointwise", dict(method="pointwise")), ("relational", dict(method="relational"))],
    "ablation": [("relational_gamma_only", dict(method="relational", use_beta=False)),
                 ("relational_beta_only", dict(method="relational", use_gamma=False))],
    "edrop": [("relational_edrop", dict(method="relational", entity_dropout=0.3)),
              ("pointwise_edrop", dict(method="pointwise", entity_dropout=0.3))],
    # the rate sweep, for choosing it on the dev split (--eval-split dev); 0.3 is edrop's
    "edrop_rates": [(f"relational_edrop{round(100 * r):02d}", dict(method="relational", entity_dropout=r))
                    for r in (0.1, 0.5)],
    "layers": [("relational_L5", dict(method="relational", layers=(5,))),
               ("relational_L1", dict(method="relational", layers=(1,))),
               ("relational_L135", dict(method="relational", layers=(1, 3, 5)))],
}


def variant_config(variant: str) -> dict:
    """The KalaConfig keyword arguments of a variant of :data:`VARIANTS` (any group)."""
    return dict(next(kw for group in VARIANTS.values() for v, kw in group if v == variant))


def graph_key(name: str, strategy: Optional[str] = None) -> str:
    """Name of a dataset's graph (its folder, its memory cache): the dataset's own for its default
    lexicon strategy, ``<dataset>_<strategy>`` for another."""
    return name if strategy in (None, DATASETS[name]["strategy"]) else f"{name}_{strategy}"


def graph_min_count(name: str, strategy: str) -> int:
    """The lexicon's min_count for a dataset's graph: the dataset's for its default strategy, the
    builder's default (2) for another."""
    return DATASETS[name]["min_count"] if strategy == DATASETS[name]["strategy"] else 2


def graph_dir(name: str) -> pathlib.Path:
    return ROOT / "runs" / "kala_graphs" / name


def ensure_graph(name: str, strategy: Optional[str] = None) -> pathlib.Path:
    """The dataset's graph folder, built on first use (a strategy other than its default: with the
    builder's default min_count)."""
    from jsteer.kala.builder import build_graph

    spec = DATASETS[name]
    strategy = strategy or spec["strategy"]
    out = graph_dir(graph_key(name, strategy))
    if not (out / "summary.json").is_file():
        build_graph([DATA / spec[k] for k in ("train", "dev", "test")], out, strategy=strategy,
                    min_count=graph_min_count(name, strategy))
    return out


def backfill_step_times(path: pathlib.Path, dataset: str) -> None:
    """Fill ``median_step_seconds`` of runs recorded before it existed, from the Trainer's
    per-step JSONL logs under runs/kala_logs (``interval_s`` of steps 2..N)."""
    import statistics

    res = json.loads(path.read_text())
    for r in res["runs"]:
        log = ROOT / "runs" / "kala_logs" / f"{dataset}_{r['variant']}_{r['seed']}.jsonl"
        if r.get("median_step_seconds") is None and log.is_file():
            recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
            iv = [x["interval_s"] for x in recs if x.get("step", 0) >= 2 and "interval_s" in x]
            if len(iv) == r["steps"] - 1:  # one log line per step
                r["median_step_seconds"] = statistics.median(iv)
    path.write_text(json.dumps(res, indent=1, default=str))


def save_run(out_path: pathlib.Path, results: dict, run: dict) -> None:
    """Add ``run`` to ``results`` and write them atomically, keeping the runs that another process
    sweeping other variants into the same file (same protocol) has written meanwhile."""
    if out_path.is_file():
        on_disk = json.loads(out_path.read_text())
        mine = {(r["variant"], r["seed"]) for r in results["runs"]}
        diff = protocol_diff(on_disk.get("setup", {}), results["setup"]) if on_disk.get("runs") else {}
        if diff:
            raise SystemExit(f"{out_path}: another process wrote runs of another protocol {diff} meanwhile; "
                             f"this run is not recorded")
        results["runs"] += [r for r in on_disk.get("runs", []) if (r["variant"], r["seed"]) not in mine]
    results["runs"].append(run)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out_path)


def per_dataset(values: list, datasets: list[str], name: str) -> dict:
    """One value for every dataset, or one per dataset (in ``--dataset`` order)."""
    if len(values) == 1:
        return {d: values[0] for d in datasets}
    if len(values) != len(datasets):
        raise SystemExit(f"--{name}: give one value or one per dataset ({len(datasets)}), got {values}")
    return dict(zip(datasets, values))


def cached_memory(name: str, lm, data, train_size, max_len: int):
    """The entity memory initialised from the backbone (:func:`jsteer.kala.pipeline.memory_from_backbone`),
    cached under runs/kala_memory keyed by dataset, subset, length and model identity (deterministic
    for a given training subset, and minutes of CPU on a loaded machine)."""
    import numpy as np
    from jsteer.kala import pipeline

    path = ROOT / "runs" / "kala_memory" / f"{name}_{train_size}_{max_len}_{lm.identity.split(':')[-1][:16]}_{len(data.vocab)}.npy"
    if path.is_file():
        return np.load(path)
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, memory)
    return memory


def setup_dataset(name: str, lm, args, train_size, test_size, max_len):
    """(data, memory, subsets, setup dict, output path, results dict) of one dataset."""
    import jax
    from jsteer.data import ner as ner_lib
    from jsteer.kala import pipeline

    spec = DATASETS[name]
    dev = args.eval_split == "dev"
    out_path = pathlib.Path(args.out) if args.out else OUT / f"ner_{name}{'_dev' if dev else ''}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    t0 = time.time()
    strategy = args.graph_strategy or spec["strategy"]
    gdir = ensure_graph(name, strategy)
    labels = getattr(ner_lib, spec["labels"])
    data = pipeline.load_ner_data(DATA / spec["train"], DATA / spec[args.eval_split], gdir, lm.tokenizer, labels=labels,
                                  scheme=spec["scheme"], max_len=max_len, train_size=train_size,
                                  test_size=test_size)
    memory = cached_memory(graph_key(name, strategy), lm, data, train_size, max_len)
    subsets = data.subsets()
    setup = {
        "dataset": name, "model": args.model, "train_size": len(data.train), "test_size": len(data.test),
        "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "kala_lr": args.kala_lr,
        "max_len": max_len, "eval_split": args.eval_split, "graph_strategy": strategy, "warmup_ratio": 0.1, "schedule": "linear warmup + linear decay",
        "entity_vocab": len(data.vocab), "relations": len(data.relations), "n_seen_contexts": len(subsets["seen"]),
        "n_unseen_contexts": len(subsets["unseen"]), "unseen_min": pipeline.UNSEEN_MIN,
        "graph": json.loads((gdir / "summary.json").read_text()) | {"relations": None},
        "mean_nodes": float(sum(e["graph"].n_node for e in data.train) / len(data.train)),
        "mean_edges": float(sum(e["graph"].n_edge for e in data.train) / len(data.train)),
        "mention_coverage_test": float(sum(e["graph"].n_local > 0 for e in data.test) / len(data.test)),
        "mean_subwords_train": float(sum(len(e["input_ids"]) for e in data.train) / len(data.train)),
        "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    old = results.get("setup")
    if old and results["runs"]:
        diff = protocol_diff(old, setup)
        if diff:
            raise SystemExit(f"{out_path}: its runs used another protocol {diff}; pass --out or move it away")
    results["setup"] = setup
    print(f"{name} setup {time.time() - t0:.0f}s: {json.dumps(setup, default=str)[:400]}", flush=True)
    return data, memory, subsets, out_path, results


def measure_memory_only(lm, data, memory, variant: str, kw: dict, args, max_len: int, seed: int,
                        out_path: pathlib.Path, results: dict) -> None:
    """Step memory of one variant without training (Table 11's memory column)."""
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.model import KalaConfig

    mem = results.setdefault("step_memory", {})
    if variant in mem:
        return
    cfg = ktrain.TrainConfig(lr=args.lr, kala_lr=args.kala_lr, epochs=args.epochs, max_len=max_len,
                             batch_size=args.batch_size, seed=seed)
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory, seed=seed)
    mem[variant] = ktrain.measure_step_memory(model, params, data.train, cfg)
    out_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"{variant}: step memory {mem[variant] / 2 ** 20:.0f} MiB", flush=True)


def main(argv=None) -> int:
    from jsteer.kala.builder import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", nargs="+", choices=sorted(DATASETS), required=True,
                    help="one or more datasets; runs go seed-major (seed 0 of every dataset first)")
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
    ap.add_argument("--graph-strategy", default=None, choices=STRATEGIES,
                    help="the graph's lexicon strategy (jsteer.kala.builder), default: the dataset's (capitalised for "
                         "conll, frequent for ncbi); another one builds runs/kala_graphs/<dataset>_<strategy>")
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="run only these variants of the groups, in this order (default: all, in table order)")
    ap.add_argument("--memory", nargs="*", default=None,
                    help="variants whose step memory to measure (an extra compile; default: every main variant)")
    ap.add_argument("--memory-only", action="store_true",
                    help="only measure each variant's step memory (compile, no training) into the JSON's "
                         "'step_memory' (first seed's first batch: the same shapes for every variant)")
    ap.add_argument("--eval-split", choices=("test", "dev"), default="test",
                    help="score on the official test split, or on the dev split to choose settings without "
                         "touching test (default output ner_<dataset>_dev.json; --test-size then sizes dev)")
    ap.add_argument("--out", default=None, help="output JSON (only with a single dataset)")
    ap.add_argument("--backfill", action="store_true", help="only fill median step times from the run logs")
    args = ap.parse_args(argv)
    if args.out and len(args.dataset) > 1:
        ap.error("--out needs a single --dataset")
    if args.backfill:
        for d in args.dataset:
            backfill_step_times(pathlib.Path(args.out) if args.out else OUT / f"ner_{d}.json", d)
        return 0

    import jax

    jax.config.update("jax_compilation_cache_dir", str(ROOT / "runs" / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import jsteer
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.model import KalaConfig

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
                    state[name] = setup_dataset(name, lm, args, sizes[name], tests[name], lens[name])
                data, memory, subsets, out_path, results = state[name]
                if args.memory_only:
                    measure_memory_only(lm, data, memory, variant, kw, args, lens[name], seed, out_path, results)
                    continue
                if any((r["variant"], r["seed"]) == (variant, seed) for r in results["runs"]):
                    continue
                cfg = ktrain.TrainConfig(lr=args.lr, kala_lr=args.kala_lr, epochs=args.epochs, max_len=lens[name],
                                         batch_size=args.batch_size, seed=seed, graph_rungs=args.graph_rungs)
                model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory,
                                                     seed=seed)
                t1 = time.time()
                log = ROOT / "runs" / "kala_logs" / f"{graph_key(name, args.graph_strategy)}_{variant}_{seed}.jsonl"
                log.unlink(missing_ok=True)
                measure = seed == 0 and (group == "main" if args.memory is None else variant in args.memory)
                fit = ktrain.fit(model, params, data.train, cfg, measure_memory=measure, log_path=log)
                if fit.preempted:  # a truncated run is not a result
                    print(f"{name} {variant} seed {seed}: stopped by SIGTERM after {fit.steps} steps; not recorded",
                          flush=True)
                    return 143
                t2 = time.time()
                scores = ktrain.evaluate_ner(model, fit.params, data.test, data.test_tags, data.labels,
                                             subsets=subsets)
                run = {"group": group, "variant": variant, "seed": seed, "kala": dataclasses.asdict(model.kala),
                       "graph_rungs": cfg.graph_rungs,
                       **scores, "train_seconds": fit.train_seconds, "compile_seconds": fit.compile_seconds,
                       "examples_per_second": fit.examples_per_second, "steps": fit.steps,
                       "median_step_seconds": fit.median_step_seconds,
                       "final_loss": fit.losses[-1], "step_memory_bytes": fit.step_memory_bytes,
                       "params": fit.trainable_params, "eval_seconds": time.time() - t2,
                       "wall_seconds": time.time() - t1, "load_average": os.getloadavg()[0]}
                save_run(out_path, results, run)
                print(f"{name} {variant} seed {seed}: F1 {scores['f1']:.2f} (seen {scores.get('f1_seen', 0):.1f}"
                      f" unseen {scores.get('f1_unseen', 0):.1f}) loss {fit.losses[-1]:.3f} "
                      f"{fit.examples_per_second:.1f} ex/s train {fit.train_seconds:.0f}s "
                      f"wall {time.time() - t1:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
