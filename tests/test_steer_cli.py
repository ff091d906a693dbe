"""`jsteer steer ...` end to end on a saved toy model: train -> generate -> highlight -> explain
-> transfer, and the errors a user sees for a steer of another model and an empty data file."""

import json

import numpy as np
import pytest

import jsteer
from jsteer.cli import main
from jsteer.steer import artifact, toy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("steer_cli")
    jsteer.save(toy.lm(seed=0), d / "toy0")
    jsteer.save(toy.lm(seed=1), d / "toy1")
    texts, values = toy.corpus(120, seed=1)
    with open(d / "train.jsonl", "w") as f:
        for t, v in zip(texts, values):
            f.write(json.dumps({"text": t, "label": int(v)}) + "\n")
    return d


def test_cli_train_generate_highlight_explain_transfer(models, capsys):
    d = models
    assert main(["steer", "train", "--model", str(d / "toy0"), "--data", str(d / "train.jsonl"), "--out",
                 str(d / "s0"), "--name", "sentiment", "--rank", "8", "--steps", "60", "--batch-size", "16",
                 "--cache", str(d / "cache.npz")]) == 0
    out = capsys.readouterr().out
    assert "120 texts (60 positive, 60 negative)" in out and "wrote" in out
    params, meta = artifact.load(str(d / "s0"))
    assert meta["steer_names"] == ["sentiment"] and params["p1"].shape == (2, 32, 8)
    assert meta["base_model"] == jsteer.load(str(d / "toy0")).identity

    # composition: two artifacts on one model, each with its own strength
    assert main(["steer", "generate", "--model", str(d / "toy0"), "--steer", str(d / "s0"), "--value", "5",
                 "--steer", str(d / "s0"), "--value", "-1", "--samples", "3", "--max-new-tokens", "6", "--json",
                 "the movie was"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 3 and all(x["prompt"] == "the movie was" for x in lines)

    assert main(["steer", "highlight", "--model", str(d / "toy0"), "--steer", str(d / "s0"), "--value", "3",
                 "--json", "the plot is bad and the music was good great happy and the end"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["scores"]) == 14 and res["span"][1] - res["span"][0] <= 5

    assert main(["steer", "explain", "--model", str(d / "toy0"), "--steer", str(d / "s0"), "--dirs", "2",
                 "--top", "4", "--json"]) == 0
    dirs = json.loads(capsys.readouterr().out)
    assert len(dirs) == 2 and len(dirs[0]["top"]) == 4 and dirs[0]["singular_value"] >= dirs[1]["singular_value"]

    # a steer of toy0 on toy1 is refused, until transferred
    assert main(["steer", "generate", "--model", str(d / "toy1"), "--steer", str(d / "s0"), "x"]) == 2
    assert "jsteer steer transfer" in capsys.readouterr().err
    assert main(["steer", "transfer", "--steer", str(d / "s0"), "--from", str(d / "toy0"), "--to",
                 str(d / "toy1"), "--out", str(d / "s1")]) == 0
    assert "44 shared anchor tokens" in capsys.readouterr().out
    _, meta1 = artifact.load(str(d / "s1"))
    assert meta1["transferred_from"] == meta["base_model"] and meta1["base_model"] != meta["base_model"]
    assert main(["steer", "explain", "--model", str(d / "toy1"), "--steer", str(d / "s1"), "--dirs", "1"]) == 0
    assert "direction 0" in capsys.readouterr().out


def test_cli_empty_training_file(models, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    rc = main(["steer", "train", "--model", str(models / "toy0"), "--data", str(tmp_path / "empty.jsonl"),
               "--out", str(tmp_path / "s")])
    assert rc == 2
    assert "empty.jsonl: file is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["steer", "generate", "--model", "x"])  # missing --steer and prompts: argparse usage error
    np.testing.assert_equal((tmp_path / "s").exists(), False)
