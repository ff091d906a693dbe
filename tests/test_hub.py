"""Hub ids resolved from a local HF cache laid out as huggingface_hub writes it (built here in
tmp_path: blobs/, snapshots/<commit>/ of symlinks, refs/<name>); nothing is downloaded."""

import hashlib
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

import jsteer
from jsteer import hub

REPO = "tiny-org/tiny-bert"
COMMITS = ("a" * 40, "b" * 40)


def _bert_folder(path: pathlib.Path, seed: int) -> pathlib.Path:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    transformers.BertModel(cfg).save_pretrained(path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(27)]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return path


def _add_snapshot(repo: pathlib.Path, commit: str, src: pathlib.Path) -> None:
    """Files stored once under blobs/<sha256>, linked from snapshots/<commit>/ (as the hub client does)."""
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(pathlib.Path("..", "..", "blobs", blob.name))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding REPO at two commits: refs/main -> COMMITS[1], refs/v1 -> COMMITS[0]."""
    root = tmp_path_factory.mktemp("hf_cache")
    repo = root / "models--tiny-org--tiny-bert"
    for i, commit in enumerate(COMMITS):
        _add_snapshot(repo, commit, _bert_folder(tmp_path_factory.mktemp(f"src{i}"), seed=i))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[1])
    (repo / "refs" / "v1").write_text(COMMITS[0] + "\n")
    return root


@pytest.fixture
def in_cache(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no local folder shadows the id
    return cache


def _embedding(lm) -> np.ndarray:
    return np.asarray(lm.input_embeddings())


def test_hub_id_loads_refs_main_snapshot(in_cache):
    lm = jsteer.load(REPO)
    snap = in_cache / "models--tiny-org--tiny-bert" / "snapshots" / COMMITS[1]
    assert lm.family == "bert" and lm.provenance["hub_id"] == REPO and lm.provenance["revision"] == COMMITS[1]
    direct = jsteer.load(snap)  # the snapshot folder itself is an HF folder
    np.testing.assert_array_equal(_embedding(lm), _embedding(direct))
    assert lm.identity == direct.identity
    assert lm.tokenizer.encode("w3 w4") == direct.tokenizer.encode("w3 w4")


@pytest.mark.parametrize(
    "revision, commit", [("v1", 0), (COMMITS[0], 0), ("aaaaaaa", 0), ("main", 1), (COMMITS[1][:12], 1)]
)
def test_revision_selects_a_snapshot(in_cache, revision, commit):
    lm = jsteer.load(REPO, revision=revision)
    assert lm.provenance["revision"] == COMMITS[commit]
    want = jsteer.load(in_cache / "models--tiny-org--tiny-bert" / "snapshots" / COMMITS[commit])
    np.testing.assert_array_equal(_embedding(lm), _embedding(want))


def test_two_snapshots_differ(in_cache):
    assert not np.array_equal(_embedding(jsteer.load(REPO, revision="v1")), _embedding(jsteer.load(REPO)))


def test_cache_folder_path_with_and_without_revision(in_cache):
    folder = in_cache / "models--tiny-org--tiny-bert"
    lm = jsteer.load(folder)
    assert lm.provenance["revision"] == COMMITS[1] and lm.provenance["hub_cache_folder"] == str(folder)
    assert jsteer.load(str(folder), revision="v1").provenance["revision"] == COMMITS[0]


def test_hf_home_and_default_cache_locations(cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    home = tmp_path / "hf_home"
    home.mkdir()
    (home / "hub").symlink_to(cache)
    monkeypatch.setenv("HF_HOME", str(home))
    assert hub.cache_dir() == (home / "hub", "$HF_HOME/hub")
    assert jsteer.load(REPO).provenance["revision"] == COMMITS[1]
    monkeypatch.delenv("HF_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.cache_dir()[0] == tmp_path / ".cache" / "huggingface" / "hub"


def test_missing_id_names_the_id_and_every_place_looked(in_cache):
    with pytest.raises(FileNotFoundError) as e:
        jsteer.load("nobody/nothing")
    msg = str(e.value)
    assert "'nobody/nothing'" in msg
    assert "embedded model names: minilm, smollm2-135m" in msg
    assert str(pathlib.Path.cwd() / "nobody" / "nothing") in msg  # the local path
    assert str(in_cache / "models--nobody--nothing") in msg and "$HF_HUB_CACHE" in msg
    assert "never downloads" in msg


def test_missing_revision_lists_what_is_cached(in_cache):
    with pytest.raises(FileNotFoundError) as e:
        jsteer.load(REPO, revision="v2")
    msg = str(e.value)
    assert "'v2'" in msg and "models--tiny-org--tiny-bert" in msg
    assert "main" in msg and "v1" in msg and COMMITS[0] in msg and COMMITS[1] in msg
    with pytest.raises(ValueError, match="revision"):
        jsteer.load(REPO, revision="../../etc")


def test_ref_to_a_missing_snapshot_is_named(in_cache, tmp_path):
    repo = tmp_path / "models--x--y"
    shutil.copytree(in_cache / "models--tiny-org--tiny-bert", repo, symlinks=True)
    shutil.rmtree(repo / "snapshots" / COMMITS[1])
    with pytest.raises(FileNotFoundError, match=rf"refs/main points at commit {COMMITS[1]}.*missing"):
        jsteer.load(repo)


def test_embedded_names_and_local_paths_keep_priority(in_cache, tmp_path):
    local = _bert_folder(tmp_path / "tiny-org" / "tiny-bert", seed=7)  # cwd is tmp_path: shadows the id
    lm = jsteer.load(REPO)
    assert "hub_id" not in lm.provenance and lm.provenance["source"] == str(local.resolve())
    with pytest.raises(ValueError, match="revision.*not one"):
        jsteer.load(REPO, revision="v1")
    minilm = in_cache / "models--minilm"
    _add_snapshot(minilm, COMMITS[0], local)
    (minilm / "refs").mkdir()
    (minilm / "refs" / "main").write_text(COMMITS[0])
    assert jsteer.load("minilm").provenance["embedded"] == "minilm"  # the embedded model, not the cache's
    with pytest.raises(ValueError, match="revision"):
        jsteer.load("minilm", revision="main")


def test_repo_id_syntax():
    for ok in ("gpt2", "Qwen/Qwen2.5-0.5B", "org_1/model.v2"):
        assert hub.is_repo_id(ok), ok
    for bad in ("a/b/c", "org/../x", "models--a--b", "/abs/path", "./rel", "a//b", ""):
        assert not hub.is_repo_id(bad), bad


def test_save_keeps_hub_provenance(in_cache, tmp_path):
    lm = jsteer.load(REPO, revision="v1")
    jsteer.save(lm, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck")
    assert back.provenance["hub_id"] == REPO and back.provenance["revision"] == COMMITS[0]
    assert back.identity == lm.identity
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(lm.params))
    )
    assert json.loads((tmp_path / "ck" / "jsteer.json").read_text())["provenance"]["hub_id"] == REPO
