"""The TFDS layer the pipelines read through: raw files prepared once and keyed by their content,
prepared data sets opened by name (jsteer.data.sources), and no temp folders left behind."""

import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow_datasets as tfds

from jsteer.data import digest, readers, sources, tfds_builders


@pytest.fixture()
def private_tmp(tmp_path, monkeypatch):
    """tempfile's folder moved under tmp_path: whatever the code leaves in it is seen (and the
    machine's /tmp, which other processes write to, is not consulted)."""
    d = tmp_path / "systmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _conll_testb(shared_data):
    path = shared_data / "conll2003" / "eng.testb"
    assert path.is_file(), f"{path} is missing"
    return path


def _counting(monkeypatch, cls):
    calls = []
    original = cls._generate_examples

    def counted(self, split):
        calls.append(split)
        return original(self, split)

    monkeypatch.setattr(cls, "_generate_examples", counted)
    return calls


def _shards(ds):
    return {p: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in map(str, ds.info.splits["data"].filepaths)}


def test_a_raw_file_is_prepared_once_then_reused(shared_data, tmp_path, monkeypatch):
    src = _conll_testb(shared_data)
    calls = _counting(monkeypatch, tfds_builders.ConllNer)
    first = tfds_builders.prepare(tfds_builders.ConllNer, tmp_path / "cache", splits={"data": src}, scheme="iob1")
    shards = _shards(first)
    again = tfds_builders.prepare(tfds_builders.ConllNer, tmp_path / "cache", splits={"data": src}, scheme="iob1")
    assert calls == ["data"]  # the second prepare generated nothing
    assert again.builder_dir == first.builder_dir and _shards(again) == shards  # same files, untouched
    # the records are the reader's sentences, in file order, with the inferred IOB2 tag set
    sents = readers.read_conll(src, scheme="iob1")
    got = sources.tagged_sentences(sources.from_prepared(again, "data"))
    assert [(s.tokens, s.tags, s.line, s.doc) for s in got] == [(s.tokens, s.tags, s.line, s.doc) for s in sents]
    assert again.label_names == ["O"] + sorted({t for s in sents for t in s.tags} - {"O"})
    assert again.info.metadata["sources"]["data"] == [{"name": "eng.testb", "sha256": digest.sha256_stream(src)}]
    # opened by name from the cache folder alone, as --tfds NAME --tfds-data-dir DIR does
    named = sources.open_tfds(again.name, again.data_dir, need=sources.NER)
    assert named.split == "data" and len(named) == len(sents) and named.source_names == ["eng.testb"]


def test_the_cache_key_is_the_content(shared_data, tmp_path):
    """A copy reuses the prepared records; an edit invalidates them even with the file's size and
    mtime put back (os.utime), and after the file's hash was remembered in the sidecar."""
    cache = tmp_path / "cache"
    copy = tmp_path / "src" / "copy.conll"
    copy.parent.mkdir()
    shutil.copy(_conll_testb(shared_data), copy)
    orig = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"data": _conll_testb(shared_data)})
    copied = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"data": copy})
    assert copied.builder_dir == orig.builder_dir
    st = os.stat(copy)
    data = copy.read_bytes()
    i = data.index(b"JAPAN")
    copy.write_bytes(data[:i] + b"JAPAM" + data[i + 5 :])  # same size
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(copy).st_size, os.stat(copy).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    edited = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"data": copy})
    assert edited.builder_dir != orig.builder_dir
    tokens = [t.decode() for rec in edited["data"].__getitems__(range(3)) for t in rec["tokens"]]
    assert "JAPAM" in tokens and "JAPAN" not in tokens
    # other parse options are another data set
    iob2 = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"data": copy}, scheme="iob1")
    assert iob2.builder_dir not in (edited.builder_dir, orig.builder_dir)


