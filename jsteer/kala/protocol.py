"""The KALA NER experiments' protocol: data sets, variants, graphs, caches and one run.

``experiments/kala_ner.py`` (the F1 sweeps), ``kala_walltime.py``, ``kala_step_overhead.py``,
``kala_variants.py``, ``kala_lexicon_quality.py``, ``bench_kala.py`` and
``experiments/kala_report.py`` (through :mod:`jsteer.kala.report`) share these pieces, so that
every script trains and scores on the same graphs, subsets and settings:

- :data:`DATASETS`: where each data set's splits are (under :data:`jsteer.workspace.DATA`), its
  tag scheme, label set and default graph lexicon strategy; :func:`load_data` encodes a subset.
- :data:`VARIANTS`: the sweep groups (``main``, ``ablation``, ``layers``, ``edrop``,
  ``edrop_rates``) and each variant's :class:`jsteer.kala.model.KalaConfig` keywords.
- :data:`PROTOCOL` / :data:`COMMON`: the settings of the committed ``ner_<dataset>.json`` sweeps.
- :func:`ensure_graph` / :func:`cached_memory`: the knowledge graph and the backbone-initialised
  entity memory, built once and cached under :data:`jsteer.workspace.RUNS`.
- :func:`protocol_diff` / :func:`save_run`: runs of one results file share a protocol; sweeps in
  parallel processes merge into one file.
- :func:`setup_dataset`, :func:`run_variant`, :func:`measure_memory_only`: one sweep's steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import time
from typing import Optional

from jsteer.workspace import DATA, RESULTS, RUNS

OUT = RESULTS / "kala"
GRAPHS = RUNS / "kala_graphs"
LOGS = RUNS / "kala_logs"
JAX_CACHE = RUNS / "jax_cache"

# the settings that define a sweep's protocol: runs are comparable only when these agree
PROTOCOL_KEYS = (
    "train_size",
    "test_size",
    "epochs",
    "batch_size",
    "lr",
    "kala_lr",
    "max_len",
    "eval_split",
    "graph_strategy",
)
PROTOCOL_DEFAULTS = {"eval_split": "test"}  # what setups written before the key existed used

DATASETS = {
    "conll": dict(
        train="conll2003/eng.train",
        dev="conll2003/eng.testa",
        test="conll2003/eng.testb",
        scheme="iob1",
        labels="CONLL2003_LABELS",
        strategy="capitalised",
        min_count=2,
    ),
    "ncbi": dict(
        train="ncbi_disease/train.tsv",
        dev="ncbi_disease/devel.tsv",
        test="ncbi_disease/test.tsv",
        scheme="iob2",
        labels="NCBI_DISEASE_LABELS",
        strategy="frequent",
        min_count=3,
    ),
}

VARIANTS = {
    "main": [
        ("finetune", dict(method="finetune")),
        ("more_params", dict(method="more_params")),
        ("pointwise", dict(method="pointwise")),
        ("relational", dict(method="relational")),
    ],
    "ablation": [
        ("relational_gamma_only", dict(method="relational", use_beta=False)),
        ("relational_beta_only", dict(method="relational", use_gamma=False)),
    ],
    "edrop": [
        ("relational_edrop", dict(method="relational", entity_dropout=0.3)),
        ("pointwise_edrop", dict(method="pointwise", entity_dropout=0.3)),
    ],
    # the rate sweep, for choosing it on the dev split (--eval-split dev); 0.3 is edrop's
    "edrop_rates": [
        (f"relational_edrop{round(100 * r):02d}", dict(method="relational", entity_dropout=r)) for r in (0.1, 0.5)
    ],
    "layers": [
        ("relational_L5", dict(method="relational", layers=(5,))),
        ("relational_L1", dict(method="relational", layers=(1,))),
        ("relational_L135", dict(method="relational", layers=(1, 3, 5))),
    ],
}

# The protocol of the committed test sweeps ner_<dataset>.json (kala_ner.py's $CONLL / $NCBI and
# $P; graph_rungs 0 is TrainConfig's default), which the timing scripts reuse.
PROTOCOL = {
    "conll": dict(train_size=3000, max_len=64, epochs=2.0),
    "ncbi": dict(train_size=700, max_len=128, epochs=3.0),
}
COMMON = dict(batch_size=16, lr=3e-4, kala_lr=1e-3, graph_rungs=0)


def train_config(dataset: str, seed: int, graph_rungs: int = 0):
    """The saved results' :class:`jsteer.kala.train.TrainConfig` for ``dataset``: its
    :data:`PROTOCOL` epochs and length, the :data:`COMMON` batch size and learning rates."""
    from jsteer.kala import train as ktrain

    proto = PROTOCOL[dataset]
    return ktrain.TrainConfig(
        lr=COMMON["lr"],
        kala_lr=COMMON["kala_lr"],
        epochs=proto["epochs"],
        max_len=proto["max_len"],
        batch_size=COMMON["batch_size"],
        seed=seed,
        graph_rungs=graph_rungs,
    )


def protocol_setting(setup: dict, key: str):
    """A sweep setup's value of protocol key ``key``, with the defaults of setups written before it existed."""
    if key == "graph_strategy" and key not in setup:  # older setups: their graph summary's
        return (setup.get("graph") or {}).get("strategy")
    return setup.get(key, PROTOCOL_DEFAULTS.get(key))


