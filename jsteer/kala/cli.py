"""``jsteer kala``: build knowledge graphs, train and evaluate KALA models for NER and extractive QA.

    jsteer kala build-graph train.conll dev.conll test.conll --out graphs/ [--facts triples.jsonl]
        [--corpus more.txt] [--strategy capitalised|frequent|abbreviation|both] [--spacy en_core_web_sm]
    jsteer kala build-graph new.conll --lexicon graphs/lexicon.tsv --out graphs/   (annotate only)
    jsteer kala build-graph train.conll --out graphs/ --overwrite                  (replace a graph)
    jsteer kala train --train train.conll --graph graphs/ --out runs/kala [--test test.conll]
                      [--model minilm] [--method relational] [--layers 3 5] [--epochs 3] [--lr 5e-5]
                      [--kala-lr 1e-4] [--entity-dropout 0.3] [--batch-size 32] [--max-len 128]
                      [--scheme iob1|iob2] [--labels O,B-PER,I-PER,...] [--resume]
    jsteer kala eval --run runs/kala --test test.conll [--graph graphs/]

Extractive QA takes SQuAD v1.1 files (``.json``) in place of the CoNLL files; the task follows
from the ``--train`` file (or ``--task qa``), and ``eval`` reads it from the run::

    jsteer kala build-graph train.json dev.json --out graphs/squad
    jsteer kala train --train train.json --test dev.json --graph graphs/squad --out runs/qa
                      [--max-len 384] [--stride 128] [--max-query 64] [--max-answer-len 30]
    jsteer kala eval --run runs/qa --test dev.json [--predictions preds.json]

``build-graph`` mines an entity lexicon and facts from the files' text (CoNLL: the token column;
SQuAD: the contexts, never questions or answers) and writes ``<file>.mentions.jsonl`` (SQuAD:
keyed by question id, character spans), ``facts.jsonl``, ``lexicon.tsv`` and ``summary.json``.
On a folder that already holds a graph it refuses to mine a new one (that would replace the
facts and lexicon a trained model uses) unless ``--overwrite`` is given; ``--lexicon`` adds
files to a graph, keeping its lexicon and facts.

``train`` writes ``<out>/run.json`` (configuration and data fingerprints), ``<out>/checkpoints``
(Orbax), ``<out>/log.jsonl`` (metrics), ``<out>/model`` (the trained params as a jsteer artifact
with the entity vocabulary, relations, configs and labels in its metadata) and
``<out>/metrics.json``. ``--out`` must be new or empty (a second ``train`` on a folder in use is
refused); ``--resume`` continues the run recorded there and is refused when its configuration
(the task included) or data differ (see :mod:`jsteer.kala.runs`); it continues at the step and
the data position of the latest checkpoint, so it ends with the numbers of an uninterrupted run.
SIGTERM (preemption) stops ``train`` after the current step with a checkpoint and exit status
143, writing neither ``model`` nor ``metrics.json`` (resume it with ``--resume``). Non-finite
numbers (``train_seconds`` of a run of <= 1 step) are ``null`` in ``metrics.json``. QA training
takes SQuAD v1.1 questions, each with an answer (SQuAD v2.0 unanswerable questions are refused).
The NER label set is O plus B-X and I-X for every entity type X of the training file (or ``--labels``).
QA scores are SQuAD v1.1 exact match and F1 (percent) of the best span over a question's
windows; the predictions, ``{question id: answer text}`` as the SQuAD evaluation script reads
them, go to ``<run>/<test file name>.predictions.json`` (``eval --predictions``: elsewhere; never
the ``--test`` file, another SQuAD-format data file or a folder).
``eval`` on a file the graph folder has no mentions for annotates it in memory with the
folder's lexicon.tsv.

Kept whole (about 690 lines): ``train`` and ``eval`` share the task checks, the
predictions-path checks and QA scoring (``_task_of``, ``_check_predictions_path``,
``_qa_scores``), and ``register`` is the one argparse table of all three subcommands; split by
subcommand those helpers would sit apart from both users.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time

from jsteer import progress
from jsteer.cli import warning_lines
from jsteer.kala.mining import STRATEGIES

TASK_FILES = {"ner": "a CoNLL file (NER)", "qa": "a SQuAD-format JSON file (extractive QA)"}
QA_DEFAULTS = {"max_len": 384, "stride": 128, "max_query": 64, "max_answer_len": 30}  # as jsteer.kala.qa
NER_DEFAULTS = {"max_len": 128, "scheme": "iob1"}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def register(subparsers) -> None:
    kala = subparsers.add_parser(
        "kala",
        help="KALA: knowledge-augmented NER and extractive QA (build-graph, train, eval)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = kala.add_subparsers(dest="kala_command", required=True)

    p = sub.add_parser(
        "build-graph",
        help="mine entity mentions and facts from CoNLL or SQuAD-format files (labels and answers unused)",
        description="Mine an entity lexicon and facts from CoNLL files (token column) or SQuAD-format "
        "JSON files (contexts) and write <file>.mentions.jsonl, facts.jsonl, lexicon.tsv "
        "and summary.json under --out. A folder that already holds a graph is not "
        "replaced unless --overwrite is given; --lexicon <folder>/lexicon.tsv adds files "
        "to it, keeping its lexicon and facts.",
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="CoNLL files (only the token column is read) or SQuAD-format JSON files (only the "
        "contexts are read; mentions are keyed by question id), not both kinds at once",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--facts", default=None, help="JSON Lines triples {h, r, t} to use instead of extracted facts")
    p.add_argument(
        "--corpus",
        nargs="*",
        default=(),
        help="extra unlabeled text files for lexicon mining only (no mentions or facts are taken from "
        "them; not with --lexicon). CoNLL graphs: one sentence a line, words split at whitespace. "
        "SQuAD graphs: each line is split into words and sentences as the contexts are "
        "(punctuation split off: 'Paris,' -> 'Paris' ','; a sentence ends at . ! or ?, not after "
        "an initial or a title such as 'Dr.'), so a line may hold several sentences",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="capitalised",
        help="lexicon mining (jsteer.kala.builder's docstring): capitalised runs (news), frequent "
        "n-grams, defined terms and their abbreviations (biomedical), or capitalised + frequent",
    )
    p.add_argument("--min-count", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4, help="longest entity surface form, in words")
    p.add_argument("--spacy", default=None, help="spaCy pipeline to use instead of the lexicon (if installed)")
    p.add_argument(
        "--lexicon",
        default=None,
        help="annotate only: match this lexicon.tsv (e.g. a trained run's graph folder's) instead of "
        "mining one; the folder's facts.jsonl is kept (or copied from beside the lexicon)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the graph already in --out: without it, building there without --lexicon is "
        "refused (it would mine a new lexicon and replace the facts.jsonl and lexicon.tsv that "
        "models trained on the folder use). The new graph's files replace the old ones, and "
        "mentions files of inputs not given this time are deleted (they were matched with the "
        "old lexicon)",
    )
    p.set_defaults(func=_build_graph)

    p = sub.add_parser("train", help="fine-tune a BERT-family model with KALA (or a baseline) for NER or extractive QA")
    p.add_argument("--train", required=True, help="a CoNLL file (NER) or a SQuAD-format JSON file (QA)")
    p.add_argument("--test", default=None, help="evaluate on this file (of the same kind as --train) at the end")
    p.add_argument(
        "--task",
        choices=("ner", "qa"),
        default=None,
        help="default: from --train (qa for a SQuAD-format JSON file, ner for CoNLL)",
    )
    p.add_argument("--graph", required=True, help="folder written by build-graph")
    p.add_argument(
        "--out",
        required=True,
        help="the run folder: new or empty (or the run to --resume); one train command uses it at a time "
        "(another one on it is refused)",
    )
    p.add_argument("--model", default="minilm", help="anything jsteer.load accepts (a BERT-family encoder)")
    p.add_argument("--method", choices=("finetune", "more_params", "pointwise", "relational"), default="relational")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="KFM layers (default: the last layers)")
    p.add_argument("--no-gamma", action="store_true")
    p.add_argument("--no-beta", action="store_true")
    p.add_argument("--scheme", choices=("iob1", "iob2"), default=None, help="NER: the CoNLL tag scheme (default iob1)")
    p.add_argument(
        "--labels",
        default=None,
        help="NER: comma-separated label set (IOB2), e.g. O,B-PER,I-PER; default: O plus B-X and I-X "
        "for every entity type X in --train",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run recorded in --out (refused if its configuration or data differ)",
    )
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--kala-lr", type=float, default=1e-4)
    p.add_argument(
        "--entity-dropout",
        type=float,
        default=0.0,
        help="rate of training graph nodes made null (as unseen test entities are)",
    )
    p.add_argument(
        "--graph-rungs",
        type=int,
        default=0,
        help="smaller graph buckets batches may take: less padding, more compiled shapes (long runs)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--max-len",
        type=_positive_int,
        default=None,
        help="tokens per sentence (NER, default 128) or per window (QA, default 384)",
    )
    p.add_argument(
        "--stride",
        type=_positive_int,
        default=None,
        help="QA: context tokens between the starts of consecutive windows of a long context "
        "(default 128; run_squad's doc_stride)",
    )
    p.add_argument("--max-query", type=_positive_int, default=None, help="QA: question tokens kept (default 64)")
    p.add_argument(
        "--max-answer-len",
        type=_positive_int,
        default=None,
        help="QA: longest predicted answer, in tokens (default 30)",
    )
    p.add_argument("--max-neighbors", type=int, default=4)
    p.add_argument(
        "--train-size",
        type=_positive_int,
        default=None,
        help="random subset of training sentences (NER) or questions (QA)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="evaluate a trained KALA model (NER or QA, as trained) on a file")
    p.add_argument("--run", required=True, help="the --out folder of a train command")
    p.add_argument("--test", required=True, help="a CoNLL file (NER run) or a SQuAD-format JSON file (QA run)")
    p.add_argument("--graph", default=None, help="knowledge folder (default: the one used for training)")
    p.add_argument(
        "--predictions",
        default=None,
        help="QA: write {question id: answer text} here (default: <run>/<test file name>.predictions.json)",
    )
    p.add_argument(
        "--chart",
        default=None,
        help="also draw the scores as a PNG bar chart here (NER: F1 per entity type; QA: EM and F1)",
    )
    p.set_defaults(func=_eval)


def _task_of(path) -> str:
    """``qa`` for a SQuAD-format file, ``ner`` for anything else (read as CoNLL)."""
    from jsteer.kala.qa import is_squad_file

    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return "qa" if is_squad_file(path) else "ner"


def _resolve_task(args) -> str:
    """The run's task (``--task``, else from ``--train``), checked against the files and the
    task-specific options; fills in the options' task defaults on ``args``."""
    task = _task_of(args.train)
    if args.task is not None and args.task != task:
        raise ValueError(
            f"--task {args.task}, but --train {args.train} is {TASK_FILES[task]}, not {TASK_FILES[args.task]}"
        )
    if args.test is not None and _task_of(args.test) != task:
        raise ValueError(
            f"--test {args.test} is {TASK_FILES[_task_of(args.test)]}, but --train {args.train} is "
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


def _build_graph(args) -> int:
    from jsteer.kala.builder import build_graph
    from jsteer.kala.qa_builder import build_qa_graph

    kinds = {str(p): _task_of(p) for p in args.files}
    if len(set(kinds.values())) > 1:
        squad = [p for p, k in kinds.items() if k == "qa"]
        conll = [p for p, k in kinds.items() if k == "ner"]
        raise ValueError(
            f"{squad[0]} is {TASK_FILES['qa']} and {conll[0]} is {TASK_FILES['ner']}; give files of "
            f"one kind (build one graph folder per task)"
        )
    options = dict(
        facts_path=args.facts,
        corpus_paths=args.corpus,
        strategy=args.strategy,
        min_count=args.min_count,
        max_len=args.max_len,
        spacy_model=args.spacy,
        lexicon_path=args.lexicon,
    )
    with warning_lines("kala build-graph"):
        build = build_qa_graph if "qa" in kinds.values() else build_graph
        s = build(args.files, args.out, overwrite=args.overwrite, **options)
    for name, f in s["files"].items():
        count = (
            f"{f['questions']} questions, {f['contexts']} contexts"
            if "questions" in f
            else f"{f['sentences']} sentences"
        )
        print(f"{name}: {count}, {f['mentions']} mentions -> {args.out}/{f['mentions_file']}")
    print(f"{s['n_facts']} facts, {len(s['relations'])} relations -> {args.out}/facts.jsonl")
    print(f"{s['fact_entities_in_mentions']} of the {s['fact_entities']} entities named by the facts are mention ids")
    return 0


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


def _train(args) -> int:
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
        _check_gold(args.test, [ex for ex, _ in test_split])
        if args.test:
            _check_predictions_path(_predictions_path(out, args.test), args.test, "the predictions file")
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
        metrics["test"] = _qa_scores(
            model, fit.params, data.test, data.test_examples, args.max_answer_len, _predictions_path(out, args.test)
        )
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


def _check_predictions_path(path, test, what="--predictions") -> None:
    """Where QA predictions go must not be the --test file (its gold answers), another
    SQuAD-format data file, or a folder: checked before any model is loaded."""
    path, test = pathlib.Path(path), pathlib.Path(test)
    if path.is_dir():
        raise ValueError(
            f"{what} {path} is a folder; give the path of a file to write the {{question id: answer}} predictions to"
        )
    same = path.resolve() == test.resolve() or (path.exists() and test.exists() and path.samefile(test))
    if same:
        raise ValueError(
            f"{what} {path} is the --test file {test}; writing the predictions there would replace its "
            f"gold answers: choose another path"
        )
    if path.is_file() and _is_squad_data(path):
        raise ValueError(
            f'{what} {path} is a SQuAD-format data file (it has "data"); writing the predictions there '
            f"would replace it: choose another path"
        )


def _is_squad_data(path) -> bool:
    """Whether ``path`` holds a SQuAD-format dataset (a JSON object with a "data" list; a
    predictions file maps ids to answer strings)."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read(1024).lstrip()[:1] != "{":
                return False
            f.seek(0)
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("data"), list)


def _predictions_path(run, test) -> pathlib.Path:
    return pathlib.Path(run) / f"{pathlib.Path(test).name}.predictions.json"


def _check_gold(path, examples) -> None:
    """SQuAD v1.1 EM / F1 need a gold answer for every question of a test file."""
    from jsteer.kala.qa import first_unanswered

    ex = first_unanswered(examples)
    if ex is not None:
        raise ValueError(
            f"{path}: question {ex.qid!r} has no answers; SQuAD v1.1 exact match and F1 need at "
            f"least one gold answer per question (unanswerable questions are not supported)"
        )


def _qa_scores(model, params, features, examples, max_answer_len, predictions_path) -> dict:
    """SQuAD EM / F1 of the model's answers (written to ``predictions_path`` as {id: text})."""
    from jsteer.kala import qa
    from jsteer.kala import train as ktrain
    from jsteer.kala.metrics import squad_scores

    preds = ktrain.predict_qa(model, params, features, examples, max_answer_len=max_answer_len, progress=True)
    predictions_path = pathlib.Path(predictions_path)
    predictions_path.parent.mkdir(parents=True, exist_ok=True)
    predictions_path.write_text(json.dumps(preds, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return {**squad_scores(preds, qa.gold_answers(examples)), "predictions": str(predictions_path)}


def _eval(args) -> int:
    import jsteer
    from jsteer.checkpoints import load_artifact
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab
    from jsteer.kala.formats import read_facts
    from jsteer.kala.model import KalaConfig, KalaModel

    t0 = time.time()
    if args.predictions is not None:  # before anything is loaded or evaluated
        _check_predictions_path(args.predictions, args.test)
    if args.chart is not None and pathlib.Path(args.chart).is_dir():
        raise ValueError(f"--chart {args.chart}: is a folder, not a PNG file path")
    params, meta = load_artifact(pathlib.Path(args.run) / "model")
    task = meta.get("task")
    if task not in TASK_FILES:
        raise ValueError(f"{args.run}/model is not a KALA NER or QA model (meta task={task!r})")
    if _task_of(args.test) != task:
        raise ValueError(
            f"{args.run} is {'a QA' if task == 'qa' else 'an NER'} run, but --test {args.test} is "
            f"{TASK_FILES[_task_of(args.test)]}; evaluate it on {TASK_FILES[task]}"
        )
    if args.predictions is not None and task != "qa":
        raise ValueError("--predictions is for QA runs; an NER eval prints its scores only")
    if task == "qa" and args.predictions is None:
        _check_predictions_path(_predictions_path(args.run, args.test), args.test, "the predictions path")
    lm = jsteer.load(meta["model"])
    graph = args.graph or meta["graph"]
    vocab, relations = EntityVocab(meta["entities"]), RelationVocab(meta["relations"])
    kg = KnowledgeGraph(read_facts(pathlib.Path(graph) / "facts.jsonl"), relations)
    lexicon = _eval_lexicon(args.test, graph)
    if task == "qa":
        with warning_lines("kala eval"):
            split = pipeline.read_qa_split(args.test, graph, lexicon=lexicon, strict=False)
        examples = [ex for ex, _ in split]
        _check_gold(args.test, examples)
        test = pipeline.encode_qa_split(
            split, lm.tokenizer, vocab, kg, meta["max_len"], meta["stride"], meta["max_query"], meta["max_neighbors"]
        )
        model = KalaModel(lm.config, KalaConfig.from_dict(meta["kala"]), task="qa")
        scores = _qa_scores(
            model,
            params,
            test,
            examples,
            meta["max_answer_len"],
            args.predictions or _predictions_path(args.run, args.test),
        )
        print(json.dumps(scores))
        _eval_end(args, t0, scores, {"exact match": scores["exact_match"], "F1": scores["f1"]}, "QA")
        return 0
    labels = tuple(meta["labels"])
    split = pipeline.read_split(args.test, graph, labels, meta["scheme"], lexicon=lexicon)
    test = pipeline.encode_split(split, lm.tokenizer, labels, vocab, kg, meta["max_len"], meta["max_neighbors"])
    model = KalaModel(lm.config, KalaConfig.from_dict(meta["kala"]), task="ner", num_labels=len(labels))
    data = pipeline.NERData(labels, [], test, [], [t for _, t, _ in split], vocab, relations, kg)
    scores = ktrain.evaluate_ner(
        model,
        params,
        test,
        data.test_tags,
        labels,
        subsets=data.subsets(),
        progress=True,
        per_type=args.chart is not None,
    )
    per_type = scores.pop("per_type", None)
    print(json.dumps(scores))
    _eval_end(args, t0, scores, {**(per_type or {}), "all": scores["f1"]}, "NER")
    return 0


def _eval_end(args, t0: float, scores: dict, bars: dict, what: str) -> None:
    """``--chart`` (if given) and the one-line summary of ``kala eval``."""
    if args.chart is not None:
        from jsteer import plots

        plots.scores_chart(bars, args.chart, title=f"{args.run} on {pathlib.Path(args.test).name}: {what}")
    progress.summary(
        "kala eval",
        f"evaluated {args.run} on {args.test}",
        time.time() - t0,
        args.chart or scores.get("predictions"),
        f1=scores.get("f1"),
        **({"exact_match": scores["exact_match"]} if "exact_match" in scores else {}),
    )


def _eval_lexicon(test, graph):
    """The graph folder's lexicon when it has no mentions file for ``test`` (annotated in memory,
    as ``build-graph --lexicon`` would, and said on stderr); None otherwise."""
    from jsteer.kala import pipeline
    from jsteer.kala.mining import Lexicon

    graph = pathlib.Path(graph)
    if pipeline.mentions_path(graph, test).is_file() or not (graph / "lexicon.tsv").is_file():
        return None
    print(
        f"note: {graph} has no mentions for {test}; annotating it in memory with {graph / 'lexicon.tsv'} "
        f"(to write them: jsteer kala build-graph {test} --lexicon {graph / 'lexicon.tsv'} --out {graph})",
        file=sys.stderr,
    )
    return Lexicon.load(graph / "lexicon.tsv")