def test_the_hash_sidecar_is_read_only_while_the_file_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "RACY_SECONDS", 0.0)  # files written just now are remembered too
    hashed = []
    real = digest.sha256_stream
    monkeypatch.setattr(digest, "sha256_stream", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "data.txt"
    f.write_bytes(b"abc\n" * 1000)
    cache = tmp_path / "cache"
    h = digest.file_sha256(f, cache)
    assert h == real(f) and len(hashed) == 1 and (cache / digest.SIDECAR).is_file()
    assert digest.file_sha256(f, cache) == h and len(hashed) == 1  # remembered
    st = os.stat(f)
    f.write_bytes(b"abd\n" + b"abc\n" * 999)  # same size, mtime put back: the ctime still moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    h2 = digest.file_sha256(f, cache)
    assert h2 == real(f) != h and len(hashed) == 2
    (cache / digest.SIDECAR).write_text("{not json")  # a damaged sidecar is only a cache miss
    assert digest.file_sha256(f, cache) == h2


def test_a_file_changed_within_the_timestamp_tick_is_not_remembered(tmp_path):
    f = tmp_path / "fresh.txt"
    f.write_text("x\n")
    digest.file_sha256(f, tmp_path / "cache")  # written just now: a same-tick rewrite would keep every stamp
    assert not (tmp_path / "cache" / digest.SIDECAR).exists()


class JsteerTestForeignNer(tfds.core.GeneratorBasedBuilder):
    """A data set written by someone else's builder: Sequence(Text) tokens, Sequence(ClassLabel)
    tags in IOB1, two splits."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {"2.0.0": "test"}

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return None

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "tokens": tfds.features.Sequence(tfds.features.Text()),
                    "tags": tfds.features.Sequence(tfds.features.ClassLabel(names=["O", "I-PER", "B-PER"])),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0), "dev": self._generate_examples(1)}

    def _generate_examples(self, k):
        yield (
            0,
            {"tokens": ["Anna", "Tom", "met", "Rita"], "tags": ["I-PER", "I-PER", "O", "I-PER"][: 4 - k] + ["O"] * k},
        )


def test_open_tfds_reads_a_foreign_data_set_and_names_what_is_missing(tmp_path, private_tmp):
    d = tmp_path / "tfds"
    with tfds_builders.quiet_tfds():
        JsteerTestForeignNer(data_dir=str(d), file_format="array_record").download_and_prepare()
    leaked_by_tfds = set(private_tmp.iterdir())  # its own DatasetInfo's GCS lookup (TFDS 4.9)
    name = "jsteer_test_foreign_ner"
    split = sources.open_tfds(name, d, need=sources.NER, default_split="train")
    assert split.split == "train" and split.describe() == f"tfds {name}:train in {d}"
    (s,) = sources.tagged_sentences(split, scheme="iob1", label_set=["O", "B-PER", "I-PER"])
    assert s.tokens == ("Anna", "Tom", "met", "Rita") and s.tags == ("B-PER", "I-PER", "O", "B-PER")
    with pytest.raises(readers.DataError, match=r"tfds jsteer_test_foreign_ner:dev in .*:1: label 'I-PER' not in"):
        sources.tagged_sentences(sources.open_tfds(f"{name}:dev", d), label_set=["O"])
    assert split.digest() == split.digest() != sources.open_tfds(f"{name}:dev", d).digest()

    bad = [
        (("nope", d), rf"tfds nope: no such data set in {d} \(it holds: {name}\)"),
        ((name, tmp_path / "absent"), rf"tfds {name}: the data dir {tmp_path / 'absent'} does not exist"),
        ((f"{name}:test", d), rf"tfds {name} in {d} has no split 'test' \(splits: \['dev', 'train'\]\)"),
        ((name, d), rf"tfds {name} in {d} has splits \['dev', 'train'\]: name one as {name}:SPLIT"),
        ((f"{name}/cfg", d), rf"tfds {name} in {d} has no config 'cfg'"),
        (("a:b:c", d), r"expected NAME\[/CONFIG\]\[:SPLIT\]"),
    ]
    for (spec, where), msg in bad:
        with pytest.raises(sources.DatasetError, match=msg):
            sources.open_tfds(spec, where)
    with pytest.raises(sources.DatasetError, match=r"lacks the feature\(s\) \['text', 'label'\] for a steer"):
        sources.open_tfds(f"{name}:train", d, need=sources.LABELED, what="for a steer")
    assert set(private_tmp.iterdir()) == leaked_by_tfds  # opening by name makes none


def test_a_jsteer_data_set_with_configs_needs_one_named(tmp_path):
    cache = tmp_path / "cache"
    a = tmp_path / "a.conll"
    a.write_text("EU B-ORG\nrejects O\n")
    b = tmp_path / "b.conll"
    b.write_text("Paris B-LOC\n")
    one = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"train": a})
    assert sources.open_tfds("jsteer_conll_ner", cache).name == one.name  # the only config
    two = tfds_builders.prepare(tfds_builders.ConllNer, cache, splits={"train": b})
    with pytest.raises(sources.DatasetError, match=r"has configs \[.*\]: name one as jsteer_conll_ner/CONFIG"):
        sources.open_tfds("jsteer_conll_ner", cache)
    split = sources.open_tfds(f"{two.name}:train", cache)
    assert [s.tokens for s in sources.tagged_sentences(split)] == [("Paris",)]
    assert split.class_names("tags") == ["B-LOC"] and np.asarray(split.records()[0]["tags"]).tolist() == [0]


def test_labels_outside_the_label_set_name_the_file_line(tmp_path):
    """The label-set check on prepared records reports the tag's own line, as the reader does."""
    f = tmp_path / "t.conll"
    f.write_text("-DOCSTART- O\n\nEU B-ORG\nParis B-LOC\n\nRome B-LOC\n")
    split = sources.prepared(tfds_builders.ConllNer, f, tmp_path / "cache", scheme="iob2")
    with pytest.raises(readers.DataError) as e:
        sources.tagged_sentences(split, label_set=["O", "B-ORG", "I-ORG"])
    with pytest.raises(readers.DataError) as want:
        readers.read_conll(f, scheme="iob2", label_set=["O", "B-ORG", "I-ORG"])
    assert str(e.value) == str(want.value) and e.value.line == 4
