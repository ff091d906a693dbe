"""``jsteer kala``: build knowledge graphs, train and evaluate KALA models for NER and extractive QA.

    jsteer kala build-graph train.conll dev.conll test.conll --out graphs/ [--facts triples.jsonl]
        [--corpus more.txt] [--strategy capitalised|frequent|abbreviation|both] [--spacy en_core_web_sm]
    jsteer kala build-graph new.conll --lexicon graphs/lexicon.tsv --out graphs/   (annotate only)
    jsteer kala build-graph train.conll --out graphs/ --overwrite                  (replace a graph)
    jsteer kala train --train train.conll --graph graphs/ --out runs/kala [--test test.conll]
                      [--model minilm] [--method relational] [--layers 3 5] [--epochs 3] [--lr 5e-5]
                      [--kala-lr 1e-4] [--entity-dropout 0.3] [--batch-size 32] [--max-len 128]
                      [--scheme iob1|iob2] [--labels O,B-PER,I-PER,...] [--resume]
    jsteer kala train --tfds jsteer_conll_ner/src_0123456789ab:train --tfds-data-dir tfds/ --test-split test
                      --graph graphs/ --out runs/kala    (NER from a prepared TFDS data set)
    jsteer kala eval --run runs/kala --test test.conll [--graph graphs/]

CoNLL files are read through the TFDS layer (:mod:`jsteer.data.sources`): prepared once by
``jsteer.data.tfds_builders.ConllNer`` into ``--data-dir`` (default ``$JSTEER_DATA_DIR``; the
cache is keyed by the file's content) and read with ``tfds.data_source``. ``--tfds`` trains on
a prepared data set instead (features ``tokens`` and ``tags``; its tag vocabulary gives the
label set); its mentions are the graph's ``<file>.mentions.jsonl`` of the file a jsteer
builder prepared it from, else the graph's lexicon.tsv annotates it in memory (said on stderr).

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

This module is the argparse table of the three subcommands and ``build-graph``;
``train`` is :mod:`jsteer.kala.cli_train`, ``eval`` (with the task, predictions-path and QA
scoring checks ``train`` shares) :mod:`jsteer.kala.cli_eval`.
"""

from __future__ import annotations

import argparse
import time

from jsteer.cli import add_data_dirs, method_group, warning_lines
from jsteer.kala.cli_eval import TASK_FILES, run_eval, task_of
from jsteer.kala.cli_train import run_train
from jsteer.kala.mining import STRATEGIES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def register(subparsers) -> None:
    sub = method_group(
        subparsers, "kala", "KALA: knowledge-augmented NER and extractive QA (build-graph, train, eval)", __doc__
    )

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
        help="lexicon mining (jsteer.kala.mining's docstring): capitalised runs (news), frequent "
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

    p = sub.add_parser(
        "train",
        help="fine-tune a BERT-family model with KALA (or a baseline) for NER or extractive QA",
        description="Fine-tune with KALA on a CoNLL file (NER; read through the TFDS layer: prepared once "
        "into --data-dir and read with tfds.data_source), a prepared TFDS data set with tokens and "
        "tags features (--tfds, NER), or a SQuAD-format JSON file (QA).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--train", default=None, help="a CoNLL file (NER) or a SQuAD-format JSON file (QA)")
    src.add_argument(
        "--tfds",
        default=None,
        metavar="NAME[/CONFIG][:SPLIT]",
        help="NER: train on a prepared TFDS data set in --tfds-data-dir instead (features tokens and tags; "
        "SPLIT default: train, or its only split). Mentions: the graph's <file>.mentions.jsonl of the file "
        "it was prepared from, else the graph's lexicon.tsv in memory",
    )
    p.add_argument("--test", default=None, help="evaluate on this file (of the same kind as --train) at the end")
    p.add_argument("--test-split", default=None, help="with --tfds: evaluate on this split of the data set at the end")
    add_data_dirs(p, "CoNLL files are")
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
    for flag, what in (
        ("--max-len", "tokens per sentence (NER, default 128) or per window (QA, default 384)"),
        (
            "--stride",
            "QA: context tokens between the starts of consecutive windows of a long context "
            "(default 128; run_squad's doc_stride)",
        ),
        ("--max-query", "QA: question tokens kept (default 64)"),
        ("--max-answer-len", "QA: longest predicted answer, in tokens (default 30)"),
    ):
        p.add_argument(flag, type=_positive_int, default=None, help=what)
    p.add_argument("--max-neighbors", type=int, default=4)
    p.add_argument(
        "--train-size",
        type=_positive_int,
        default=None,
        help="random subset of training sentences (NER) or questions (QA)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_train)

    p = sub.add_parser("eval", help="evaluate a trained KALA model (NER or QA, as trained) on a file")
    p.add_argument("--run", required=True, help="the --out folder of a train command")
    p.add_argument("--test", required=True, help="a CoNLL file (NER run) or a SQuAD-format JSON file (QA run)")
    add_data_dirs(p, "CoNLL files are", tfds=False)
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
    p.set_defaults(func=run_eval)


def _build_graph(args) -> int:
    from jsteer import progress
    from jsteer.kala.builder import build_graph
    from jsteer.kala.qa_builder import build_qa_graph

    kinds = {str(p): task_of(p) for p in args.files}
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
    t0 = time.time()
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
    progress.summary(
        "kala build-graph",
        f"graph of {len(s['files'])} file(s)",
        time.time() - t0,
        out=args.out,
        mentions=sum(f["mentions"] for f in s["files"].values()),
        facts=s["n_facts"],
        relations=len(s["relations"]),
    )
    return 0
