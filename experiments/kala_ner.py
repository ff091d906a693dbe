"""KALA on NER with MiniLM: the paper's Tables 1-3, Figure 4, the layer sweep and Table 11.

    python experiments/kala_ner.py --dataset conll --groups main --seeds 0 1 2
    python experiments/kala_ner.py --dataset ncbi --groups ablation layers --seeds 0

Groups (each run is one (variant, seed); finished runs in the output JSON are skipped, so an
interrupted sweep resumes):

- ``main``: plain fine-tuning, +one extra transformer layer ("more params"), KALA point-wise,
  KALA relational (KFM on the default layers 3 and 5 of MiniLM's 6). Table 1/2 + Table 11.
- ``ablation``: relational KALA with only gamma or only beta (Table 3).
- ``layers``: relational KALA with KFM on other layer sets (the layer-location sweep).

Every run also reports F1 on seen / unseen test contexts (Figure 4; see
:meth:`jsteer.kala.pipeline.NERData.subsets`), training wall time, examples/s, and (seed 0 of
``main``) the bytes XLA plans for one train step.

The knowledge graph comes from ``jsteer kala build-graph`` over the dataset's train + dev +
test token columns (no labels): capitalised-run lexicon for CoNLL-2003, frequent-n-gram lexicon
for NCBI-Disease; pattern-based within-sentence facts.

Budget (2 CPU cores shared with other jobs; run with ``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`` there, which wastes less under contention): the training set is a seeded random subset of ``--train-size``
sentences, the test set a subset of ``--test-size`` sentences of the official test split;
``--epochs`` epochs of batch 32 at length <= 128 (length-bucketed). These subsets are far
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "experiments" / "results" / "kala"

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
    "layers": [("relational_L5", dict(method="relational", layers=(5,))),
               ("relational_L1", dict(method="relational", layers=(1,))),
               ("relational_L135", dict(method="relational", layers=(1, 3, 5)))],
}


def graph_dir(name: str) -> pathlib.Path:
    return ROOT / "runs" / "kala_graphs" / name


def ensure_graph(name: str) -> pathlib.Path:
    from jsteer.kala.builder import build_graph

    spec = DATASETS[name]
    out = graph_dir(name)
    if not (out / "summary.json").is_file():
        build_graph([DATA / spec[k] for k in ("train", "dev", "test")], out, strategy=spec["strategy"],
                    min_count=spec["min_count"])
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=sorted(DATASETS), required=True)
    ap.add_argument("--groups", nargs="+", default=["main"], choices=sorted(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--train-size", type=int, default=400)
    ap.add_argument("--test-size", type=int, default=400)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--kala-lr", type=float, default=1e-3)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="run only these variants of the groups, in this order (default: all, in table order)")
    ap.add_argument("--memory", nargs="*", default=None,
                    help="variants whose step memory to measure (an extra compile; default: every main variant)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--backfill", action="store_true", help="only fill median step times from the run logs")
    args = ap.parse_args(argv)
    if args.backfill:
        backfill_step_times(pathlib.Path(args.out) if args.out else OUT / f"ner_{args.dataset}.json", args.dataset)
        return 0

    import jax

    jax.config.update("jax_compilation_cache_dir", str(ROOT / "runs" / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import jsteer
    from jsteer.data import ner as ner_lib
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.model import KalaConfig

    spec = DATASETS[args.dataset]
    out_path = pathlib.Path(args.out) if args.out else OUT / f"ner_{args.dataset}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    done = {(r["variant"], r["seed"]) for r in results["runs"]}

    t0 = time.time()
    gdir = ensure_graph(args.dataset)
    lm = jsteer.load(args.model)
    labels = getattr(ner_lib, spec["labels"])
    data = pipeline.load_ner_data(DATA / spec["train"], DATA / spec["test"], gdir, lm.tokenizer, labels=labels,
                                  scheme=spec["scheme"], max_len=args.max_len, train_size=args.train_size,
                                  test_size=args.test_size)
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
    subsets = data.subsets()
    results["setup"] = {
        "dataset": args.dataset, "model": args.model, "train_size": len(data.train), "test_size": len(data.test),
        "epochs": args.epochs, "batch_size": 32, "lr": args.lr, "kala_lr": args.kala_lr, "max_len": args.max_len,
        "entity_vocab": len(data.vocab), "relations": len(data.relations), "n_seen_contexts": len(subsets["seen"]),
        "n_unseen_contexts": len(subsets["unseen"]), "unseen_min": pipeline.UNSEEN_MIN,
        "graph": json.loads((gdir / "summary.json").read_text()) | {"relations": None},
        "mean_nodes": float(sum(e["graph"].n_node for e in data.train) / len(data.train)),
        "mean_edges": float(sum(e["graph"].n_edge for e in data.train) / len(data.train)),
        "mention_coverage_test": float(sum(e["graph"].n_local > 0 for e in data.test) / len(data.test)),
        "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
    }
    print(f"setup {time.time() - t0:.0f}s: {json.dumps(results['setup'], default=str)[:400]}", flush=True)

    todo = [(g, v, kw) for g in args.groups for v, kw in VARIANTS[g]]
    if args.variants is not None:
        known = {v for _, v, _ in todo}
        bad = [v for v in args.variants if v not in known]
        if bad:
            ap.error(f"unknown variants {bad} for groups {args.groups}")
        todo = sorted([t for t in todo if t[1] in args.variants], key=lambda t: args.variants.index(t[1]))
    for group, variant, kw in todo:
        for seed in args.seeds:
            if (variant, seed) in done:
                continue
            cfg = ktrain.TrainConfig(lr=args.lr, kala_lr=args.kala_lr, epochs=args.epochs, max_len=args.max_len,
                                     seed=seed)
            model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory,
                                                 seed=seed)
            t1 = time.time()
            log = ROOT / "runs" / "kala_logs" / f"{args.dataset}_{variant}_{seed}.jsonl"
            log.unlink(missing_ok=True)
            measure = seed == 0 and (group == "main" if args.memory is None else variant in args.memory)
            fit = ktrain.fit(model, params, data.train, cfg, measure_memory=measure, log_path=log)
            scores = ktrain.evaluate_ner(model, fit.params, data.test, data.test_tags, data.labels,
                                         subsets=subsets)
            run = {"group": group, "variant": variant, "seed": seed, "kala": dataclasses.asdict(model.kala),
                   **scores, "train_seconds": fit.train_seconds, "compile_seconds": fit.compile_seconds,
                   "examples_per_second": fit.examples_per_second, "steps": fit.steps,
                   "median_step_seconds": fit.median_step_seconds,
                   "final_loss": fit.losses[-1], "step_memory_bytes": fit.step_memory_bytes,
                   "params": fit.trainable_params, "wall_seconds": time.time() - t1}
            results["runs"].append(run)
            out_path.write_text(json.dumps(results, indent=1, default=str))
            print(f"{args.dataset} {variant} seed {seed}: F1 {scores['f1']:.2f} (seen {scores.get('f1_seen', 0):.1f}"
                  f" unseen {scores.get('f1_unseen', 0):.1f}) {fit.examples_per_second:.1f} ex/s "
                  f"{time.time() - t1:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
