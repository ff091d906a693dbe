"""``jsteer kala``: build knowledge graphs, train and evaluate KALA NER models.

    jsteer kala build-graph train.conll dev.conll test.conll --out graphs/ [--facts triples.jsonl]
                            [--corpus more.txt] [--strategy capitalised|frequent|both] [--spacy en_core_web_sm]
    jsteer kala build-graph new.conll --lexicon graphs/lexicon.tsv --out graphs/   (annotate only)
    jsteer kala train --train train.conll --graph graphs/ --out runs/kala [--test test.conll]
                      [--model minilm] [--method relational] [--layers 3 5] [--epochs 3] [--lr 5e-5]
                      [--kala-lr 1e-4] [--entity-dropout 0.3] [--batch-size 32] [--max-len 128]
                      [--scheme iob1|iob2] [--labels O,B-PER,I-PER,...] [--resume]
    jsteer kala eval --run runs/kala --test test.conll [--graph graphs/]

``train`` writes ``<out>/run.json`` (configuration and data fingerprints), ``<out>/checkpoints``
(Orbax), ``<out>/log.jsonl`` (metrics), ``<out>/model`` (the trained params as a jsteer artifact
with the entity vocabulary, relations, configs and labels in its metadata) and
``<out>/metrics.json``. ``--out`` must be new or empty; ``--resume`` continues the run recorded
there and is refused when its configuration or data differ (see :mod:`jsteer.kala.runs`).
The label set is O plus B-X and I-X for every entity type X of the training file (or ``--labels``).
``eval`` on a file the graph folder has no mentions for annotates it in memory with the
folder's lexicon.tsv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import warnings


def register(subparsers) -> None:
    kala = subparsers.add_parser("kala", help="KALA: knowledge-augmented NER (build-graph, train, eval)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = kala.add_subparsers(dest="kala_command", required=True)

    p = sub.add_parser("build-graph", help="mine entity mentions and facts from CoNLL files (labels unused)")
    p.add_argument("conll", nargs="+", help="CoNLL files (only the token column is read)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--facts", default=None, help="JSON Lines triples {h, r, t} to use instead of extracted facts")
    p.add_argument("--corpus", nargs="*", default=(), help="extra unlabeled text, one sentence a line")
    p.add_argument("--strategy", choices=("capitalised", "frequent", "both"), default="capitalised")
    p.add_argument("--min-count", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4, help="longest entity surface form, in words")
    p.add_argument("--spacy", default=None, help="spaCy pipeline to use instead of the lexicon (if installed)")
    p.add_argument("--lexicon", default=None,
                   help="annotate only: match this lexicon.tsv (e.g. a trained run's graph folder's) instead of "
                        "mining one; the folder's facts.jsonl is kept (or copied from beside the lexicon)")
    p.set_defaults(func=_build_graph)

    p = sub.add_parser("train", help="fine-tune a BERT-family model with KALA (or a baseline) for NER")
    p.add_argument("--train", required=True)
    p.add_argument("--test", default=None, help="evaluate on this CoNLL file at the end")
    p.add_argument("--graph", required=True, help="folder written by build-graph")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="minilm", help="anything jsteer.load accepts (a BERT-family encoder)")
    p.add_argument("--method", choices=("finetune", "more_params", "pointwise", "relational"), default="relational")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="KFM layers (default: the last layers)")
    p.add_argument("--no-gamma", action="store_true")
    p.add_argument("--no-beta", action="store_true")
    p.add_argument("--scheme", choices=("iob1", "iob2"), default="iob1")
    p.add_argument("--labels", default=None,
                   help="comma-separated label set (IOB2), e.g. O,B-PER,I-PER; default: O plus B-X and I-X for "
                        "every entity type X in --train")
    p.add_argument("--resume", action="store_true",
                   help="continue the run recorded in --out (refused if its configuration or data differ)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--kala-lr", type=float, default=1e-4)
    p.add_argument("--entity-dropout", type=float, default=0.0,
                   help="rate of training graph nodes made null (as unseen test entities are)")
    p.add_argument("--graph-rungs", type=int, default=0,
                   help="smaller graph buckets batches may take: less padding, more compiled shapes (long runs)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--max-neighbors", type=int, default=4)
    p.add_argument("--train-size", type=int, default=None, help="random subset of training sentences")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="evaluate a trained KALA NER model on a CoNLL file")
    p.add_argument("--run", required=True, help="the --out folder of a train command")
    p.add_argument("--test", required=True)
    p.add_argument("--graph", default=None, help="knowledge folder (default: the one used for training)")
    p.set_defaults(func=_eval)


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

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = build_graph(args.conll, args.out, facts_path=args.facts, corpus_paths=args.corpus,
                        strategy=args.strategy, min_count=args.min_count, max_len=args.max_len,
                        spacy_model=args.spacy, lexicon_path=args.lexicon)
    for w in caught:  # one plain line each, not Python's file:line + source echo
        print(f"jsteer kala build-graph: WARNING: {w.message}", file=sys.stderr)
    for name, f in s["files"].items():
        print(f"{name}: {f['sentences']} sentences, {f['mentions']} mentions -> {args.out}/{f['mentions_file']}")
    print(f"{s['n_facts']} facts, {len(s['relations'])} relations -> {args.out}/facts.jsonl")
    print(f"{s['fact_entities_in_mentions']} of the {s['fact_entities']} entities named by the facts are mention ids")
    return 0


def _run_record(args, labels) -> dict:
    """run.json of a train command: what decides its numbers (compared on --resume)."""
    from jsteer.kala import pipeline
    from jsteer.convert.hf import file_sha256 as file_digest

    graph = pathlib.Path(args.graph)
    mentions = pipeline.mentions_path(graph, args.train)
    if not mentions.is_file():
        raise pipeline.missing_mentions_error(args.train, graph)
    config = {k: getattr(args, k) for k in (
        "model", "method", "layers", "no_gamma", "no_beta", "scheme", "epochs", "max_steps", "lr", "kala_lr",
        "entity_dropout", "graph_rungs", "batch_size", "max_len", "max_neighbors", "train_size", "seed")}
    config["labels"] = list(labels)
    data = {"train": file_digest(args.train), "train_mentions": file_digest(mentions),
            "facts": file_digest(graph / "facts.jsonl")}
    paths = {"train": str(pathlib.Path(args.train).resolve()), "train_mentions": str(mentions.resolve()),
             "facts": str((graph / "facts.jsonl").resolve()), "graph": str(graph.resolve())}
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
    import jsteer
    from jsteer.io import save_artifact
    from jsteer.kala import pipeline, runs, train as ktrain
    from jsteer.kala.model import KalaConfig

    out = pathlib.Path(args.out)
    if not args.resume:
        runs.check_fresh(out)  # before anything slow
    labels = _parse_labels(args.labels) if args.labels else _labels_of(args.train, args.scheme)
    if not (pathlib.Path(args.graph) / "facts.jsonl").is_file():
        raise FileNotFoundError(f"--graph {args.graph}: no facts.jsonl (write the folder with jsteer kala build-graph)")
    record = _run_record(args, labels)
    runs.check(out, record, args.resume)
    lm = jsteer.load(args.model)
    if lm.family != "bert":
        raise ValueError(f"KALA needs a BERT-family encoder; {args.model} is {lm.family}")
    data = pipeline.load_ner_data(args.train, args.test or args.train, args.graph, lm.tokenizer, labels=labels,
                                  scheme=args.scheme, max_len=args.max_len, max_neighbors=args.max_neighbors,
                                  train_size=args.train_size)
    kala = KalaConfig(method=args.method, layers=tuple(args.layers) if args.layers else None,
                      use_gamma=not args.no_gamma, use_beta=not args.no_beta, entity_dropout=args.entity_dropout)
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab) \
        if kala.uses_knowledge else None
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, kala, memory, seed=args.seed)
    cfg = ktrain.TrainConfig(lr=args.lr, kala_lr=args.kala_lr, batch_size=args.batch_size, max_len=args.max_len,
                             epochs=args.epochs, max_steps=args.max_steps, seed=args.seed, graph_rungs=args.graph_rungs)
    runs.write(out, record)  # only now: a command that failed before training leaves --out as it was
    fit = ktrain.fit(model, params, data.train, cfg, checkpoint_dir=out / "checkpoints", log_path=out / "log.jsonl",
                     progress=sys.stderr.isatty())
    if fit.steps == 0:
        print(f"{out}: the checkpoint is already at step {fit.last_step}; no training step run", file=sys.stderr)
    meta = {"task": "ner", "model": str(args.model), "labels": list(labels), "scheme": args.scheme,
            "kala": dataclasses.asdict(model.kala), "graph": str(pathlib.Path(args.graph).resolve()),
            "entities": data.vocab.ids[1:], "relations": data.relations.to_list(), "max_len": args.max_len,
            "max_neighbors": args.max_neighbors, "train": dataclasses.asdict(cfg)}
    save_artifact(out / "model", fit.params, meta)
    final_loss = fit.losses[-1] if fit.losses else _last_logged_loss(out / "log.jsonl")
    metrics = {"steps": fit.last_step, "steps_run": fit.steps, "final_loss": final_loss,
               "train_seconds": fit.train_seconds, "examples_per_second": fit.examples_per_second}
    if args.test:
        metrics["test"] = ktrain.evaluate_ner(model, fit.params, data.test, data.test_tags, labels,
                                              subsets=data.subsets())
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(json.dumps(metrics))
    return 0


def _eval(args) -> int:
    import jsteer
    from jsteer.io import load_artifact
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab
    from jsteer.kala.formats import read_facts
    from jsteer.kala.model import KalaConfig, KalaModel

    params, meta = load_artifact(pathlib.Path(args.run) / "model")
    if meta.get("task") != "ner":
        raise ValueError(f"{args.run}/model is not a KALA NER model (meta task={meta.get('task')!r})")
    lm = jsteer.load(meta["model"])
    graph = args.graph or meta["graph"]
    labels = tuple(meta["labels"])
    vocab, relations = EntityVocab(meta["entities"]), RelationVocab(meta["relations"])
    kg = KnowledgeGraph(read_facts(pathlib.Path(graph) / "facts.jsonl"), relations)
    split = pipeline.read_split(args.test, graph, labels, meta["scheme"], lexicon=_eval_lexicon(args.test, graph))
    test = pipeline.encode_split(split, lm.tokenizer, labels, vocab, kg, meta["max_len"], meta["max_neighbors"])
    model = KalaModel(lm.config, KalaConfig.from_dict(meta["kala"]), task="ner", num_labels=len(labels))
    data = pipeline.NERData(labels, [], test, [], [t for _, t, _ in split], vocab, relations, kg)
    scores = ktrain.evaluate_ner(model, params, test, data.test_tags, labels, subsets=data.subsets())
    print(json.dumps(scores))
    return 0


def _eval_lexicon(test, graph):
    """The graph folder's lexicon when it has no mentions file for ``test`` (annotated in memory,
    as ``build-graph --lexicon`` would, and said on stderr); None otherwise."""
    from jsteer.kala import pipeline
    from jsteer.kala.builder import Lexicon

    graph = pathlib.Path(graph)
    if pipeline.mentions_path(graph, test).is_file() or not (graph / "lexicon.tsv").is_file():
        return None
    print(f"note: {graph} has no mentions for {test}; annotating it in memory with {graph / 'lexicon.tsv'} "
          f"(to write them: jsteer kala build-graph {test} --lexicon {graph / 'lexicon.tsv'} --out {graph})",
          file=sys.stderr)
    return Lexicon.load(graph / "lexicon.tsv")
