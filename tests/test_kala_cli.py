"""`jsteer kala build-graph / train / eval` on a tiny CoNLL file and a tiny random BERT folder."""

import json

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
