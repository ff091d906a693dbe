"""``jsteer kala train``: a KALA (or baseline) NER / extractive-QA run into one run folder.

The run folder holds ``run.json`` (the configuration and data fingerprints ``--resume`` compares,
:mod:`jsteer.kala.runs`), ``checkpoints/`` (Orbax), ``log.jsonl``, ``model`` (the trained params
as a jsteer artifact, entity vocabulary / relations / configs / labels in its metadata) and
``metrics.json`` (non-finite numbers as null). NER labels: O plus B-X and I-X for every entity
type of the training file (or ``--labels``); QA options default to :data:`QA_DEFAULTS`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

from jsteer import progress
from jsteer.cli import warning_lines
from jsteer.kala.cli_eval import (
    TASK_FILES,
    check_gold,
    check_predictions_path,
    default_predictions_path,
    qa_scores,
    task_of,
)

QA_DEFAULTS = {"max_len": 384, "stride": 128, "max_query": 64, "max_answer_len": 30}  # as jsteer.kala.qa
NER_DEFAULTS = {"max_len": 128, "scheme": "iob1"}


def _resolve_task(args) -> str:
    """The run's task (``--task``, else from ``--train``), checked against the files and the
    task-specific options; fills in the options' task defaults on ``args``."""
    task = task_of(args.train)
    if args.task is not None and args.task != task:
        raise ValueError(
            f"--task {args.task}, but --train {args.train} is {TASK_FILES[task]}, not {TASK_FILES[args.task]}"
        )
    if args.test is not None and task_of(args.test) != task:
        raise ValueError(
            f"--test {args.test} is {TASK_FILES[task_of(args.test)]}, but --train {args.train} is "
            f"{TASK_FILES[task]}: a run trains and tests one task"
        )
    own, other = (QA_DEFAULTS, NER_DEFAULTS) if task == "qa" else (NER_DEFAULTS, QA_DEFAULTS)
    foreign = [
        f"--{k.replace('_', '-')}"
        for k in list(other) + (["labels"] if task == "qa" else [])
        if k not in own and getattr(args, k) is not None
    ]
    if foreign:
        raise ValueError(
            f"{', '.join(foreign)}: {'NER' if task == 'qa' else 'QA'} option(s), but this is "
            f"{'a QA' if task == 'qa' else 'an NER'} run (--train {args.train} is {TASK_FILES[task]})"
        )
    for k, v in own.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return task


def _labels_of(path, scheme) -> tuple[str, ...]:
    """O plus B-X and I-X for every entity type X tagged in ``path`` (IOB2; sorted by type), so a
    test file may hold an I-X (or B-X) the training file happens not to."""
    from jsteer.data.readers import read_conll

    types = {t[2:] for s in read_conll(path, scheme=scheme) for t in s.tags if t != "O"}
    return ("O",) + tuple(f"{p}-{x}" for x in sorted(types) for p in "BI")


def _parse_labels(text: str) -> tuple[str, ...]:
    """``--labels`` "O,B-PER,I-PER" -> a checked label tuple (order kept: it fixes the label ids)."""
    from jsteer.data.ner import split_tag

    labels = tuple(x.strip() for x in text.split(",") if x.strip())
    for x in labels:
        try:
            split_tag(x)
        except ValueError as e:
            raise ValueError(f"--labels: {e}") from None
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"--labels: {', '.join(dup)} given twice")
    if "O" not in labels:
        raise ValueError(f"--labels must include 'O', got {','.join(labels)}")
    return labels


def _run_record(args, task, labels) -> dict:
    """run.json of a train command: what decides its numbers (compared on --resume)."""
    from jsteer.convert.hf import file_sha256 as file_digest
    from jsteer.kala import pipeline

    graph = pathlib.Path(args.graph)
    mentions = pipeline.mentions_path(graph, args.train)
    if not mentions.is_file():
        raise pipeline.missing_mentions_error(args.train, graph)
    config = {
        k: getattr(args, k)
        for k in (
            "model",
            "method",
            "layers",
            "no_gamma",
            "no_beta",
            "epochs",
            "max_steps",
            "lr",
            "kala_lr",
            "entity_dropout",
            "graph_rungs",
            "batch_size",
            "max_len",
            "max_neighbors",
            "train_size",
            "seed",
        )
    }
    config["task"] = task
    if task == "ner":
        config.update(scheme=args.scheme, labels=list(labels))
    else:
        config.update({k: getattr(args, k) for k in QA_DEFAULTS})
    data = {
        "train": file_digest(args.train),
        "train_mentions": file_digest(mentions),
        "facts": file_digest(graph / "facts.jsonl"),
    }
    paths = {
        "train": str(pathlib.Path(args.train).resolve()),
        "train_mentions": str(mentions.resolve()),
        "facts": str((graph / "facts.jsonl").resolve()),
        "graph": str(graph.resolve()),
    }
    return {"config": config, "data": data, "paths": paths}


def _last_logged_loss(log_path: pathlib.Path):
    """The last ``loss`` in a Trainer log.jsonl (None without one)."""
    loss = None
    if log_path.is_file():
        for line in log_path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "loss" in rec:
                loss = rec["loss"]
    return loss


def run_train(args) -> int:
    from jsteer.kala import runs

    out = pathlib.Path(args.out)
    with runs.lock(out):  # first and throughout: no other train command checks or writes --out meanwhile
        return _train_locked(args, out)


