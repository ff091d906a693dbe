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
    assert (
        main(
            [
                "steer",
                "train",
                "--model",
                str(d / "toy0"),
                "--data",
                str(d / "train.jsonl"),
                "--out",
                str(d / "s0"),
                "--name",
                "sentiment",
                "--rank",
                "8",
                "--steps",
                "60",
                "--batch-size",
                "16",
                "--cache",
                str(d / "cache.npz"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "120 texts (60 positive, 60 negative)" in out and "wrote" in out
    params, meta = artifact.load(str(d / "s0"))
    assert meta["steer_names"] == ["sentiment"] and params["p1"].shape == (2, 32, 8)
    assert meta["base_model"] == jsteer.load(str(d / "toy0")).identity

    # composition: two artifacts on one model, each with its own strength
    assert (
        main(
            [
                "steer",
                "generate",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(d / "s0"),
                "--value",
                "5",
                "--steer",
                str(d / "s0"),
                "--value",
                "-1",
                "--samples",
                "3",
                "--max-new-tokens",
                "6",
                "--json",
                "the movie was",
            ]
        )
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 3 and all(x["prompt"] == "the movie was" for x in lines)

    assert (
        main(
            [
                "steer",
                "highlight",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(d / "s0"),
                "--value",
                "3",
                "--json",
                "the plot is bad and the music was good great happy and the end",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert len(res["scores"]) == 14 and res["span"][1] - res["span"][0] <= 5

    assert (
        main(
            [
                "steer",
                "explain",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(d / "s0"),
                "--dirs",
                "2",
                "--top",
                "4",
                "--json",
            ]
        )
        == 0
    )
    dirs = json.loads(capsys.readouterr().out)
    assert len(dirs) == 2 and len(dirs[0]["top"]) == 4 and dirs[0]["singular_value"] >= dirs[1]["singular_value"]

    # a steer of toy0 on toy1 is refused, until transferred
    assert main(["steer", "generate", "--model", str(d / "toy1"), "--steer", str(d / "s0"), "x"]) == 2
    assert "jsteer steer transfer" in capsys.readouterr().err
    assert (
        main(
            [
                "steer",
                "transfer",
                "--steer",
                str(d / "s0"),
                "--from",
                str(d / "toy0"),
                "--to",
                str(d / "toy1"),
                "--out",
                str(d / "s1"),
            ]
        )
        == 0
    )
    assert "44 shared anchor tokens" in capsys.readouterr().out
    _, meta1 = artifact.load(str(d / "s1"))
    assert meta1["transferred_from"] == meta["base_model"] and meta1["base_model"] != meta["base_model"]
    assert main(["steer", "explain", "--model", str(d / "toy1"), "--steer", str(d / "s1"), "--dirs", "1"]) == 0
    assert "direction 0" in capsys.readouterr().out


def test_cli_empty_training_file(models, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    rc = main(
        [
            "steer",
            "train",
            "--model",
            str(models / "toy0"),
            "--data",
            str(tmp_path / "empty.jsonl"),
            "--out",
            str(tmp_path / "s"),
        ]
    )
    assert rc == 2
    assert "empty.jsonl: file is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["steer", "generate", "--model", "x"])  # missing --steer and prompts: argparse usage error
    np.testing.assert_equal((tmp_path / "s").exists(), False)


def _train_args(d, out, model="toy0", data="train.jsonl", *extra):
    return [
        "steer",
        "train",
        "--model",
        str(d / model),
        "--data",
        str(d / data),
        "--out",
        str(out),
        "--rank",
        "8",
        "--steps",
        "30",
        "--batch-size",
        "16",
        *extra,
    ]


def test_cli_cache_is_reused_only_for_the_same_model_and_data(models, tmp_path, capsys):
    d = models
    cache = tmp_path / "hidden"  # no suffix: NumPy writes hidden.npz, which is what gets reused
    assert main(_train_args(d, tmp_path / "a", "toy0", "train.jsonl", "--cache", str(cache))) == 0
    assert (tmp_path / "hidden.npz").exists() and "reusing" not in capsys.readouterr().out
    assert main(_train_args(d, tmp_path / "b", "toy0", "train.jsonl", "--cache", str(cache))) == 0
    assert "reusing cached hidden states" in capsys.readouterr().out
    # another model, or the same path with other contents: refused, naming what differs
    assert main(_train_args(d, tmp_path / "c", "toy1", "train.jsonl", "--cache", str(cache))) == 2
    assert "model: cached" in capsys.readouterr().err and not (tmp_path / "c").exists()
    other = tmp_path / "other.jsonl"
    other.write_text((d / "train.jsonl").read_text().replace("good", "bad"))
    assert main(_train_args(tmp_path, tmp_path / "e", str(d / "toy0"), "other.jsonl", "--cache", str(cache))) == 2
    err = capsys.readouterr().err
    assert "data: cached" in err and "data_sha256: cached" in err
    assert main(_train_args(d, tmp_path / "f", "toy0", "train.jsonl", "--cache", str(cache), "--max-len", "8")) == 2
    assert "max_len: cached 128, now 8" in capsys.readouterr().err


def test_cli_highlight_span_indexes_tokens_and_explain_orients_directions(models, tmp_path, capsys):
    d = models
    assert main(_train_args(d, tmp_path / "s", "toy0", "train.jsonl", "--steps", "200")) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "steer",
                "highlight",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(tmp_path / "s"),
                "--value",
                "3",
                "--json",
                "the plot was good great happy and the end",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    s, e = res["span"]
    assert len(res["tokens"]) == len(res["scores"]) == 9  # every word scored, the first one too
    assert " ".join(t.strip() for t in res["tokens"][s:e]) == res["span_text"]
    assert set(res["span_text"].split()) <= set(toy.POSITIVE), res

    # -W promotes what W demotes: explain lists the same tokens with + and - swapped
    params, meta = artifact.load(str(tmp_path / "s"))
    artifact.save(
        str(tmp_path / "neg"),
        {"p1": -params["p1"], "p2": params["p2"]},
        base_model=meta["base_model"],
        hidden_size=meta["hidden_size"],
        vocab_size=meta["vocab_size"],
        eps0=meta["eps0"],
        dummy=meta["dummy"],
        steer_names=meta["steer_names"],
    )
    lists = {}
    for name in ("s", "neg"):
        assert (
            main(
                [
                    "steer",
                    "explain",
                    "--model",
                    str(d / "toy0"),
                    "--steer",
                    str(tmp_path / name),
                    "--dirs",
                    "1",
                    "--top",
                    "3",
                    "--json",
                ]
            )
            == 0
        )
        top = json.loads(capsys.readouterr().out)[0]
        lists[name] = ([t for t, _ in top["top"]], [t for t, _ in top["bottom"]])
    assert lists["s"][0] == lists["neg"][1] and lists["s"][1] == lists["neg"][0]
    assert set(lists["s"][0]) & set(toy.POSITIVE) and set(lists["s"][1]) & set(toy.NEGATIVE), lists


def test_with_start_token_scores_the_first_word_of_a_bos_less_encoding():
    from jsteer.steer.cli import _with_start_token

    class Tok:
        def __init__(self, bos, eos):
            self.bos_id, self.eos_id = bos, eos

    assert _with_start_token(Tok(1, 2), [7, 8]) == [1, 7, 8]
    assert _with_start_token(Tok(1, 2), [1, 7, 8]) == [1, 7, 8]  # the tokenizer added it already
    assert _with_start_token(Tok(None, 2), [7]) == [2, 7]
    assert _with_start_token(Tok(None, None), [7, 8]) == [7, 8]


def test_cli_bad_training_settings_fail_before_any_work(models, tmp_path, capsys):
    for flag, value, what in (
        ("--steps", "0", "steps must be >= 1"),
        ("--batch-size", "0", "batch_size must be >= 1"),
        ("--lr", "0", "lr must be > 0"),
    ):
        args = _train_args(models, tmp_path / "s", "toy0", "train.jsonl", "--cache", str(tmp_path / "c.npz"))
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        assert main(args) == 2
        assert what in capsys.readouterr().err
        assert not (tmp_path / "s").exists() and not (tmp_path / "c.npz").exists()


def test_cli_tokens_per_batch_trains_as_the_library(models, tmp_path):
    """--tokens-per-batch (the experiments' low-rank recipes use a static 768) reaches
    train.TrainConfig: the CLI's steer is the library's trained on the same cached states."""
    from jsteer.steer import train

    d = models
    cache = tmp_path / "c.npz"
    assert (
        main(_train_args(d, tmp_path / "t", "toy0", "train.jsonl", "--tokens-per-batch", "48", "--cache", str(cache)))
        == 0
    )
    params, meta = artifact.load(str(tmp_path / "t"))
    assert meta["train"]["tokens_per_batch"] == 48
    emb = np.asarray(jsteer.load(str(d / "toy0")).output_embeddings(), np.float32)
    want, hist = train.train(
        train.HiddenCache.load(str(cache)), emb, train.TrainConfig(rank=8, steps=30, batch_size=16, tokens_per_batch=48)
    )
    assert hist["tokens_per_batch"] == 48
    for k in want:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    assert main(_train_args(d, tmp_path / "u", "toy0", "train.jsonl", "--cache", str(cache))) == 0
    assert "tokens_per_batch" not in artifact.load(str(tmp_path / "u"))[1]["train"]
    assert main(_train_args(d, tmp_path / "v", "toy0", "train.jsonl", "--tokens-per-batch", "0")) == 2


def test_cli_baselines_train_at_their_own_eps0(models, tmp_path, capsys):
    """The blacklist baseline at the CLI's default (eps0 1 for baselines) learns: positive words'
    logit offsets rise above the negative words' at +1."""
    d = models
    assert (
        main(_train_args(d, tmp_path / "bl", "toy0", "train.jsonl", "--baseline", "blacklist", "--steps", "100")) == 0
    )
    params, meta = artifact.load(str(tmp_path / "bl"))
    assert meta["eps0"] == 1.0
    tok = jsteer.load(str(d / "toy0")).tokenizer
    bias = np.asarray(params["offset"][0])  # the user steer's offset [V]
    pos = bias[[tok.token_to_id(w) for w in toy.POSITIVE]].mean()
    neg = bias[[tok.token_to_id(w) for w in toy.NEGATIVE]].mean()
    assert pos - neg > 0.5, (pos, neg)


def _sentiment_words(d, steer, value, capsys):
    """`jsteer steer generate` samples at ``value``: (positive, negative) toy words generated."""
    capsys.readouterr()
    assert (
        main(
            [
                "steer",
                "generate",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(steer),
                "--value",
                str(value),
                "--samples",
                "24",
                "--max-new-tokens",
                "8",
                "--json",
                "the movie was",
                "we saw the film and it",
            ]
        )
        == 0
    )
    words = [w for x in capsys.readouterr().out.strip().splitlines() for w in json.loads(x)["continuation"].split()]
    return sum(w in toy.POSITIVE for w in words), sum(w in toy.NEGATIVE for w in words)


@pytest.mark.parametrize("kind", ["blacklist", "offset"])
def test_cli_baselines_generate_and_steer(models, tmp_path, capsys, kind):
    """A trained baseline artifact decodes through `jsteer steer generate` (it was refused) and
    steers: +value yields more positive than negative toy words, -value the reverse."""
    d = models
    assert main(_train_args(d, tmp_path / kind, "toy0", "train.jsonl", "--baseline", kind, "--steps", "150")) == 0
    (pp, pn), (mp, mn) = (_sentiment_words(d, tmp_path / kind, v, capsys) for v in (3, -3))
    assert pp > 2 * pn + 2 and mn > 2 * mp + 2, (kind, (pp, pn), (mp, mn))
    # composed with a bilinear steer in one call (each at its own strength)
    assert main(_train_args(d, tmp_path / "s", "toy0", "train.jsonl")) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "steer",
                "generate",
                "--model",
                str(d / "toy0"),
                "--steer",
                str(tmp_path / "s"),
                "--value",
                "2",
                "--steer",
                str(tmp_path / kind),
                "--value",
                "-3",
                "--samples",
                "2",
                "--json",
                "the movie was",
            ]
        )
        == 0
    )
    assert len(capsys.readouterr().out.strip().splitlines()) == 2
    if kind == "blacklist":  # vocabulary-space: refused by transfer before the map is fitted
        assert (
            main(
                [
                    "steer",
                    "transfer",
                    "--steer",
                    str(tmp_path / kind),
                    "--from",
                    str(d / "toy0"),
                    "--to",
                    str(d / "toy1"),
                    "--out",
                    str(tmp_path / "t"),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "cannot be transferred by H" in err and "anchor" not in err and not (tmp_path / "t").exists()


def test_cli_quiet_train_and_explain_png(models, tmp_path, capsys):
    """--quiet: no bar on stderr, the one-line summary still ends the job; explain --png draws
    the directions' top / bottom tokens."""
    d = models
    args = ["steer", "train", "--model", str(d / "toy0"), "--data", str(d / "train.jsonl"), "--rank", "4"]
    assert main(["--quiet", *args, "--out", str(tmp_path / "s"), "--steps", "3", "--batch-size", "8"]) == 0
    err = capsys.readouterr().err
    assert "|" not in err and "it/s" not in err
    assert (
        err.strip().splitlines()[-1].startswith("jsteer steer train: trained steer 'steer0' for 3 steps on 120 texts")
    )
    png = tmp_path / "explain.png"
    explain = ["steer", "explain", "--model", str(d / "toy0"), "--steer", str(tmp_path / "s"), "--dirs", "2"]
    assert main([*explain, "--top", "3", "--png", str(png), "--json"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG") and len(json.loads(capsys.readouterr().out)) == 2
