"""Training wall time of relational KALA vs plain fine-tuning (issue 6's <= 15% target), measured cleanly.

    python experiments/kala_walltime.py --dataset conll ncbi --seeds 0 1 2
    python experiments/kala_walltime.py --dataset ncbi --seeds 0 1 2 --graph-rungs 2   # walltime_rungs2.json
    python experiments/kala_walltime.py --dataset ncbi --seeds 0 1 2 --graph-strategy abbreviation
                                                                    # walltime_abbreviation.json

The F1 sweeps (kala_ner.py) time their runs too, but on a shared CPU, one after another, with a
persistent compilation cache that was cold for some runs and warm for others. Here every run is
a fresh process with the test protocol of ``ner_<dataset>.json`` (same training subset, epochs,
batch, lengths, learning rates; no evaluation), the two methods of a seed run back to back in
alternating order, and each (method, seed) runs twice against its own compilation cache:

- cold: the cache starts empty, so every batch shape compiles (a first run);
- warm: the same run again, its compiled steps read from that cache (any later run).

Per run: ``fit_seconds`` (first batch to last step, compiles included: the wall time a user
waits), ``compile_seconds`` (step 1), ``median_step_seconds`` and the number of batch shapes.
Written to experiments/results/kala/walltime.json (finished runs are skipped, so an interrupted
sweep resumes); ``kala_report.py`` turns it into a table.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from jsteer.kala import protocol
from jsteer.kala.protocol import COMMON, PROTOCOL

OUT = protocol.OUT / "walltime.json"


def one_run(
    dataset: str, variant: str, seed: int, cache: str, graph_rungs: int = 0, graph_strategy: Optional[str] = None
) -> dict:
    """Train one (dataset, variant, seed) in this process; the timing record."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    import jsteer
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig

    proto = PROTOCOL[dataset]
    kw = protocol.variant_config(variant)
    lm = jsteer.load("minilm")
    data = protocol.load_data(
        dataset,
        lm.tokenizer,
        graph_strategy=graph_strategy,
        max_len=proto["max_len"],
        train_size=proto["train_size"],
        test_size=1,
    )
    memory = protocol.cached_memory(
        protocol.graph_key(dataset, graph_strategy), lm, data, proto["train_size"], proto["max_len"]
    )
    cfg = protocol.train_config(dataset, seed, graph_rungs)
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory, seed=seed)
    steps = cfg.total_steps(len(data.train))
    stream = iter(ktrain._Endless.for_model(model, data.train, cfg, "ner"))
    shapes = collections.Counter(
        tuple(sorted((k, v.shape) for k, v in b.items())) for b in itertools.islice(stream, steps)
    )
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    fit = ktrain.fit(model, params, data.train, cfg)
    return {
        "fit_seconds": time.perf_counter() - t0,
        "train_seconds": fit.train_seconds,
        "compile_seconds": fit.compile_seconds,
        "median_step_seconds": fit.median_step_seconds,
        "steps": fit.steps,
        "shapes": len(shapes),
        "final_loss": fit.losses[-1],
        "load_before": load0,
        "load_after": os.getloadavg()[0],
    }


def summarize(runs: list[dict]) -> dict:
    """Per dataset and cache state: per-seed ratios relational / fine-tuning and their median."""
    import statistics

    out: dict = {}
    for (ds, cache), rs in itertools.groupby(
        sorted(runs, key=lambda r: (r["dataset"], r["cache"])), key=lambda r: (r["dataset"], r["cache"])
    ):
        by = {(r["variant"], r["seed"]): r for r in rs}
        seeds = sorted({s for v, s in by if v != "finetune" and ("finetune", s) in by})
        for v in sorted({v for v, _ in by if v != "finetune"}):
            pairs = [(by["finetune", s], by[v, s]) for s in seeds if (v, s) in by]
            if not pairs:
                continue
            ratio = {k: [b[k] / a[k] for a, b in pairs] for k in ("fit_seconds", "median_step_seconds")}
            out.setdefault(ds, {}).setdefault(v, {})[cache] = {
                "seeds": [b["seed"] for _, b in pairs],
                **{f"{k}_ratio": {"per_seed": ratio[k], "median": statistics.median(ratio[k])} for k in ratio},
                "finetune_fit_seconds": [a["fit_seconds"] for a, _ in pairs],
                f"{v}_fit_seconds": [b["fit_seconds"] for _, b in pairs],
            }
    return out


