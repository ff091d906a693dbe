"""`jsteer kalm train / eval` on a tiny recipe-like data folder: registration, artifact
round trip (eval re-computes the perplexity train would give), held-out typing, bad input."""

import json

import numpy as np
import pytest

from jsteer.cli import build_parser
from jsteer.cli import main as jsteer_main
from jsteer.io import load_artifact
from jsteer.kalm import data as kdata

FRUITS = ["apple", "pear", "plum", "fig", "kiwi", "lime"]
DRINKS = ["tea", "milk", "juice", "soda", "water", "cola"]
OTHER = {
    "dairy": "butter",
    "grains": "rice",
    "proteins": "beef",
    "seasonings": "salt",
    "sides": "gravy",
    "vegetables": "kale",
}


@pytest.fixture()
def recipe_dir(tmp_path):
    root = tmp_path / "kalm"
    (root / "superingredients").mkdir(parents=True)
    (root / "raw_data").mkdir()
    for t in kdata.TYPE_NAMES:
        words = FRUITS if t == "fruits" else DRINKS if t == "drinks" else [OTHER[t]]
        (root / "superingredients" / f"{t}.txt").write_text("\n".join(w.capitalize() for w in words) + "\n")
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(200):
        f, d, o = rng.choice(FRUITS), rng.choice(DRINKS), rng.choice(list(OTHER.values()))
        lines.append(f"chopped {f}, cold {d}, {o}" if rng.random() < 0.5 else f"cold {d}, chopped {f}, {o}")
    (root / "raw_data" / "uncleaned_valid_ing.txt").write_text("\n".join(lines) + "\n")
    (root / "raw_data" / "test.txt").write_text("\n".join(lines[:20]) + "\n")
    return root


def test_kalm_cli_is_registered():
    args = build_parser().parse_args(["kalm", "train", "--data", "d", "--out", "o", "--kind", "kalm_type_input"])
    assert args.kind == "kalm_type_input" and args.func.__module__ == "jsteer.kalm.cli"
    assert build_parser().parse_args(["kalm", "eval", "--model", "m", "--text", "t"]).func.__name__ == "_eval"


def test_kalm_cli_train_eval(recipe_dir, tmp_path, capsys):
    out = tmp_path / "art"
    test = recipe_dir / "raw_data" / "test.txt"
    rc = jsteer_main(
        [
            "kalm",
            "train",
            "--data",
            str(recipe_dir),
            "--out",
            str(out),
            "--kind",
            "kalm",
            "--steps",
            "4",
            "--batch",
            "16",
            "--length",
            "10",
            "--hidden",
            "16",
            "--layers",
            "1",
            "--type-dim",
            "4",
            "--held-out",
            "0.2",
            "--held-out-from",
            str(test),
        ]
    )
    assert rc == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert trained["held_out"] == 2  # one fruit, one drink (round(0.2 * 1) = 0 of the other types)
    assert trained["vocab"] == 3 + 3 + len(FRUITS) + len(DRINKS) + len(OTHER)  # specials, chopped cold ","
    _, meta = load_artifact(out)
    assert meta["kind"] == "kalm" and meta["share_word_embedding"] is True and len(meta["held_out"]) == 2
    assert jsteer_main(["kalm", "eval", "--model", str(out), "--text", str(test)]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["lines"] == 20 and ev["tokens"] == 20 * 8  # <eos> chopped f , cold d , o <eos>: 8 predictions
    assert 1.0 < ev["perplexity"] < 3 * trained["vocab"]
    assert ev["typing_occurrences"] > 0 and 0.0 <= ev["typing_accuracy"] <= 1.0


def test_kalm_cli_bad_input(recipe_dir, tmp_path, capsys):
    assert jsteer_main(["kalm", "train", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "a")]) == 2
    assert "superingredients" in capsys.readouterr().err
    assert (
        jsteer_main(["kalm", "train", "--data", str(recipe_dir), "--out", str(tmp_path / "a"), "--held-out", "1.5"])
        == 2
    )
    assert "--held-out" in capsys.readouterr().err
    assert jsteer_main(["kalm", "eval", "--model", str(tmp_path / "missing"), "--text", "x"]) == 2
    assert "missing" in capsys.readouterr().err
