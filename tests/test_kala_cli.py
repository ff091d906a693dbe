"""`jsteer kala build-graph / train / eval` on tiny CoNLL and SQuAD-format files and a tiny random BERT folder."""

import contextlib
import io
import json

import numpy as np
import pytest

from jsteer.cli import main as jsteer_main


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel

    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "the",
        "in",
        "met",
        "said",
        "today",
        ".",
        "paris",
        "london",
        "berlin",
        "anna",
        "tom",
        "rita",
        "visited",
        "from",
    ]
    d = tmp_path_factory.mktemp("tiny") / "bert"
    torch.manual_seed(0)
    BertModel(
        BertConfig(
            vocab_size=len(words),
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    ).save_pretrained(d)
    (d / "vocab.txt").write_text("\n".join(words) + "\n")
    return d


def conll(path, sents):
    path.write_text("".join("".join(f"{w} {t}\n" for w, t in s) + "\n" for s in sents))
    return path


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, tiny_bert_dir):
    """One `kala build-graph` + `kala train --test` (3 steps, the default relational method) that
    the NER CLI tests below read: training and compiling it takes most of their time. The test
    file holds a single-token training entity followed by an I- tag (Anna B-PER, Rita I-PER)."""
    tmp = tmp_path_factory.mktemp("ner_run")
    sents = _people_places(24)
    train = conll(tmp / "train.conll", sents)
    test = conll(
        tmp / "test.conll", [[("Anna", "B-PER"), ("Rita", "I-PER"), ("visited", "O"), ("Paris", "B-LOC")]] + sents[:6]
    )
    gdir, out = tmp / "graph", tmp / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    build_summary = err.getvalue().strip().splitlines()[-1]  # the job's one-line summary ends it
    args = _train_args(train, gdir, out, tiny_bert_dir, "--test", str(test))
    args[args.index("--max-steps") + 1] = "3"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert jsteer_main(args) == 0
    return dict(train=train, test=test, graph=gdir, out=out, sents=sents, build_summary=build_summary)


def test_cli_build_graph_train_eval(tmp_path, ner_run, capsys):
    train, test, gdir, out = (ner_run[k] for k in ("train", "test", "graph", "out"))
    assert (gdir / "train.conll.mentions.jsonl").is_file() and (gdir / "facts.jsonl").is_file()
    summary = ner_run["build_summary"]
    assert summary.startswith("jsteer kala build-graph: graph of 2 file(s); mentions ") and summary.endswith(
        f"s; -> {gdir}"
    ), summary
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and "f1" in metrics["test"]
    assert (out / "log.jsonl").is_file() and (out / "model").is_file() and (out / "checkpoints").is_dir()
    capsys.readouterr()
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test)]) == 0
    cap = capsys.readouterr()
    scores = json.loads(cap.out.strip().splitlines()[-1])
    assert scores["f1"] == pytest.approx(metrics["test"]["f1"])  # the saved model reproduces its scores
    assert "eval: 100%|" in cap.err and "jsteer kala eval: evaluated" in cap.err.splitlines()[-1]
    # --chart: per-type F1 bars as a PNG; --quiet: no bar, the summary line still comes
    chart = tmp_path / "charts" / "f1.png"
    assert jsteer_main(["--quiet", "kala", "eval", "--run", str(out), "--test", str(test), "--chart", str(chart)]) == 0
    cap = capsys.readouterr()
    assert chart.read_bytes().startswith(b"\x89PNG") and not list(chart.parent.glob(".*tmp"))
    assert json.loads(cap.out.strip().splitlines()[-1]) == scores  # per_type only feeds the chart
    assert "|" not in cap.err and cap.err.strip().splitlines()[-1].endswith(f"-> {chart}")
    assert jsteer_main(["kala", "eval", "--run", str(tmp_path / "nope"), "--test", str(test)]) == 2


