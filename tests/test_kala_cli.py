"""`jsteer kala build-graph / train / eval` on tiny CoNLL and SQuAD-format files and a tiny random BERT folder."""

import json

import numpy as np
import pytest

from jsteer.cli import main as jsteer_main


@pytest.fixture()
def tiny_bert_dir(tmp_path):
    import torch
    from transformers import BertConfig, BertModel

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "in", "met", "said", "today", ".",
             "paris", "london", "berlin", "anna", "tom", "rita", "visited", "from"]
    d = tmp_path / "bert"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(d)
    (d / "vocab.txt").write_text("\n".join(words) + "\n")
    return d


def conll(path, sents):
    path.write_text("".join("".join(f"{w} {t}\n" for w, t in s) + "\n" for s in sents))
    return path


def test_cli_build_graph_train_eval(tmp_path, tiny_bert_dir, capsys):
    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    sents = []
    for i in range(24):
        p, q = people[i % 3], places[(i // 3) % 3]
        sents.append([(p, "B-PER"), ("visited", "O"), (q, "B-LOC"), ("today", "O"), (".", "O")])
    train = conll(tmp_path / "train.conll", sents)
    test = conll(tmp_path / "test.conll", sents[:6])
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    assert (gdir / "train.conll.mentions.jsonl").is_file() and (gdir / "facts.jsonl").is_file()
    out = tmp_path / "run"
    assert jsteer_main(["kala", "train", "--train", str(train), "--test", str(test), "--graph", str(gdir),
                        "--out", str(out), "--model", str(tiny_bert_dir), "--scheme", "iob2", "--max-steps", "3",
                        "--batch-size", "8", "--max-len", "16"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and "f1" in metrics["test"]
    assert (out / "log.jsonl").is_file() and (out / "model").is_dir() and (out / "checkpoints").is_dir()
    capsys.readouterr()
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test)]) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scores["f1"] == pytest.approx(metrics["test"]["f1"])  # the saved model reproduces its scores
    assert jsteer_main(["kala", "eval", "--run", str(tmp_path / "nope"), "--test", str(test)]) == 2


def _people_places(n):
    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    return [[(people[i % 3], "B-PER"), ("visited", "O"), (places[(i // 3) % 3], "B-LOC"), ("today", "O"), (".", "O")]
            for i in range(n)]


def _train_args(train, gdir, out, model, *extra):
    return ["kala", "train", "--train", str(train), "--graph", str(gdir), "--out", str(out), "--model", str(model),
            "--scheme", "iob2", "--max-steps", "2", "--batch-size", "8", "--max-len", "16", *extra]


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


def test_cli_label_set_has_i_tags_and_eval_annotates_new_files(tmp_path, tiny_bert_dir, capsys):
    """Single-token training entities still give I-X labels (a test file may use them); eval on a
    file the graph has no mentions for uses the graph's lexicon, as build-graph --lexicon does."""
    sents = _people_places(16)
    train = conll(tmp_path / "train.conll", sents)
    test = conll(tmp_path / "test.conll", [[("Anna", "B-PER"), ("Rita", "I-PER"), ("visited", "O"), ("Paris", "B-LOC")]]
                 + sents[:4])
    gdir, out = tmp_path / "graph", tmp_path / "run"
    assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
    assert jsteer_main(_train_args(train, gdir, out, tiny_bert_dir, "--test", str(test))) == 0
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
    from jsteer.kala import cli as kcli
    from jsteer.kala import pipeline

    gdir = tmp_path / "graph"
    gdir.mkdir()
    (gdir / "lexicon.tsv").write_text("cased\tAnna\tanna\n")
    test = conll(tmp_path / "t.conll", _people_places(2))
    with pytest.raises(ValueError, match=rf"no mentions for {test}; .*jsteer kala build-graph {test} --lexicon "
                                         rf"{gdir / 'lexicon.tsv'} --out {gdir}"):
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
        examples.append(qa.QAExample(f"s{seed}q{2 * i + 1}", f"where did {p.lower()} meet {r.lower()} ?", ctx,
                                     ((q2, ctx.index(q2)),)))
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
    assert jsteer_main(["kala", "train", "--train", str(train), "--test", str(test), "--graph", str(gdir),
                        "--out", str(out), "--model", str(tiny_bert_dir), "--max-steps", "2", "--batch-size", "8",
                        "--max-len", "16", "--stride", "4"]) == 0
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
    qa.write_squad(tmp_path / "as_gold.json", [qa.QAExample(e.qid, e.question, e.context,
                                                            ((preds[e.qid], e.context.index(preds[e.qid])),))
                                               for e in examples])
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(tmp_path / "as_gold.json")]) == 0
    assert _last_json(capsys.readouterr().out)["exact_match"] == 100.0
    # a QA run takes no NER data: eval on a CoNLL file, resume with a CoNLL --train
    conll_file = conll(tmp_path / "t.conll", _people_places(4))
    assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(conll_file)]) == 2
    assert f"{out} is a QA run, but --test {conll_file} is a CoNLL file" in capsys.readouterr().err
    assert jsteer_main(["kala", "build-graph", str(conll_file), "--lexicon", str(gdir / "lexicon.tsv"),
                        "--out", str(gdir)]) == 0
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
    assert f"{train} is a SQuAD-format JSON file (extractive QA) and {conll_file} is a CoNLL file" in \
        capsys.readouterr().err
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
    assert jsteer_main(base + ["--train", str(train), "--test", str(tmp_path / "broken.json")]) == 2
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
    other = conll(tmp_path / "other.conll",
                  [[("In", "O"), ("Bonn", "B-LOC"), ("and", "O"), ("Rome", "B-LOC"), (".", "O")]] * 4)
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(first), "--out", str(gdir)]) == 0
    before = {p.name: p.read_bytes() for p in gdir.iterdir()}
    capsys.readouterr()
    assert jsteer_main(["kala", "build-graph", str(other), "--out", str(gdir)]) == 2
    err = capsys.readouterr().err
    assert f"--out {gdir} already holds a graph" in err and "--overwrite" in err
    assert f"jsteer kala build-graph {other} --lexicon {gdir / 'lexicon.tsv'} --out {gdir}" in err
    assert {p.name: p.read_bytes() for p in gdir.iterdir()} == before  # nothing written
    assert jsteer_main(["kala", "build-graph", str(other), "--out", str(gdir), "--overwrite",
                        "--lexicon", str(gdir / "lexicon.tsv")]) == 2
    assert "--overwrite has no use with --lexicon" in capsys.readouterr().err
    # the suggested command adds the file, keeping lexicon and facts
    assert jsteer_main(["kala", "build-graph", str(other), "--lexicon", str(gdir / "lexicon.tsv"),
                        "--out", str(gdir)]) == 0
    assert (gdir / "facts.jsonl").read_bytes() == before["facts.jsonl"]
    assert (gdir / "lexicon.tsv").read_bytes() == before["lexicon.tsv"]
    capsys.readouterr()
    assert jsteer_main(["kala", "build-graph", str(other), "--out", str(gdir), "--overwrite"]) == 0
    assert "deleted the replaced graph's mentions of files not given now: first.conll.mentions.jsonl" in \
        capsys.readouterr().err
    assert sorted(p.name for p in gdir.iterdir()) == ["facts.jsonl", "lexicon.tsv", "other.conll.mentions.jsonl",
                                                       "summary.json"]
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
    from jsteer.kala.builder import Lexicon
    from jsteer.kala.qa_builder import annotate, context_sentences

    ctx = "The Bank of England's head met U.S. officials (in London), twice.  Then  Bank of  England said no!"
    sents = context_sentences(ctx)
    assert [[w for w, _, _ in s] for s in sents] == [
        ["The", "Bank", "of", "England", "'s", "head", "met", "U.S.", "officials", "(", "in", "London", ")", ",",
         "twice", "."], ["Then", "Bank", "of", "England", "said", "no", "!"]]
    assert all(ctx[a:b] == w for s in sents for w, a, b in s)
    lexicon = Lexicon({("Bank", "of", "England"): "bank of england", ("London",): "london", ("U.S.",): "u.s"})
    ex = qa.QAExample("q", "who ?", ctx, ())
    got = annotate([ex, qa.QAExample("q2", "where ?", ctx, ())], lexicon)
    assert [(m.text, m.id) for m in got["q"]] == [("Bank of England", "bank of england"), ("U.S.", "u.s"),
                                                  ("London", "london"), ("Bank of  England", "bank of england")]
    assert all(ctx[m.start:m.end] == m.text for m in got["q"]) and got["q2"] == got["q"]


def test_ner_without_test_file_encodes_no_test_split(tmp_path, tiny_bert_dir):
    """`kala train` without --test: the training file is not encoded a second time as a test split."""
    import jsteer
    from jsteer.kala import pipeline

    train = conll(tmp_path / "train.conll", _people_places(12))
    gdir = tmp_path / "graph"
    assert jsteer_main(["kala", "build-graph", str(train), "--out", str(gdir)]) == 0
    tok = jsteer.load(str(tiny_bert_dir)).tokenizer
    data = pipeline.load_ner_data(train, None, gdir, tok, labels=("O", "B-PER", "I-PER", "B-LOC", "I-LOC"),
                                  scheme="iob2", max_len=16, train_size=6)
    assert len(data.train) == 6 and data.test == [] and data.test_tags == []
