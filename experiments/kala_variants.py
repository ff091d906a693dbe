"""Other knowledge-integration systems vs KALA on NER (the layout of KALA's Table 4).

    # the committed variants_<dataset>.json: kala_ner.py's protocol (its $CONLL / $NCBI; CoNLL-2003 ran seed 0)
    P="--batch-size 16 --lr 3e-4 --kala-lr 1e-3"
    python experiments/kala_variants.py --dataset conll --train-size 3000 --test-size 1000 --max-len 64 \
        --epochs 2 $P --seeds 0
    python experiments/kala_variants.py --dataset ncbi --train-size 700 --test-size 400 --max-len 128 \
        --epochs 3 $P --seeds 0 1 2
    python experiments/kala_variants.py --table          # print / write the comparison table
    python experiments/kala_variants.py --small          # tiny synthetic rerun (CI, notebook)

Methods (``--methods``; all through :mod:`jsteer.kala.variants.registry` and the same training
engine): plain fine-tuning, KALA point-wise and relational (the harness' own models), ERNIE
fusion, K-BERT sentence trees, Entities as Experts and the knowledge adapter. Everything else
is shared with ``experiments/kala_ner.py`` (:mod:`jsteer.kala.protocol`): the knowledge graph built from
the dataset's token columns (no labels), the seeded train / test subsets, MiniLM, the entity
memory initialised from MiniLM's contextual features, batch ``--batch-size``, length <= ``--max-len``,
AdamW with ``--lr`` for the backbone and ``--kala-lr`` for the knowledge modules (the defaults are an
older, smaller protocol: pass the flags above). K-BERT gets up to 2 facts per entity as branches of at
most 6 word pieces (sentence-tree length <= ``--max-len`` + 32).

The table (``--table``) is :mod:`jsteer.kala.variants.report` and the tiny rerun (``--small``)
:func:`jsteer.kala.variants.synthetic.run_small`; notebooks/knowledge_comparison.ipynb shows both.

Each finished (method, seed) run is appended to ``experiments/results/kala/variants_<dataset>.json``
(re-running skips finished runs). Train time = wall time of steps 2..N of the run (the first,
compiling step excluded), measured on a 2-core CPU shared with other jobs: compare it between
methods of the same sweep only, and expect noise from the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

from jsteer.kala import protocol
from jsteer.kala.protocol import OUT, protocol_diff
from jsteer.kala.variants.report import DATASET_NAMES, METHODS, load_results, table
from jsteer.kala.variants.synthetic import run_small

KBERT = dict(max_branches=2, branch_tokens=6)
KBERT_EXTRA = 32  # sentence-tree length cap = max_len + this (room for the branches)


def tc_len(method: str, args) -> int:
    """Length cap of a method's inputs (K-BERT's sentence trees are longer than the sentence)."""
    return args.max_len + KBERT_EXTRA if method == "kbert" else args.max_len


def run_dataset(args) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", str(protocol.JAX_CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    import jsteer
    from jsteer.data import ner as ner_lib
    from jsteer.kala import pipeline
    from jsteer.kala.variants import registry
    from jsteer.kala.variants import train as vtrain

    spec = protocol.DATASETS[args.dataset]
    out_path = pathlib.Path(args.out) if args.out else OUT / f"variants_{args.dataset}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    prev_setup = results.get("setup")
    done = {(r["method"], r["seed"]) for r in results["runs"]}

    t0 = time.time()
    gdir = protocol.ensure_graph(args.dataset)
    lm = jsteer.load(args.model)
    labels = getattr(ner_lib, spec["labels"])
    data = protocol.load_data(
        args.dataset, lm.tokenizer, max_len=args.max_len, train_size=args.train_size, test_size=args.test_size
    )
    memory = protocol.cached_memory(args.dataset, lm, data, args.train_size, args.max_len)
    subsets = data.subsets()
    encoded = {"default": (data.train, data.test)}
    if "kbert" in args.methods:
        splits = [
            pipeline.read_split(protocol.DATA / spec[s], gdir, labels, spec["scheme"], size)
            for s, size in (("train", args.train_size), ("test", args.test_size))
        ]
        encoded["kbert"] = tuple(
            [
                registry.encode_ner(
                    "kbert",
                    w,
                    t,
                    m,
                    lm.tokenizer,
                    labels,
                    data.vocab,
                    data.kg,
                    args.max_len,
                    4,
                    tree_max_len=args.max_len + KBERT_EXTRA,
                    **KBERT,
                )
                for w, t, m in split
            ]
            for split in splits
        )
        branch_tokens = [e["n_branch_tokens"] for e in encoded["kbert"][0]]
    results["setup"] = {
        "dataset": args.dataset,
        "model": args.model,
        "train_size": len(data.train),
        "test_size": len(data.test),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "kala_lr": args.kala_lr,
        "max_len": args.max_len,
        "entity_vocab": len(data.vocab),
        "relations": len(data.relations),
        "n_seen_contexts": len(subsets["seen"]),
        "n_unseen_contexts": len(subsets["unseen"]),
        "kbert": KBERT | {"tree_max_len": args.max_len + KBERT_EXTRA},
        "warmup_ratio": 0.1,
        "schedule": "linear warmup + linear decay",
        "kbert_mean_branch_tokens": (sum(branch_tokens) / len(branch_tokens)) if "kbert" in encoded else None,
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(f"setup {time.time() - t0:.0f}s: {json.dumps(results['setup'])[:300]}", flush=True)
    if results["runs"]:
        old = prev_setup or {}
        diff = protocol_diff(old, results["setup"])
        if diff:
            raise SystemExit(f"{out_path}: its runs used another protocol {diff}; pass --out or move it away")

    for seed in args.seeds:
        for method in args.methods:
            if (method, seed) in done:
                continue
            train, test = encoded.get(method, encoded["default"])
            extra = {"num_relations": len(data.relations)} if method == "relational" else {}
            model = registry.build_model(
                method, lm.config, num_labels=len(labels), num_entities=len(data.vocab), **extra
            )
            uses_memory = method in ("pointwise", "relational", "ernie", "eae", "adapter")
            params = registry.init_params(
                model,
                jax.random.PRNGKey(seed),
                encoder_params=lm.params["encoder"],
                memory=memory if uses_memory else None,
            )
            cfg = vtrain.TrainConfig(
                lr=args.lr,
                kala_lr=args.kala_lr,
                epochs=args.epochs,
                max_len=tc_len(method, args),
                batch_size=args.batch_size,
                seed=seed,
            )
            t1 = time.time()
            fit = vtrain.fit(model, params, train, cfg)
            if fit.preempted:  # a truncated run is not a result
                print(f"{method} seed {seed}: stopped by SIGTERM after {fit.steps} steps; not recorded", flush=True)
                raise SystemExit(143)
            t2 = time.time()
            scores = vtrain.evaluate_ner(model, fit.params, test, data.test_tags, data.labels, subsets=subsets)
            run = {
                "method": method,
                "seed": seed,
                "config": dataclasses.asdict(model.kala),
                **scores,
                "train_seconds": fit.train_seconds,
                "compile_seconds": fit.compile_seconds,
                "examples_per_second": fit.examples_per_second,
                "steps": fit.steps,
                "final_loss": fit.losses[-1],
                "median_step_seconds": fit.median_step_seconds,
                "params": fit.trainable_params,
                "eval_seconds": time.time() - t2,
                "wall_seconds": time.time() - t1,
                "load_average": os.getloadavg()[0],
            }
            results["runs"].append(run)
            out_path.write_text(json.dumps(results, indent=1, default=str))
            print(
                f"{args.dataset} {method} seed {seed}: F1 {scores['f1']:.2f} (unseen "
                f"{scores.get('f1_unseen', float('nan')):.1f}) train {fit.train_seconds:.0f}s "
                f"wall {time.time() - t1:.0f}s",
                flush=True,
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=sorted(DATASET_NAMES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--train-size", type=int, default=400)
    ap.add_argument("--test-size", type=int, default=400)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--kala-lr", type=float, default=1e-3)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", action="store_true", help="print the table and write variants_table.md")
    ap.add_argument("--small", action="store_true", help="tiny synthetic rerun")
    args = ap.parse_args(argv)
    if args.small:
        print(json.dumps(run_small(), indent=1))
        return 0
    if args.table:
        text = table(load_results())
        (OUT / "variants_table.md").write_text(text + "\n")
        print(text)
        return 0
    if args.dataset is None:
        ap.error("--dataset is required (or --table / --small)")
    run_dataset(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