def _people_places(n):
    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    return [
        [(people[i % 3], "B-PER"), ("visited", "O"), (places[(i // 3) % 3], "B-LOC"), ("today", "O"), (".", "O")]
        for i in range(n)
    ]


def _train_args(train, gdir, out, model, *extra):
    return [
        "kala",
        "train",
        "--train",
        str(train),
        "--graph",
        str(gdir),
        "--out",
        str(out),
        "--model",
        str(model),
        "--scheme",
        "iob2",
        "--max-steps",
        "2",
        "--batch-size",
        "8",
        "--max-len",
        "16",
        *extra,
    ]


def test_cli_train_out_folder_holds_one_run(tmp_path, tiny_bert_dir, capsys):
    """A non-empty --out needs --resume; a resume must match the recorded configuration and data;
    resuming a finished run runs no step and still writes its metrics."""
    sents = _people_places(16)
    train = conll(tmp_path / "train.conll", sents)
    other = conll(tmp_path / "other.conll", sents[::-1])
    gdir, out = tmp_path / "graph", tmp_path / "run"
    assert jsteer_main(["kala", "build-graph", str(train), str(other), "--out", str(gdir)]) == 0
    labels = "O,B-PER,I-PER,B-LOC,I-LOC,B-MISC,I-MISC"
    args = _train_args(train, gdir, out, tiny_bert_dir, "--method", "finetune", "--labels", labels)
    assert jsteer_main(args) == 0
    first = json.loads((out / "metrics.json").read_text())
    assert first["steps"] == first["steps_run"] == 2
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["method"] == "finetune" and record["config"]["labels"] == labels.split(",")
    from jsteer.io import load_artifact

    assert load_artifact(out / "model")[1]["labels"] == labels.split(",")  # eval reads the run's label list
    capsys.readouterr()
    assert jsteer_main(args) == 2  # the same command again: refused, nothing resumed
    err = capsys.readouterr().err
    assert f"--out {out} is not empty" in err and "--resume" in err
    assert jsteer_main(args + ["--resume"]) == 0  # finished already: zero steps, metrics still written
    again = json.loads((out / "metrics.json").read_text())
    assert again["steps"] == 2 and again["steps_run"] == 0 and again["final_loss"] == pytest.approx(first["final_loss"])
    capsys.readouterr()
    changed = _train_args(other, gdir, out, tiny_bert_dir, "--method", "pointwise", "--labels", labels, "--resume")
    assert jsteer_main(changed) == 2
    err = capsys.readouterr().err
    assert "config.method: recorded 'finetune', now 'pointwise'" in err and "data.train:" in err
    assert "data.train_mentions:" in err and "Traceback" not in err and len(err) < 2000
    assert json.loads((out / "run.json").read_text()) == record  # the refused resume changed nothing


def test_cli_label_set_has_i_tags_and_eval_annotates_new_files(tmp_path, ner_run, capsys):
    """Single-token training entities still give I-X labels (a test file may use them); eval on a
    file the graph has no mentions for uses the graph's lexicon, as build-graph --lexicon does."""
    sents, gdir, out = ner_run["sents"], ner_run["graph"], ner_run["out"]
    assert all(len([w for w, t in s if t != "O"]) == 2 for s in sents)  # single-token entities only
    assert json.loads((out / "run.json").read_text())["config"]["labels"] == ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    (tmp_path / "new").mkdir()
    new = conll(tmp_path / "new" / "fresh.conll", sents[5:9])
    facts = (gdir / "facts.jsonl").read_bytes()
    capsys.readouterr()
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(new)]) == 0
    captured = capsys.readouterr()
    auto = json.loads(captured.out.strip().splitlines()[-1])
    assert f"build-graph {new} --lexicon {gdir / 'lexicon.tsv'} --out {gdir}" in captured.err
    assert not (gdir / "fresh.conll.mentions.jsonl").exists()  # annotated in memory only
    lexicon = str(gdir / "lexicon.tsv")
    assert jsteer_main(["kala", "build-graph", str(new), "--lexicon", lexicon, "--out", str(gdir)]) == 0
    assert (gdir / "facts.jsonl").read_bytes() == facts
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(new)]) == 0
    written = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert written == auto and written["n_seen"] > 0  # the same mentions either way


