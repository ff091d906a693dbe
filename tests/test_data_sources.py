"""The TFDS layer the pipelines read through: raw files prepared once and keyed by their content."""

import os
import shutil

from jsteer.data import digest, tfds_builders


def _conll_testb(shared_data):
    path = shared_data / "conll2003" / "eng.testb"
    assert path.is_file(), f"{path} is missing"
    return path


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