def _train_locked(args, out: pathlib.Path) -> int:
    t0 = time.time()
    import jsteer
    from jsteer.checkpoints import save_artifact
    from jsteer.kala import pipeline, runs
    from jsteer.kala import train as ktrain
    from jsteer.kala.formats import read_facts
    from jsteer.kala.model import KalaConfig

    if not args.resume:
        runs.check_fresh(out)  # before anything slow
    task = _resolve_task(args)
    labels = None
    if task == "ner":
        labels = _parse_labels(args.labels) if args.labels else _labels_of(args.train, args.scheme)
    if not (pathlib.Path(args.graph) / "facts.jsonl").is_file():
        raise FileNotFoundError(f"--graph {args.graph}: no facts.jsonl (write the folder with jsteer kala build-graph)")
    record = _run_record(args, task, labels)
    runs.check(out, record, args.resume)
    if task == "qa":  # every input checked before the (slow) model load
        train_split = pipeline.read_qa_split(args.train, args.graph, args.train_size)
        pipeline.check_train_split(args.train, train_split)  # questions, each with an answer (no SQuAD v2.0)
        with warning_lines("kala train"):  # a test answer_start that misses its text: repaired, said
            test_split = pipeline.read_qa_split(args.test, args.graph, strict=False) if args.test else []
        check_gold(args.test, [ex for ex, _ in test_split])
        if args.test:
            check_predictions_path(default_predictions_path(out, args.test), args.test, "the predictions file")
        facts = read_facts(pathlib.Path(args.graph) / "facts.jsonl")
    lm = jsteer.load(args.model)
    if lm.family != "bert":
        raise ValueError(f"KALA needs a BERT-family encoder; {args.model} is {lm.family}")
    if task == "ner":
        data = pipeline.load_ner_data(
            args.train,
            args.test,
            args.graph,
            lm.tokenizer,
            labels=labels,
            scheme=args.scheme,
            max_len=args.max_len,
            max_neighbors=args.max_neighbors,
            train_size=args.train_size,
        )
    else:
        data = pipeline.qa_data(
            train_split,
            test_split,
            facts,
            lm.tokenizer,
            max_len=args.max_len,
            stride=args.stride,
            max_query=args.max_query,
            max_neighbors=args.max_neighbors,
        )
    kala = KalaConfig(
        method=args.method,
        layers=tuple(args.layers) if args.layers else None,
        use_gamma=not args.no_gamma,
        use_beta=not args.no_beta,
        entity_dropout=args.entity_dropout,
    )
    memory = (
        pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
        if kala.uses_knowledge
        else None
    )
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, kala, memory, seed=args.seed)
    cfg = ktrain.TrainConfig(
        lr=args.lr,
        kala_lr=args.kala_lr,
        batch_size=args.batch_size,
        max_len=args.max_len,
        epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        graph_rungs=args.graph_rungs,
    )
    runs.write(out, record)  # only now: a command that failed before training leaves --out as it was
    fit = ktrain.fit(
        model,
        params,
        data.train,
        cfg,
        task=task,
        checkpoint_dir=out / "checkpoints",
        log_path=out / "log.jsonl",
        progress=True,
    )
    if fit.preempted:  # SIGTERM: the trainer saved a checkpoint; the run is not finished
        from jsteer.train.loop import EXIT_PREEMPTED

        print(
            f"jsteer kala train: stopped by SIGTERM at step {fit.last_step} of "
            f"{cfg.total_steps(len(data.train))}; checkpoint saved in {out / 'checkpoints'}. The run is not "
            f"finished (no model/ or metrics.json written): continue it with the same command plus --resume",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    if fit.steps == 0:
        print(f"{out}: the checkpoint is already at step {fit.last_step}; no training step run", file=sys.stderr)
    meta = {
        "task": task,
        "model": str(args.model),
        "kala": dataclasses.asdict(model.kala),
        "graph": str(pathlib.Path(args.graph).resolve()),
        "entities": data.vocab.ids[1:],
        "relations": data.relations.to_list(),
        "max_len": args.max_len,
        "max_neighbors": args.max_neighbors,
        "train": dataclasses.asdict(cfg),
    }
    if task == "ner":
        meta.update(labels=list(labels), scheme=args.scheme)
    else:
        meta.update({k: getattr(args, k) for k in QA_DEFAULTS})
    save_artifact(out / "model", fit.params, meta)
    final_loss = fit.losses[-1] if fit.losses else _last_logged_loss(out / "log.jsonl")
    metrics = {
        "steps": fit.last_step,
        "steps_run": fit.steps,
        "final_loss": final_loss,
        "train_seconds": fit.train_seconds,
        "examples_per_second": fit.examples_per_second,
    }
    if args.test and task == "ner":
        metrics["test"] = ktrain.evaluate_ner(
            model, fit.params, data.test, data.test_tags, labels, subsets=data.subsets(), progress=True
        )
    elif args.test:
        where = default_predictions_path(out, args.test)
        metrics["test"] = qa_scores(model, fit.params, data.test, data.test_examples, args.max_answer_len, where)
    metrics = _json_safe(metrics)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, allow_nan=False))
    print(json.dumps(metrics, allow_nan=False))
    test = metrics.get("test") or {}
    progress.summary(
        "kala train",
        f"trained {task} for {fit.steps} step(s) (at step {fit.last_step})",
        time.time() - t0,
        out,
        final_loss=metrics["final_loss"],
        **{f"test {k}": test[k] for k in ("f1", "exact_match") if k in test},
    )
    return 0


def _json_safe(obj):
    """``obj`` with every non-finite float as None: JSON has no NaN / Infinity (a run of <= 1
    step has no train_seconds or examples_per_second)."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