def test_cli_missing_mentions_name_the_command_and_labels_are_checked(tmp_path, capsys):
    from jsteer.kala import cli_train as kcli
    from jsteer.kala import pipeline

    gdir = tmp_path / "graph"
    gdir.mkdir()
    (gdir / "lexicon.tsv").write_text("cased\tAnna\tanna\n")
    test = conll(tmp_path / "t.conll", _people_places(2))
    with pytest.raises(
        ValueError,
        match=rf"no mentions for {test}; .*jsteer kala build-graph {test} --lexicon "
        rf"{gdir / 'lexicon.tsv'} --out {gdir}",
    ):
        pipeline.read_split(test, gdir, ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"], "iob2")
    assert kcli._parse_labels(" O, B-X ,I-X") == ("O", "B-X", "I-X")
    for bad, msg in (("B-X,I-X", "must include 'O'"), ("O,B-X,B-X", "B-X given twice"), ("O,PER", "'PER' is not IOB")):
        with pytest.raises(ValueError, match=msg):
            kcli._parse_labels(bad)


# --- extractive QA through the CLI, and build-graph on a folder that holds a graph ----------------


def squad(path, n, seed=0):
    """A SQuAD v1.1 file of ``n`` generated questions, two per context; names are capitalised
    (mined by build-graph) and every answer occurs once in its context."""
    from jsteer.kala import qa

    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    examples = []
    for i in range(n // 2):
        p, r = people[(i + seed) % 3], people[(i + seed + 1) % 3]
        q, q2 = places[(i // 3) % 3], places[(i // 3 + 1) % 3]
        ctx = f"Today {p} visited {q} and met {r} in {q2}."
        examples.append(qa.QAExample(f"s{seed}q{2 * i}", f"who visited {q.lower()} ?", ctx, ((p, ctx.index(p)),)))
        examples.append(
            qa.QAExample(
                f"s{seed}q{2 * i + 1}", f"where did {p.lower()} meet {r.lower()} ?", ctx, ((q2, ctx.index(q2)),)
            )
        )
    qa.write_squad(path, examples)
    return path


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def test_cli_qa_build_graph_train_eval(tmp_path, tiny_bert_dir, capsys):
    """SQuAD-format files through build-graph (mentions in the contexts, keyed by question id),
    train (task from the file, windows with --stride) and eval: EM / F1 are those of the written
    predictions against the test file's gold answers; a QA run takes no NER data."""
    from jsteer.kala import qa
    from jsteer.kala.formats import read_mentions
    from jsteer.kala.metrics import squad_scores

    train, test = squad(tmp_path / "train.json", 24), squad(tmp_path / "test.json", 6, seed=1)
    gdir, out = tmp_path / "graph", tmp_path / "run"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    n_contexts = len({e.context for e in qa.read_squad(train)})  # questions share contexts, as in SQuAD
    assert f"train.json: 24 questions, {n_contexts} contexts" in capsys.readouterr().out
    examples = qa.read_squad(test)
    mentions = read_mentions(gdir / "test.json.mentions.jsonl", {e.qid: e.context for e in examples})
    assert set(mentions) == {e.qid for e in examples}  # character spans checked against the contexts
    assert {m.text for ms in mentions.values() for m in ms} >= {"Anna", "Tom", "Rita", "Paris", "London"}
    assert (gdir / "facts.jsonl").read_text().strip()
    assert (
        jsteer_main(
            [
                "kala",
                "train",
                "--train",
                str(train),
                "--test",
                str(test),
                "--graph",
                str(gdir),
                "--out",
                str(out),
                "--model",
                str(tiny_bert_dir),
                "--max-steps",
                "2",
                "--batch-size",
                "8",
                "--max-len",
                "16",
                "--stride",
                "4",
            ]
        )
        == 0
    )
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["task"] == "qa" and (config["stride"], config["max_len"], config["max_answer_len"]) == (4, 16, 30)
    assert "labels" not in config and "scheme" not in config
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and {"exact_match", "f1"} <= set(metrics["test"])
    capsys.readouterr()
    preds_path = tmp_path / "preds.json"
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test), "--predictions", str(preds_path)]) == 0
    scores = _last_json(capsys.readouterr().out)
    preds = json.loads(preds_path.read_text())
    assert set(preds) == {e.qid for e in examples}
    assert all(preds[e.qid] in e.context for e in examples)
    gold = {e.qid: [t for t, _ in e.answers] for e in examples}
    expected = squad_scores(preds, gold)
    assert (scores["exact_match"], scores["f1"]) == (expected["exact_match"], expected["f1"])
    assert scores["exact_match"] == pytest.approx(metrics["test"]["exact_match"])  # the saved model reproduces them
    assert json.loads((out / "test.json.predictions.json").read_text()) == preds  # train --test wrote them too
    # the same questions with the model's answers as gold: EM 100 (scored against the --test file's answers;
    # a file the graph has no mentions for is annotated in memory with its lexicon)
    # (the first two with an answer_start that misses the text: EM / F1 need only the texts, so they are
    # repaired and said in one line)
    qa.write_squad(
        tmp_path / "as_gold.json",
        [
            qa.QAExample(e.qid, e.question, e.context, ((preds[e.qid], e.context.index(preds[e.qid]) + (i < 2)),))
            for i, e in enumerate(examples)
        ],
    )
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(tmp_path / "as_gold.json")]) == 0
    std = capsys.readouterr()
    assert _last_json(std.out)["exact_match"] == 100.0
    assert "jsteer kala eval: WARNING: " in std.err and "as_gold.json: 2 answer(s) whose answer_start" in std.err
    # a QA run takes no NER data: eval on a CoNLL file, resume with a CoNLL --train
    conll_file = conll(tmp_path / "t.conll", _people_places(4))
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(conll_file)]) == 2
    assert f"{out} is a QA run, but --test {conll_file} is a CoNLL file" in capsys.readouterr().err
    assert (
        jsteer_main(
            ["kala", "build-graph", str(conll_file), "--lexicon", str(gdir / "lexicon.tsv"), "--out", str(gdir)]
        )
        == 0
    )
    record = (out / "run.json").read_text()
    assert jsteer_main(_train_args(conll_file, gdir, out, tiny_bert_dir, "--resume")) == 2
    err = capsys.readouterr().err
    assert "config.task: recorded 'qa', now 'ner'" in err and "Traceback" not in err
    assert (out / "run.json").read_text() == record


