"""``jsteer kala``: build knowledge graphs, train and evaluate KALA NER models.

    jsteer kala build-graph train.conll dev.conll test.conll --out graphs/ [--facts triples.jsonl]
                            [--corpus more.txt] [--strategy capitalised|frequent|both] [--spacy en_core_web_sm]
    jsteer kala train --train train.conll --graph graphs/ --out runs/kala [--test test.conll]
                      [--model minilm] [--method relational] [--layers 3 5] [--epochs 3] [--lr 5e-5]
                      [--kala-lr 1e-4] [--entity-dropout 0.3] [--batch-size 32] [--max-len 128]
                      [--scheme iob1|iob2]
    jsteer kala eval --run runs/kala --test test.conll [--graph graphs/]

``train`` writes ``<out>/checkpoints`` (Orbax, resumable), ``<out>/log.jsonl`` (metrics),
``<out>/model`` (the trained params as a jsteer artifact with the entity vocabulary,
relations, configs and labels in its metadata) and ``<out>/metrics.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys


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
    from jsteer.data.readers import read_conll

    tags = {t for s in read_conll(path, scheme=scheme) for t in s.tags}
    return ("O",) + tuple(sorted(tags - {"O"}, key=lambda t: (t[2:], t[0])))


def _build_graph(args) -> int:
    from jsteer.kala.builder import build_graph

    s = build_graph(args.conll, args.out, facts_path=args.facts, corpus_paths=args.corpus, strategy=args.strategy,
                    min_count=args.min_count, max_len=args.max_len, spacy_model=args.spacy)
    for name, f in s["files"].items():
        print(f"{name}: {f['sentences']} sentences, {f['mentions']} mentions -> {args.out}/{f['mentions_file']}")
    print(f"{s['n_facts']} facts, {len(s['relations'])} relations -> {args.out}/facts.jsonl")
    return 0


def _train(args) -> int:
    import jsteer
    from jsteer.io import save_artifact
    from jsteer.kala import pipeline, train as ktrain
    from jsteer.kala.model import KalaConfig

    lm = jsteer.load(args.model)
    if lm.family != "bert":
        raise ValueError(f"KALA needs a BERT-family encoder; {args.model} is {lm.family}")
    labels = _labels_of(args.train, args.scheme)
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
    out = pathlib.Path(args.out)
    fit = ktrain.fit(model, params, data.train, cfg, checkpoint_dir=out / "checkpoints", log_path=out / "log.jsonl",
                     progress=sys.stderr.isatty())
    meta = {"task": "ner", "model": str(args.model), "labels": list(labels), "scheme": args.scheme,
            "kala": dataclasses.asdict(model.kala), "graph": str(pathlib.Path(args.graph).resolve()),
            "entities": data.vocab.ids[1:], "relations": data.relations.to_list(), "max_len": args.max_len,
            "max_neighbors": args.max_neighbors, "train": dataclasses.asdict(cfg)}
    save_artifact(out / "model", fit.params, meta)
    metrics = {"steps": fit.steps, "final_loss": fit.losses[-1], "train_seconds": fit.train_seconds,
               "examples_per_second": fit.examples_per_second}
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
    split = pipeline.read_split(args.test, graph, labels, meta["scheme"])
    test = pipeline.encode_split(split, lm.tokenizer, labels, vocab, kg, meta["max_len"], meta["max_neighbors"])
    model = KalaModel(lm.config, KalaConfig.from_dict(meta["kala"]), task="ner", num_labels=len(labels))
    data = pipeline.NERData(labels, [], test, [], [t for _, t, _ in split], vocab, relations, kg)
    scores = ktrain.evaluate_ner(model, params, test, data.test_tags, labels, subsets=data.subsets())
    print(json.dumps(scores))
    return 0
