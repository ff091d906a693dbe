"""The real shared data sets, parsed in full, through the readers and the TFDS builders."""

import collections

import numpy as np
import pytest

from jsteer.data import ner, readers, tfds_builders


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def entity_counts(sentences):
    return dict(collections.Counter(t[2:] for s in sentences for t in s.tags if t.startswith("B-")))


def test_conll2003_counts_match_the_published_statistics(shared_data, cache):
    root = shared_data / "conll2003"
    want = {  # sentences, tokens, documents, entities (Tjong Kim Sang & De Meulder 2003, Table 2)
        "train": (14041, 203621, 946, {"LOC": 7140, "MISC": 3438, "ORG": 6321, "PER": 6600}),
        "testa": (3250, 51362, 216, {"LOC": 1837, "MISC": 922, "ORG": 1341, "PER": 1842}),
        "testb": (3453, 46435, 231, {"LOC": 1668, "MISC": 702, "ORG": 1661, "PER": 1617}),
    }
    parsed = {}
    for split, (n_sent, n_tok, n_doc, ents) in want.items():
        sents = readers.read_conll(root / f"eng.{split}", scheme="iob1", label_set=ner.CONLL2003_LABELS)
        parsed[split] = sents
        assert len(sents) == n_sent
        assert sum(len(s.tokens) for s in sents) == n_tok
        assert len({s.doc for s in sents}) == n_doc
        assert entity_counts(sents) == ents  # IOB1 -> IOB2 opened every entity with B-
        assert all(ner.iob2_violation(s.tags) is None for s in sents)

    ds = tfds_builders.conll2003(root, cache)
    assert {k: len(v) for k, v in ds.items()} == {"train": 14041, "validation": 3250, "test": 3453}
    src = ds["test"]
    for i in (0, 1234, 3452):  # records equal the parsed sentences, in file order
        ex, s = src[i], parsed["testb"][i]
        assert [t.decode() for t in ex["tokens"]] == list(s.tokens)
        assert [ds.label_names[j] for j in ex["tags"]] == list(s.tags)
        assert int(ex["line"]) == s.line


def test_ncbi_disease_counts(shared_data, cache):
    root = shared_data / "ncbi_disease"
    want = {"train": (5432, 5145), "devel": (923, 787), "test": (940, 960)}  # sentences, disease mentions
    for split, (n_sent, n_ment) in want.items():
        sents = readers.read_conll(
            root / f"{split}.tsv", delimiter="\t", scheme="iob2", label_set=ner.NCBI_DISEASE_LABELS
        )
        assert len(sents) == n_sent
        assert entity_counts(sents) == {"Disease": n_ment}
    ds = tfds_builders.ncbi_disease(root, cache)
    assert {k: len(v) for k, v in ds.items()} == {"train": 5432, "validation": 923, "test": 940}
    tags = np.concatenate([ds["validation"][i]["tags"] for i in range(len(ds["validation"]))])
    assert int((tags == ds.label_names.index("B-Disease")).sum()) == 787


def test_sst5_and_jigsaw(shared_data, cache):
    want = {
        "train": [1092, 2218, 1624, 2322, 1288],
        "dev": [139, 289, 229, 279, 165],
        "test": [279, 633, 389, 510, 399],
    }
    for split, counts in want.items():
        recs = readers.read_jsonl_labeled(shared_data / "sst5" / f"{split}.jsonl", label_set=list("01234"))
        assert [sum(r.label == str(c) for r in recs) for c in range(5)] == counts
    ds = tfds_builders.sst5(shared_data / "sst5", cache)
    assert {k: len(v) for k, v in ds.items()} == {"train": 8544, "validation": 1101, "test": 2210}
    assert np.bincount([int(ds["validation"][i]["label"]) for i in range(1101)]).tolist() == want["dev"]

    path = shared_data / "jigsaw_toxic_subset" / "test.csv"
    recs = readers.read_csv_labeled(path, label_set=["0", "1"])
    assert len(recs) == 12180
    assert collections.Counter(r.label for r in recs) == {"0": 6090, "1": 6090}
    ds = tfds_builders.jigsaw(path, cache)
    assert len(ds["test"]) == 12180 and ds.label_names == ["0", "1"]
    assert tfds_builders.text(ds["test"][0]["text"]) == recs[0].text


def test_lama_raw_and_templates(shared_data, cache):
    root = shared_data / "lama"
    templates = readers.read_lama_relations(root / "relations.jsonl")
    assert len(templates) == 46 and templates["P19"] == "[X] was born in [Y] ."
    trex = [f for p in sorted((root / "TREx").glob("*.jsonl")) for f in readers.read_lama_jsonl(p)]
    assert len(trex) == 22881
    assert len({f.relation for f in trex}) == 28 and all(f.relation in templates for f in trex)
    google = {p.stem: readers.read_lama_jsonl(p) for p in sorted((root / "Google_RE").glob("*.jsonl"))}
    assert {k: len(v) for k, v in google.items()} == {
        "date_of_birth_test": 1825,
        "place_of_birth_test": 2937,
        "place_of_death_test": 766,
    }
    assert all(f.masked_sentences for f in trex)

    ds = tfds_builders.prepare(
        tfds_builders.Lama,
        cache,
        splits={"google_re": sorted((root / "Google_RE").glob("*.jsonl"))},
        templates=root / "relations.jsonl",
    )
    src = ds["google_re"]
    assert len(src) == 5528
    ex = src[1825]  # first place_of_birth fact (files in sorted order)
    assert tfds_builders.text(ex["relation"]) == "place_of_birth"
    assert tfds_builders.text(ex["prompt"]) == google["place_of_birth_test"][0].sub_label + " was born in [MASK] ."


def test_typed_lama_prompts(shared_data, cache):
    root = shared_data / "type_embedding" / "processed_lama"
    prompts = readers.read_typed_lama_dir(root)
    assert len(prompts) == 28819
    assert len({p.type_name for p in prompts}) == 17
    assert collections.Counter(p.corpus for p in prompts) == {"TREx": 23309, "Google_RE": 5510}
    city = [p for p in prompts if p.type_name == "City" and p.relation == "P20"]
    assert city[0].sent == "Akihiko Saito died in [MASK] ." and city[0].gold == "Iraq"
    ds = tfds_builders.prepare(tfds_builders.TypedLama, cache, root=root)
    src = ds["test"]
    assert len(src) == 28819 and len(ds.label_names) == 17
    k = 20000
    assert tfds_builders.text(src[k]["sent"]) == prompts[k].sent
    assert ds.label_names[int(src[k]["type"])] == prompts[k].type_name