def test_cli_qa_errors_name_the_file_and_the_mix(tmp_path, capsys):
    """Malformed SQuAD files name file and field; a run does not mix QA and NER files or options."""
    from jsteer.io import save_artifact

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    assert jsteer_main(["kala", "build-graph", str(bad), "--out", str(tmp_path / "g0")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: field 'data[0].paragraphs[0].context': missing" in err
    assert not (tmp_path / "g0").exists()
    train, test = squad(tmp_path / "train.json", 8), squad(tmp_path / "test.json", 4, seed=1)
    conll_file = conll(tmp_path / "t.conll", _people_places(4))
    assert jsteer_main(["kala", "build-graph", str(train), str(conll_file), "--out", str(tmp_path / "g1")]) == 2
    assert (
        f"{train} is a SQuAD-format JSON file (extractive QA) and {conll_file} is a CoNLL file"
        in capsys.readouterr().err
    )
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    base = ["kala", "train", "--graph", str(gdir), "--out", str(tmp_path / "run"), "--model", "nope"]
    cases = [
        (["--train", str(conll_file), "--task", "qa"], f"--task qa, but --train {conll_file} is a CoNLL file"),
        (["--train", str(train), "--test", str(conll_file)], f"--test {conll_file} is a CoNLL file (NER), but --train"),
        (["--train", str(train), "--labels", "O,B-PER,I-PER"], "--labels: NER option(s), but this is a QA run"),
        (["--train", str(train), "--scheme", "iob2"], "--scheme: NER option(s), but this is a QA run"),
        (["--train", str(conll_file), "--stride", "8"], "--stride: QA option(s), but this is an NER run"),
    ]
    for extra, msg in cases:
        assert jsteer_main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "run").exists()
    broken = json.loads(test.read_text())
    broken["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 1
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    (gdir / "broken.json.mentions.jsonl").write_text((gdir / "test.json.mentions.jsonl").read_text())
    # training labels need answer_start: a training file's is an error (a test file's is repaired: see below)
    assert jsteer_main(base + ["--train", str(tmp_path / "broken.json"), "--test", str(test)]) == 2
    assert "broken.json: field 'data[0].paragraphs[0].qas[0].answers[0].answer_start'" in capsys.readouterr().err
    ner_run = tmp_path / "ner_run"
    save_artifact(ner_run / "model", {"w": np.zeros(1, np.float32)}, {"task": "ner"})
    assert jsteer_main(["kala", "eval", "--run", str(ner_run), "--test", str(test)]) == 2
    assert f"{ner_run} is an NER run, but --test {test} is a SQuAD-format JSON file" in capsys.readouterr().err


def test_cli_build_graph_refuses_to_replace_a_graph_without_overwrite(tmp_path, capsys):
    """build-graph on a folder holding a graph, without --lexicon, would mine a new lexicon and
    replace the facts a trained model uses: refused (naming --lexicon and --overwrite) and the
    folder left as it was; --overwrite replaces the graph, stale mentions files included."""
    first = conll(tmp_path / "first.conll", _people_places(12))
    other = conll(
        tmp_path / "other.conll", [[("In", "O"), ("Bonn", "B-LOC"), ("and", "O"), ("Rome", "B-LOC"), (".", "O")]] * 4
    )
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(first), "--out", str(gdir)]) == 0
    before = {p.name: p.read_bytes() for p in gdir.iterdir()}
    capsys.readouterr()
    assert jsteer_main(["kala", "build-graph", str(other), "--out", str(gdir)]) == 2
    err = capsys.readouterr().err
    assert f"--out {gdir} already holds a graph" in err and "--overwrite" in err
    assert f"jsteer kala build-graph {other} --lexicon {gdir / 'lexicon.tsv'} --out {gdir}" in err
    assert {p.name: p.read_bytes() for p in gdir.iterdir()} == before  # nothing written
    assert (
        jsteer_main(
            [
                "kala",
                "build-graph",
                str(other),
                "--out",
                str(gdir),
                "--overwrite",
                "--lexicon",
                str(gdir / "lexicon.tsv"),
            ]
        )
        == 2
    )
    assert "--overwrite has no use with --lexicon" in capsys.readouterr().err
    # the suggested command adds the file, keeping lexicon and facts
    assert (
        jsteer_main(["kala", "build-graph", str(other), "--lexicon", str(gdir / "lexicon.tsv"), "--out", str(gdir)])
        == 0
    )
    assert (gdir / "facts.jsonl").read_bytes() == before["facts.jsonl"]
    assert (gdir / "lexicon.tsv").read_bytes() == before["lexicon.tsv"]
    capsys.readouterr()
    assert jsteer_main(["kala", "build-graph", str(other), "--out", str(gdir), "--overwrite"]) == 0
    assert (
        "deleted the replaced graph's mentions of files not given now: first.conll.mentions.jsonl"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in gdir.iterdir()) == [
        "facts.jsonl",
        "lexicon.tsv",
        "other.conll.mentions.jsonl",
        "summary.json",
    ]
    assert "Bonn" in (gdir / "lexicon.tsv").read_text() and "Anna" not in (gdir / "lexicon.tsv").read_text()