def protocol_diff(a: dict, b: dict) -> dict:
    """{key: (a's, b's)} of the protocol settings in which two sweeps' setups differ."""
    return {
        k: (protocol_setting(a, k), protocol_setting(b, k))
        for k in PROTOCOL_KEYS
        if protocol_setting(a, k) != protocol_setting(b, k)
    }


def same_protocol(a: dict, b: dict) -> bool:
    """Whether two sweeps' setups share data subsets, evaluation split and training hyper-parameters."""
    return not protocol_diff(a, b)


def timed(runs: list[dict]) -> list[dict]:
    """The runs whose times count: those not marked ``timing_perturbed`` (another job shared the
    CPU during them; their scores still count), or all of them if every one is marked."""
    return [r for r in runs if not r.get("timing_perturbed")] or runs


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
    return GRAPHS / name


def ensure_graph(name: str, strategy: Optional[str] = None) -> pathlib.Path:
    """The dataset's graph folder, built on first use from the train + dev + test token columns
    (a strategy other than its default: with the builder's default min_count)."""
    from jsteer.kala.builder import build_graph

    spec = DATASETS[name]
    strategy = strategy or spec["strategy"]
    out = graph_dir(graph_key(name, strategy))
    if not (out / "summary.json").is_file():
        build_graph(
            [DATA / spec[k] for k in ("train", "dev", "test")],
            out,
            strategy=strategy,
            min_count=graph_min_count(name, strategy),
        )
    return out


def load_data(name: str, tokenizer, *, split: str = "test", graph_strategy: Optional[str] = None, **kw):
    """:func:`jsteer.kala.pipeline.load_ner_data` of dataset ``name``: its train split and
    ``split`` ("test" or "dev"), its labels and scheme, the graph of ``graph_strategy`` (default:
    the dataset's). ``kw``: ``max_len``, ``train_size``, ``test_size`` (seeded subsets), ..."""
    from jsteer.data import ner as ner_lib
    from jsteer.kala import pipeline

    spec = DATASETS[name]
    return pipeline.load_ner_data(
        DATA / spec["train"],
        DATA / spec[split],
        ensure_graph(name, graph_strategy),
        tokenizer,
        labels=getattr(ner_lib, spec["labels"]),
        scheme=spec["scheme"],
        **kw,
    )


def backfill_step_times(path: pathlib.Path, dataset: str) -> None:
    """Fill ``median_step_seconds`` of runs recorded before it existed, from the Trainer's
    per-step JSONL logs under runs/kala_logs (``interval_s`` of steps 2..N)."""
    res = json.loads(path.read_text())
    for r in res["runs"]:
        log = LOGS / f"{dataset}_{r['variant']}_{r['seed']}.jsonl"
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
            raise SystemExit(
                f"{out_path}: another process wrote runs of another protocol {diff} meanwhile; this run is not recorded"
            )
        results["runs"] += [r for r in on_disk.get("runs", []) if (r["variant"], r["seed"]) not in mine]
    results["runs"].append(run)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out_path)


def import_variants(ds: str, results: pathlib.Path = OUT) -> pathlib.Path:
    """Make ``ner_<ds>.json`` (:mod:`jsteer.kala.report`'s input) from the main-group methods of the variants
    sweep ``variants_<ds>.json`` (experiments/kala_variants.py runs the harness' own methods
    too, on the same data and graphs). A previous ``ner_<ds>.json`` of another protocol moves to
    ``prev_<epochs>ep/``; its graph statistics (same graph files and subsets) are kept."""
    src = json.loads((results / f"variants_{ds}.json").read_text())
    dst = results / f"ner_{ds}.json"
    old = json.loads(dst.read_text()) if dst.is_file() else {"setup": {}, "runs": []}
    setup = {**old.get("setup", {}), **src["setup"]}
    if old["runs"] and not same_protocol(old["setup"], src["setup"]):
        keep = results / f"prev_{old['setup'].get('epochs'):g}ep"
        keep.mkdir(exist_ok=True)
        (keep / dst.name).write_text(dst.read_text())
        old = {"runs": []}
    names = {v for v, _ in VARIANTS["main"]}
    runs = [r for r in old["runs"] if r.get("group") != "main"]  # ablations / layers of the same protocol
    runs += [{**r, "group": "main", "variant": r["method"]} for r in src["runs"] if r["method"] in names]
    keep_mem = {"step_memory": old["step_memory"]} if "step_memory" in old else {}
    dst.write_text(json.dumps({"setup": setup, "runs": runs, **keep_mem}, indent=1, default=str))
    return dst


