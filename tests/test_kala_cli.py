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