def test_cli_resume_reads_run_records_from_before_the_task_field(tmp_path):
    """run.json gained config.task with QA runs; a record without it is an NER run's."""
    from jsteer.kala import runs

    record = {"config": {"method": "finetune", "task": "ner"}, "data": {"train": "abc"}}
    (tmp_path / "run.json").write_text(json.dumps({"config": {"method": "finetune"}, "data": {"train": "abc"}}))
    runs.check_resume(tmp_path, record)  # the same run
    with pytest.raises(ValueError, match="config.task: recorded 'ner', now 'qa'"):
        runs.check_resume(tmp_path, {**record, "config": {"method": "finetune", "task": "qa"}})


def test_qa_contexts_are_matched_as_words_with_character_spans():
    """Contexts split into words with their character spans (punctuation and a possessive 's
    apart, abbreviations whole); a lexicon match becomes a mention of the context's characters."""
    from jsteer.kala import qa
    from jsteer.kala.mining import Lexicon
    from jsteer.kala.qa_builder import annotate, context_sentences

    ctx = "The Bank of England's head met U.S. officials (in London), twice.  Then  Bank of  England said no!"
    sents = context_sentences(ctx)
    assert [[w for w, _, _ in s] for s in sents] == [
        [
            "The",
            "Bank",
            "of",
            "England",
            "'s",
            "head",
            "met",
            "U.S.",
            "officials",
            "(",
            "in",
            "London",
            ")",
            ",",
            "twice",
            ".",
        ],
        ["Then", "Bank", "of", "England", "said", "no", "!"],
    ]
    assert all(ctx[a:b] == w for s in sents for w, a, b in s)
    lexicon = Lexicon({("Bank", "of", "England"): "bank of england", ("London",): "london", ("U.S.",): "u.s"})
    ex = qa.QAExample("q", "who ?", ctx, ())
    got = annotate([ex, qa.QAExample("q2", "where ?", ctx, ())], lexicon)
    assert [(m.text, m.id) for m in got["q"]] == [
        ("Bank of England", "bank of england"),
        ("U.S.", "u.s"),
        ("London", "london"),
        ("Bank of  England", "bank of england"),
    ]
    assert all(ctx[m.start : m.end] == m.text for m in got["q"]) and got["q2"] == got["q"]


def test_ner_without_test_file_encodes_no_test_split(tmp_path, tiny_bert_dir):
    """`kala train` without --test: the training file is not encoded a second time as a test split."""
    import jsteer
    from jsteer.kala import pipeline

    train = conll(tmp_path / "train.conll", _people_places(12))
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    tok = jsteer.load(str(tiny_bert_dir)).tokenizer
    data = pipeline.load_ner_data(
        train,
        None,
        gdir,
        tok,
        labels=("O", "B-PER", "I-PER", "B-LOC", "I-LOC"),
        scheme="iob2",
        max_len=16,
        train_size=6,
    )
    assert len(data.train) == 6 and data.test == [] and data.test_tags == []


# --- resume at the data position, SIGTERM, empty / unanswerable training sets, metrics.json, predictions paths ---


def _sigterm_at_batch(monkeypatch, n):
    """A real SIGTERM to this process while the ``n``-th training batch is prepared (the trainer's
    handler stops after that step and saves a checkpoint, as a preempted job does)."""
    import os
    import signal

    from jsteer.kala import data as kdata

    real, calls = kdata.device_batch, []

    def batch_then_sigterm(batch, graph=True):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(batch, graph)

    monkeypatch.setattr(kdata, "device_batch", batch_then_sigterm)


