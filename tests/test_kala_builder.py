"""jsteer.kala.builder.build_graph on a folder that already holds a graph (the Python API's guard)."""

import pytest

from jsteer.kala import builder


def _conll(path, sents):
    path.write_text("".join("".join(f"{w} O\n" for w in s.split()) + "\n" for s in sents))
    return path


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_build_graph_refuses_to_replace_a_graph_unless_overwrite(tmp_path):
    """Mining a new graph into a folder that holds one would replace the facts and lexicon its
    trained models use: refused (naming the folder and its files), nothing written; annotating
    with the folder's lexicon is no replacement; ``overwrite=True`` replaces the graph and deletes
    the old mentions of files not given now (warned)."""
    first = _conll(
        tmp_path / "first.conll",
        [f"{p} visited {q} today ." for p in ("Anna", "Tom", "Rita") for q in ("Paris", "London")] * 2,
    )
    other = _conll(tmp_path / "other.conll", ["In Bonn and Rome ."] * 4)
    g = tmp_path / "g"
    builder.build_graph([first], g)
    before = _files(g)
    with pytest.raises(
        ValueError,
        match=rf"--out {g} already holds a graph \(facts.jsonl, first.conll.mentions.jsonl, "
        rf"lexicon.tsv, summary.json\).*overwrite=True",
    ):
        builder.build_graph([other], g)
    with pytest.raises(ValueError, match="already holds a graph"):
        builder.build_graph([other], g, spacy_model="en_core_web_sm")  # spaCy mines a new graph too
    assert _files(g) == before
    with pytest.raises(ValueError, match="--overwrite has no use with --lexicon"):
        builder.build_graph([other], g, lexicon_path=g / "lexicon.tsv", overwrite=True)
    builder.build_graph([other], g, lexicon_path=g / "lexicon.tsv")  # annotate only: lexicon and facts kept
    assert {k: v for k, v in _files(g).items() if k != "summary.json" and k != "other.conll.mentions.jsonl"} == {
        k: v for k, v in before.items() if k != "summary.json"
    }
    with pytest.warns(
        UserWarning, match="deleted the replaced graph's mentions of files not given now: first.conll.mentions.jsonl"
    ):
        s = builder.build_graph([other], g, overwrite=True)
    assert sorted(_files(g)) == ["facts.jsonl", "lexicon.tsv", "other.conll.mentions.jsonl", "summary.json"]
    assert list(s["files"]) == ["other.conll"]
    assert "Bonn" in (g / "lexicon.tsv").read_text() and "Anna" not in (g / "lexicon.tsv").read_text()


def test_build_graph_into_a_folder_without_a_graph(tmp_path):
    """A new or graph-less folder (other files are no graph) needs no ``overwrite``."""
    a = _conll(tmp_path / "a.conll", ["Anna visited Paris ."] * 3)
    g = tmp_path / "g"
    g.mkdir()
    (g / "notes.txt").write_text("mine")
    builder.build_graph([a], g)
    assert sorted(_files(g)) == ["a.conll.mentions.jsonl", "facts.jsonl", "lexicon.tsv", "notes.txt", "summary.json"]
    builder.build_graph([a], tmp_path / "new" / "g")
