"""``jsteer kala eval``, and the task, predictions-path and QA-scoring checks ``train`` shares.

A run's task is ``ner`` (CoNLL files) or ``qa`` (SQuAD v1.1 files, :data:`TASK_FILES`); QA
predictions are ``{question id: answer text}`` JSON, written to
``<run>/<test file name>.predictions.json`` unless ``--predictions`` says where (never the
``--test`` file, another SQuAD-format data file or a folder). Scores: NER entity-level F1 (per
type for ``--chart``), QA SQuAD v1.1 exact match and F1 (percent).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from jsteer import progress
from jsteer.cli import warning_lines

TASK_FILES = {"ner": "a CoNLL file (NER)", "qa": "a SQuAD-format JSON file (extractive QA)"}


def task_of(path) -> str:
    """``qa`` for a SQuAD-format file, ``ner`` for anything else (read as CoNLL)."""
    from jsteer.kala.qa import is_squad_file

    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return "qa" if is_squad_file(path) else "ner"


def check_predictions_path(path, test, what="--predictions") -> None:
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


def default_predictions_path(run, test) -> pathlib.Path:
    return pathlib.Path(run) / f"{pathlib.Path(test).name}.predictions.json"


def check_gold(path, examples) -> None:
    """SQuAD v1.1 EM / F1 need a gold answer for every question of a test file."""
    from jsteer.kala.qa import first_unanswered

    ex = first_unanswered(examples)
    if ex is not None:
        raise ValueError(
            f"{path}: question {ex.qid!r} has no answers; SQuAD v1.1 exact match and F1 need at "
            f"least one gold answer per question (unanswerable questions are not supported)"
        )


def qa_scores(model, params, features, examples, max_answer_len, predictions_path) -> dict:
    """SQuAD EM / F1 of the model's answers (written to ``predictions_path`` as {id: text})."""
    from jsteer.kala import qa
    from jsteer.kala import train as ktrain
    from jsteer.kala.metrics import squad_scores

    preds = ktrain.predict_qa(model, params, features, examples, max_answer_len=max_answer_len, progress=True)
    predictions_path = pathlib.Path(predictions_path)
    predictions_path.parent.mkdir(parents=True, exist_ok=True)
    predictions_path.write_text(json.dumps(preds, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return {**squad_scores(preds, qa.gold_answers(examples)), "predictions": str(predictions_path)}


def run_eval(args) -> int:
    import jsteer
    from jsteer.checkpoints import load_artifact
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab
    from jsteer.kala.formats import read_facts
    from jsteer.kala.model import KalaConfig, KalaModel

    t0 = time.time()
    if args.predictions is not None:  # before anything is loaded or evaluated
        check_predictions_path(args.predictions, args.test)
    if args.chart is not None and pathlib.Path(args.chart).is_dir():
        raise ValueError(f"--chart {args.chart}: is a folder, not a PNG file path")
    params, meta = load_artifact(pathlib.Path(args.run) / "model")
    task = meta.get("task")
    if task not in TASK_FILES:
        raise ValueError(f"{args.run}/model is not a KALA NER or QA model (meta task={task!r})")
    if task_of(args.test) != task:
        raise ValueError(
            f"{args.run} is {'a QA' if task == 'qa' else 'an NER'} run, but --test {args.test} is "
            f"{TASK_FILES[task_of(args.test)]}; evaluate it on {TASK_FILES[task]}"
        )
    if args.predictions is not None and task != "qa":
        raise ValueError("--predictions is for QA runs; an NER eval prints its scores only")
    if task == "qa" and args.predictions is None:
        check_predictions_path(default_predictions_path(args.run, args.test), args.test, "the predictions path")
    lm = jsteer.load(meta["model"])
    graph = args.graph or meta["graph"]
    vocab, relations = EntityVocab(meta["entities"]), RelationVocab(meta["relations"])
    kg = KnowledgeGraph(read_facts(pathlib.Path(graph) / "facts.jsonl"), relations)
    lexicon = _eval_lexicon(args.test, graph)
    if task == "qa":
        with warning_lines("kala eval"):
            split = pipeline.read_qa_split(args.test, graph, lexicon=lexicon, strict=False)
        examples = [ex for ex, _ in split]
        check_gold(args.test, examples)
        test = pipeline.encode_qa_split(
            split, lm.tokenizer, vocab, kg, meta["max_len"], meta["stride"], meta["max_query"], meta["max_neighbors"]
        )
        model = KalaModel(lm.config, KalaConfig.from_dict(meta["kala"]), task="qa")
        scores = qa_scores(
            model,
            params,
            test,
            examples,
            meta["max_answer_len"],
            args.predictions or default_predictions_path(args.run, args.test),
        )
        print(json.dumps(scores))
        _eval_end(args, t0, scores, {"exact match": scores["exact_match"], "F1": scores["f1"]}, "QA")
        return 0
    labels = tuple(meta["labels"])
    split = pipeline.read_split(args.test, graph, labels, meta["scheme"], lexicon=lexicon, data_dir=args.data_dir)
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