def _assert_trees_close(a, b):
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_fit_resumes_at_the_recorded_data_position(tmp_path, tiny_bert_dir, monkeypatch):
    """kala.train.fit interrupted (SIGTERM) after 3 of 6 steps and resumed from its checkpoint
    continues with the 4th batch, not the first again: the same losses and params as an
    uninterrupted run, and no "no data position" warning."""
    import warnings

    import jsteer
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig

    train = squad(tmp_path / "train.json", 24)
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    lm = jsteer.load(str(tiny_bert_dir))
    data = pipeline.load_qa_data(train, None, gdir, lm.tokenizer, max_len=16, stride=4)
    # finetune: one compiled shape, fast; the stream's position is the same for graph batches
    # (and the trainer's dropout key is restored with its state)
    model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(method="finetune"))
    cfg = ktrain.TrainConfig(lr=3e-3, kala_lr=3e-3, batch_size=4, max_len=16, max_steps=6)
    assert len(data.train) >= 4 * 6  # one epoch covers all 6 steps: a replay would take other batches
    straight = ktrain.fit(model, params, data.train, cfg, task="qa", checkpoint_dir=tmp_path / "a")
    assert straight.last_step == 6 and not straight.preempted

    with monkeypatch.context() as m:
        _sigterm_at_batch(m, 3)
        cut = ktrain.fit(model, params, data.train, cfg, task="qa", checkpoint_dir=tmp_path / "b")
    assert cut.preempted and cut.last_step == cut.steps == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = ktrain.fit(model, params, data.train, cfg, task="qa", checkpoint_dir=tmp_path / "b")
    assert not [w for w in caught if "data position" in str(w.message)], [str(w.message) for w in caught]
    assert resumed.steps == 3 and resumed.last_step == 6 and not resumed.preempted
    np.testing.assert_allclose(cut.losses + resumed.losses, straight.losses, rtol=1e-6)
    _assert_trees_close(resumed.params, straight.params)


def test_cli_sigterm_stops_unfinished_and_resume_matches_an_uninterrupted_run(
    tmp_path, tiny_bert_dir, capsys, monkeypatch
):
    """SIGTERM during `kala train`: checkpoint, a message naming --resume, exit 143, no model/ or
    metrics.json (the run is not finished); the same command with --resume then ends with the
    params, final loss, scores and predictions of an uninterrupted run."""
    from jsteer.io import load_artifact

    train, test = squad(tmp_path / "train.json", 24), squad(tmp_path / "test.json", 6, seed=1)
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0

    def args(out):
        return [
            "kala",
            "train",
            "--train",
            str(train),
            "--test",
            str(test),
            "--graph",
            str(gdir),
            "--out",
            str(out),
            "--model",
            str(tiny_bert_dir),
            "--method",
            "finetune",
            "--max-steps",
            "6",
            "--batch-size",
            "4",
            "--max-len",
            "16",
            "--stride",
            "4",
            "--lr",
            "3e-3",
        ]

    a, b = tmp_path / "a", tmp_path / "b"
    assert jsteer_main(args(a)) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:
        _sigterm_at_batch(m, 3)
        assert jsteer_main(args(b)) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM at step 3 of 6" in err and "--resume" in err
    assert not (b / "model").exists() and not (b / "metrics.json").exists()
    assert not (b / "test.json.predictions.json").exists()
    assert (b / "checkpoints").is_dir()
    assert jsteer_main(args(b) + ["--resume"]) == 0
    assert "data position" not in capsys.readouterr().err and "data position" not in (b / "log.jsonl").read_text()
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    assert (mb["steps"], mb["steps_run"]) == (6, 3)
    assert mb["final_loss"] == pytest.approx(ma["final_loss"], rel=1e-6)
    assert mb["test"]["exact_match"] == ma["test"]["exact_match"] and mb["test"]["f1"] == pytest.approx(
        ma["test"]["f1"]
    )
    _assert_trees_close(load_artifact(b / "model")[0], load_artifact(a / "model")[0])
    assert json.loads((b / "test.json.predictions.json").read_text()) == json.loads(
        (a / "test.json.predictions.json").read_text()
    )


