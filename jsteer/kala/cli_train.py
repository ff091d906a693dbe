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
    """The run's task (``--task``, else from ``--train``; ``--tfds``: NER), checked against the
    files and the task-specific options; fills in the options' task defaults on ``args``."""
    if args.tfds is None and args.test_split is not None:
        raise ValueError("--test-split is a split of the --tfds data set; give --test FILE with --train")
    if args.tfds is not None:
        if args.task == "qa":
            raise ValueError("--tfds data sets train NER (tokens and tags); QA takes SQuAD-format files (--train)")
        if args.test is not None and args.test_split is not None:
            raise ValueError("--test and --test-split: give one test set")
        task = "ner"
    else:
        task = task_of(args.train)
    given = f"--train {args.train}" if args.train is not None else f"--tfds {args.tfds}"
    kind = TASK_FILES[task] if args.train is not None else "a TFDS data set (NER)"
    if args.task is not None and args.task != task:
        raise ValueError(f"--task {args.task}, but {given} is {kind}, not {TASK_FILES[args.task]}")
    if args.test is not None and task_of(args.test) != task:
        raise ValueError(
            f"--test {args.test} is {TASK_FILES[task_of(args.test)]}, but {given} is {kind}: a run trains "
            f"and tests one task"
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
            f"{'a QA' if task == 'qa' else 'an NER'} run ({given} is {kind})"
        )
    for k, v in own.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return task


def _ner_sources(args):
    """(train, test) NER splits: files prepared through the TFDS layer (cached in --data-dir) or
    splits of the --tfds data set; test None without one."""
    from jsteer.data import sources
    from jsteer.kala import pipeline

    def named(split):
        spec = args.tfds if split is None else f"{args.tfds.split(':', 1)[0]}:{split}"
        return sources.open_tfds(
            spec, args.tfds_data_dir, need=sources.NER, default_split="train", what="(NER trains on tokens and tags)"
        )

    if args.tfds is not None:
        train = named(None)
        test = named(args.test_split) if args.test_split is not None else None
    else:
        train = pipeline.ner_split(args.train, args.scheme, args.data_dir)
        test = None
    if args.test is not None:
        test = pipeline.ner_split(args.test, args.scheme, args.data_dir)
    return train, test


def _tfds_lexicon(graph, splits):
    """The graph's lexicon when a split of a named data set has no mentions file there (its
    sentences are annotated in memory, said on stderr); None otherwise."""
    from jsteer.kala import pipeline
    from jsteer.kala.mining import Lexicon

    graph = pathlib.Path(graph)
    lacking = [s for s in splits if s is not None and not s.files and not pipeline.mentions_path(graph, s).is_file()]
    if not lacking or not (graph / "lexicon.tsv").is_file():
        return None
    for s in lacking:
        print(
            f"note: {graph} has no {pipeline.mentions_path(graph, s).name} for {s.describe()}; annotating it in "
            f"memory with {graph / 'lexicon.tsv'}",
            file=sys.stderr,
        )
    return Lexicon.load(graph / "lexicon.tsv")


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


def _run_record(args, task, labels, train_split=None) -> dict:
    """run.json of a train command: what decides its numbers (compared on --resume)."""
    from jsteer.convert.hf import file_sha256 as file_digest
    from jsteer.kala import pipeline

    graph = pathlib.Path(args.graph)
    named = train_split is not None and not train_split.files
    mentions = pipeline.mentions_path(graph, train_split if named else args.train)
    if not mentions.is_file():
        if not (named and (graph / "lexicon.tsv").is_file()):
            raise pipeline.missing_mentions_error(train_split if named else args.train, graph)
        mentions = graph / "lexicon.tsv"  # the named split is annotated with it in memory
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
        "train": train_split.digest() if named else file_digest(args.train),
        "train_mentions": file_digest(mentions),
        "facts": file_digest(graph / "facts.jsonl"),
    }
    paths = {
        "train": train_split.describe() if named else str(pathlib.Path(args.train).resolve()),
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
    labels = train_split = test_split = lexicon = None
    if task == "ner":
        train_split, test_split = _ner_sources(args)
        labels = _parse_labels(args.labels) if args.labels else pipeline.split_labels(train_split)
    if not (pathlib.Path(args.graph) / "facts.jsonl").is_file():
        raise FileNotFoundError(f"--graph {args.graph}: no facts.jsonl (write the folder with jsteer kala build-graph)")
    record = _run_record(args, task, labels, train_split)
    runs.check(out, record, args.resume)
    if task == "ner":
        lexicon = _tfds_lexicon(args.graph, (train_split, test_split))
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
            train_split,
            test_split,
            args.graph,
            lm.tokenizer,
            labels=labels,
            scheme=args.scheme,
            max_len=args.max_len,
            max_neighbors=args.max_neighbors,
            train_size=args.train_size,
            lexicon=lexicon,
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
    if task == "ner" and test_split is not None:
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