def main(argv=None) -> int:
    from jsteer.kala.mining import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", nargs="+", choices=sorted(PROTOCOL), default=["conll", "ncbi"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--variant", default="relational_edrop", help="the KALA variant compared with fine-tuning")
    ap.add_argument(
        "--graph-rungs", type=int, default=COMMON["graph_rungs"], help="TrainConfig.graph_rungs (smaller graph buckets)"
    )
    ap.add_argument(
        "--graph-strategy",
        default=None,
        choices=STRATEGIES,
        help="the graph's lexicon strategy (kala_ner.py --graph-strategy; default: each dataset's)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="default: walltime.json, or walltime[_rungs<N>][_<strategy>].json with --graph-rungs N / --graph-strategy",
    )
    ap.add_argument(
        "--one", nargs=6, metavar=("DATASET", "VARIANT", "SEED", "CACHE", "RUNGS", "STRATEGY"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.one:
        ds, v, seed, cache, rungs, strategy = args.one
        rec = one_run(ds, v, int(seed), cache, int(rungs), None if strategy == "-" else strategy)
        print("RESULT " + json.dumps(rec), flush=True)
        return 0

    rungs, strategy = args.graph_rungs, args.graph_strategy
    name = (
        "walltime" + (f"_rungs{rungs}" if rungs != COMMON["graph_rungs"] else "") + (f"_{strategy}" if strategy else "")
    )
    out = pathlib.Path(args.out or OUT.with_name(f"{name}.json"))
    res = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    was = res.get("protocol", {})
    was = (was.get("graph_rungs", COMMON["graph_rungs"]), was.get("graph_strategy"))
    if res["runs"] and was != (rungs, strategy):
        raise SystemExit(
            f"{out}: its runs used (graph_rungs, graph_strategy)={was}, not {(rungs, strategy)}; pass --out"
        )
    res["protocol"] = {
        "datasets": PROTOCOL,
        **COMMON,
        "graph_rungs": rungs,
        "graph_strategy": strategy,
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    done = {(r["dataset"], r["variant"], r["seed"], r["cache"]) for r in res["runs"]}
    for ds in args.dataset:
        for seed in args.seeds:
            order = ["finetune", args.variant][:: 1 if seed % 2 == 0 else -1]  # alternate who goes first
            for v in order:
                if all((ds, v, seed, c) in done for c in ("cold", "warm")):
                    continue
                cache = tempfile.mkdtemp(prefix="kala_walltime_cache_")
                try:
                    for state in ("cold", "warm"):
                        t0 = time.time()
                        proc = subprocess.run(
                            [sys.executable, __file__, "--one", ds, v, str(seed), cache, str(rungs), strategy or "-"],
                            capture_output=True,
                            text=True,
                        )
                        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                        if proc.returncode or not lines:
                            sys.stderr.write(proc.stderr[-4000:])
                            raise SystemExit(f"{ds} {v} seed {seed} ({state}) failed with exit {proc.returncode}")
                        rec = {
                            "dataset": ds,
                            "variant": v,
                            "seed": seed,
                            "cache": state,
                            "order": order,
                            **json.loads(lines[-1][len("RESULT ") :]),
                            "process_seconds": time.time() - t0,
                        }
                        res["runs"] = [
                            r
                            for r in res["runs"]
                            if (r["dataset"], r["variant"], r["seed"], r["cache"]) != (ds, v, seed, state)
                        ] + [rec]
                        res["summary"] = summarize(res["runs"])
                        out.write_text(json.dumps(res, indent=1))
                        print(
                            f"{ds} {v} seed {seed} {state}: fit {rec['fit_seconds']:.0f}s (compile "
                            f"{rec['compile_seconds']:.0f}s, median step {rec['median_step_seconds']:.3f}s, "
                            f"{rec['shapes']} shapes, load {rec['load_before']:.1f})",
                            flush=True,
                        )
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(res.get("summary", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