def test_cli_train_refuses_empty_and_unanswerable_training_sets(tmp_path, tiny_bert_dir, capsys):
    """--train-size < 1 is an argument error; a SQuAD file without questions (it hung in an endless
    loop over zero batches) and SQuAD v2.0 questions without answers are refused naming the file,
    before the model is loaded (--model nope); fit and the batch stream refuse no examples."""
    from jsteer.kala import qa
    from jsteer.kala import train as ktrain

    train = squad(tmp_path / "train.json", 8)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"version": "1.1", "data": []}))
    v2 = tmp_path / "v2.json"
    ctx = "Today Anna visited Paris."
    qa.write_squad(v2, [qa.QAExample("a", "who ?", ctx, (("Anna", 6),)), qa.QAExample("b", "why ?", ctx, ())])
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), str(empty), str(v2), "--out", str(gdir)]) == 0
    base = ["kala", "train", "--graph", str(gdir), "--out", str(tmp_path / "run"), "--model", "nope"]
    for size in ("0", "-3"):
        with pytest.raises(SystemExit) as e:
            jsteer_main(base + ["--train", str(train), "--train-size", size])
        assert e.value.code == 2
        assert f"--train-size: must be an integer >= 1, got {size}" in capsys.readouterr().err
    assert jsteer_main(base + ["--train", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"{empty}: no questions to train on" in err and "Traceback" not in err
    assert jsteer_main(base + ["--train", str(v2)]) == 2
    err = capsys.readouterr().err
    assert f"{v2}: training question 'b' has no answers" in err and "SQuAD v2.0 unanswerable" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="no training examples"):
        ktrain.fit(None, {}, [], ktrain.TrainConfig(max_steps=1), task="qa")
    with pytest.raises(ValueError, match="no training examples"):
        ktrain._Endless([], 4, ktrain.task_keys("qa"), 0)


def _one_qa_step(train, gdir, out, model) -> list:
    """`jsteer kala train` argv: one fine-tuning step on a SQuAD file with a tiny BERT."""
    return ["kala", "train", "--train", str(train), "--graph", str(gdir), "--out", str(out), "--model", str(model)] + (
        "--method finetune --max-steps 1 --batch-size 8 --max-len 16 --stride 4".split()
    )


def test_cli_metrics_json_is_strict_json_after_one_step(tmp_path, tiny_bert_dir, capsys):
    """A run of <= 1 step (or the resume of a finished run) has no step time: null in metrics.json
    and on stdout, never NaN (invalid JSON)."""

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {text}"))

    train = squad(tmp_path / "train.json", 8)
    gdir, out = tmp_path / "graph", tmp_path / "run"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    args = _one_qa_step(train, gdir, out, tiny_bert_dir)
    for extra in ([], ["--resume"]):
        capsys.readouterr()
        assert jsteer_main(args + extra) == 0
        printed = strict(capsys.readouterr().out.strip().splitlines()[-1])
        metrics = strict((out / "metrics.json").read_text())
        assert printed == metrics and metrics["steps"] == 1
        assert metrics["train_seconds"] is None and metrics["examples_per_second"] is None
        assert metrics["final_loss"] is not None


def test_cli_predictions_path_never_replaces_the_test_file_or_a_folder(tmp_path, tiny_bert_dir, capsys, monkeypatch):
    """eval --predictions equal to --test (it overwrote the gold answers), another SQuAD data file
    or a folder is refused before the model is loaded; so is a train --test whose predictions
    path is a folder."""
    import jsteer
    from jsteer import checkpoints

    train, test = squad(tmp_path / "train.json", 8), squad(tmp_path / "test.json", 4, seed=1)
    gdir, out = tmp_path / "graph", tmp_path / "run"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    args = _one_qa_step(train, gdir, out, tiny_bert_dir)
    assert jsteer_main(args) == 0
    gold, gold_train = test.read_bytes(), train.read_bytes()
    folder = tmp_path / "somedir"
    folder.mkdir()
    (out / "test.json.predictions.json").mkdir()  # train's default predictions path, taken by a folder
    capsys.readouterr()

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the predictions path was checked")

    with monkeypatch.context() as m:
        m.setattr(checkpoints, "load_artifact", no_load)
        m.setattr(jsteer, "load", no_load)
        cases = [
            (["--predictions", str(test)], f"--predictions {test} is the --test file"),
            (["--predictions", str(tmp_path / "." / "test.json")], "is the --test file"),
            (["--predictions", str(train)], f"--predictions {train} is a SQuAD-format data file"),
            (["--predictions", str(folder)], f"--predictions {folder} is a folder"),
        ]
        for extra, msg in cases:
            assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test)] + extra) == 2, extra
            err = capsys.readouterr().err
            assert msg in err and "Traceback" not in err, (extra, err)
        assert jsteer_main(args + ["--resume", "--test", str(test)]) == 2
        err = capsys.readouterr().err
        assert f"the predictions file {out / 'test.json.predictions.json'} is a folder" in err
    assert test.read_bytes() == gold and train.read_bytes() == gold_train
    preds = tmp_path / "preds.json"
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test), "--predictions", str(preds)]) == 0
    assert set(json.loads(preds.read_text())) == {"s1q0", "s1q1", "s1q2", "s1q3"}
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test), "--predictions", str(preds)]) == 0