def cached_memory(name: str, lm, data, train_size, max_len: int):
    """The entity memory [entities, hidden] initialised from the backbone
    (:func:`jsteer.kala.pipeline.memory_from_backbone`), cached under runs/kala_memory keyed by
    graph name, subset, length and model identity (deterministic for a given training subset,
    and minutes of CPU on a loaded machine)."""
    import numpy as np

    from jsteer.kala import pipeline

    model_id = lm.identity.split(":")[-1][:16]
    path = RUNS / "kala_memory" / f"{name}_{train_size}_{max_len}_{model_id}_{len(data.vocab)}.npy"
    if path.is_file():
        return np.load(path)
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, memory)
    return memory


def setup_dataset(
    name: str,
    lm,
    *,
    model: str,
    train_size,
    test_size,
    max_len: int,
    epochs: float,
    batch_size: int,
    lr: float,
    kala_lr: float,
    eval_split: str = "test",
    graph_strategy: Optional[str] = None,
    out: Optional[str] = None,
):
    """One dataset of a sweep -> (data, memory, subsets, output path, results dict): its encoded
    subsets, cached memory, seen / unseen test contexts, and the results file (``out``, default
    ``OUT/ner_<dataset>[_dev].json``) with this sweep's setup, refused when the file's runs used
    another protocol."""
    import jax

    from jsteer.kala import pipeline

    dev = eval_split == "dev"
    out_path = pathlib.Path(out) if out else OUT / f"ner_{name}{'_dev' if dev else ''}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    t0 = time.time()
    strategy = graph_strategy or DATASETS[name]["strategy"]
    gdir = ensure_graph(name, strategy)
    data = load_data(
        name,
        lm.tokenizer,
        split=eval_split,
        graph_strategy=strategy,
        max_len=max_len,
        train_size=train_size,
        test_size=test_size,
    )
    memory = cached_memory(graph_key(name, strategy), lm, data, train_size, max_len)
    subsets = data.subsets()
    setup = {
        "dataset": name,
        "model": model,
        "train_size": len(data.train),
        "test_size": len(data.test),
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "kala_lr": kala_lr,
        "max_len": max_len,
        "eval_split": eval_split,
        "graph_strategy": strategy,
        "warmup_ratio": 0.1,
        "schedule": "linear warmup + linear decay",
        "entity_vocab": len(data.vocab),
        "relations": len(data.relations),
        "n_seen_contexts": len(subsets["seen"]),
        "n_unseen_contexts": len(subsets["unseen"]),
        "unseen_min": pipeline.UNSEEN_MIN,
        "graph": json.loads((gdir / "summary.json").read_text()) | {"relations": None},
        "mean_nodes": float(sum(e["graph"].n_node for e in data.train) / len(data.train)),
        "mean_edges": float(sum(e["graph"].n_edge for e in data.train) / len(data.train)),
        "mention_coverage_test": float(sum(e["graph"].n_local > 0 for e in data.test) / len(data.test)),
        "mean_subwords_train": float(sum(len(e["input_ids"]) for e in data.train) / len(data.train)),
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
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


def measure_memory_only(lm, data, memory, variant: str, kw: dict, cfg, out_path: pathlib.Path, results: dict) -> None:
    """Step memory of one variant under train config ``cfg`` without training (Table 11's memory
    column), into ``results["step_memory"]`` (and ``out_path``)."""
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig

    mem = results.setdefault("step_memory", {})
    if variant in mem:
        return
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory, seed=cfg.seed)
    mem[variant] = ktrain.measure_step_memory(model, params, data.train, cfg)
    out_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"{variant}: step memory {mem[variant] / 2**20:.0f} MiB", flush=True)


def run_variant(
    lm,
    data,
    memory,
    subsets,
    cfg,
    *,
    group: str,
    variant: str,
    kw: dict,
    log_path: Optional[pathlib.Path] = None,
    measure_memory: bool = False,
):
    """Train one (variant, seed) of a sweep with train config ``cfg`` (its seed) and score it
    on the test split -> (fit, run record); the record is None when SIGTERM stopped the fit
    (a truncated run is not a result). ``log_path``: the Trainer's per-step JSONL log,
    started afresh."""
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig

    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(**kw), memory, seed=cfg.seed)
    t1 = time.time()
    if log_path is not None:
        pathlib.Path(log_path).unlink(missing_ok=True)
    fit = ktrain.fit(model, params, data.train, cfg, measure_memory=measure_memory, log_path=log_path)
    if fit.preempted:
        return fit, None
    t2 = time.time()
    scores = ktrain.evaluate_ner(model, fit.params, data.test, data.test_tags, data.labels, subsets=subsets)
    run = {
        "group": group,
        "variant": variant,
        "seed": cfg.seed,
        "kala": dataclasses.asdict(model.kala),
        "graph_rungs": cfg.graph_rungs,
        **scores,
        "train_seconds": fit.train_seconds,
        "compile_seconds": fit.compile_seconds,
        "examples_per_second": fit.examples_per_second,
        "steps": fit.steps,
        "median_step_seconds": fit.median_step_seconds,
        "final_loss": fit.losses[-1],
        "step_memory_bytes": fit.step_memory_bytes,
        "params": fit.trainable_params,
        "eval_seconds": time.time() - t2,
        "wall_seconds": time.time() - t1,
        "load_average": os.getloadavg()[0],
    }
    return fit, run