# --- one train command per --out at a time ---------------------------------------------------------


def _hold_lock(path):
    """Another process holding ``path``'s flock, as a running ``kala train`` does; kill it to end."""
    import subprocess
    import sys

    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def test_cli_train_refuses_an_out_folder_another_train_uses(tmp_path, capsys):
    """Two train commands on one --out (two --resume of a run, or two new runs both past the
    emptiness check) would write one folder at once: while another process holds the folder, train
    is refused at once (before any model is loaded; the model path here does not exist), naming
    the folder, and changes nothing in it. The lock ends with its process (killed: no stale lock)."""
    from jsteer.kala import runs

    train = conll(tmp_path / "train.conll", _people_places(8))
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    running, new = tmp_path / "running", tmp_path / "new"
    running.mkdir()
    new.mkdir()
    (running / "run.json").write_text(json.dumps({"config": {"method": "finetune"}, "data": {}}))
    (running / "log.jsonl").write_text("")
    before = {p.name: p.read_bytes() for p in running.iterdir()}
    holders = [_hold_lock(running), _hold_lock(new)]
    try:
        capsys.readouterr()
        for out, extra in ((running, ["--resume"]), (new, []), (new, ["--resume"])):
            assert jsteer_main(_train_args(train, gdir, out, tmp_path / "no-model", *extra)) == 2
            err = capsys.readouterr().err
            assert f"--out {out} is in use: another jsteer kala train is running in it" in err, err
            assert "Traceback" not in err
        assert {p.name: p.read_bytes() for p in running.iterdir()} == before
        assert list(new.iterdir()) == []  # still there (it was not this command's), still empty
    finally:
        for h in holders:
            h.kill()
            h.wait()
    with runs.lock(running):  # the killed holder left no lock behind
        with pytest.raises(ValueError, match=f"--out {running} is in use"):
            with runs.lock(running):  # a second open of the folder is a second holder, even in one process
                pass
    with runs.lock(running):  # released at the end of the block
        pass


def test_cli_train_that_fails_before_training_leaves_no_out_folder(tmp_path, capsys, monkeypatch):
    """The lock creates --out; a new run that fails before training (here: no such model) removes
    it again, and the parent folders it made, but never a folder that was there before. Without
    flock (OSError from the file system) train runs unlocked rather than failing."""
    import errno

    from jsteer.kala import runs

    train = conll(tmp_path / "train.conll", _people_places(8))
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    capsys.readouterr()
    out = tmp_path / "runs" / "a" / "run"
    assert jsteer_main(_train_args(train, gdir, out, tmp_path / "no-model")) == 2
    assert "no model at" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    assert jsteer_main(_train_args(train, gdir, out, tmp_path / "no-model", "--resume")) == 2
    assert list((tmp_path / "runs").iterdir()) == []  # made by the user: kept

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runs.fcntl, "flock", no_flock)
    with runs.lock(out):
        assert out.is_dir() and list(out.iterdir()) == []  # a new run still finds it empty
    with pytest.raises(KeyError):
        with runs.lock(out):
            raise KeyError("boom")
    assert out.is_dir()  # not created by this block: kept


def test_cli_qa_build_graph_refuses_to_replace_a_graph_without_overwrite(tmp_path, capsys):
    """SQuAD graphs get build_graph's guard: refused without --overwrite, nothing written; with it
    the graph is replaced and the old mentions of files not given now are deleted (warned)."""
    a, b = squad(tmp_path / "a.json", 8), squad(tmp_path / "b.json", 8, seed=1)
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(a), "--out", str(gdir)]) == 0
    before = {p.name: p.read_bytes() for p in gdir.iterdir()}
    capsys.readouterr()
    assert jsteer_main(["kala", "build-graph", str(b), "--out", str(gdir)]) == 2
    err = capsys.readouterr().err
    assert f"--out {gdir} already holds a graph (a.json.mentions.jsonl, facts.jsonl, lexicon.tsv" in err
    assert "--overwrite" in err
    assert {p.name: p.read_bytes() for p in gdir.iterdir()} == before
    assert jsteer_main(["kala", "build-graph", str(b), "--out", str(gdir), "--overwrite"]) == 0
    assert (
        "WARNING: --overwrite: deleted the replaced graph's mentions of files not given now: a.json.mentions.jsonl"
    ) in capsys.readouterr().err
    assert sorted(p.name for p in gdir.iterdir()) == [
        "b.json.mentions.jsonl",
        "facts.jsonl",
        "lexicon.tsv",
        "summary.json",
    ]
