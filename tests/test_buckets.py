"""jsteer.data.buckets: the one length-bucketing rule gives every caller the shapes its own
function gave before the rule replaced it. The five old functions are kept here, verbatim, as
the reference (decode.bucket_length, typevec.probe.bucket_length, kala.data.length_bucket,
kala.graph.bucket_size, data.batching.pick_bucket)."""

import math

import numpy as np
import pytest

from jsteer.data import buckets
from jsteer.data.buckets import bucket

# ----------------------------------------------------------------------------- the old rules, verbatim

OLD_DECODE_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # decode.DEFAULT_BUCKETS
OLD_KALA_LENGTH_BUCKETS = (32, 64, 128, 256, 384, 512)  # kala.data.LENGTH_BUCKETS


def old_decode_bucket_length(n, buckets=OLD_DECODE_BUCKETS):
    if n < 1:
        raise ValueError(f"bucket_length: length must be >= 1, got {n}")
    for b in sorted(buckets):
        if n <= b:
            return int(b)
    top = max(buckets)
    return int(-(-n // top) * top)


def old_probe_bucket_length(n, multiple=8):
    return max(multiple, int(math.ceil(n / multiple)) * multiple)


def old_kala_length_bucket(n, buckets=OLD_KALA_LENGTH_BUCKETS):
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"sequence of {n} tokens is longer than the largest bucket {buckets[-1]}")


def old_graph_bucket_size(n, minimum=16):
    size = minimum
    while size < n:
        size *= 2
    return size


def old_pick_bucket(length, buckets):
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def _same(new, old, values):
    """new(n) == old(n) for every n, or both raise ValueError."""
    for n in values:
        try:
            want = old(n)
        except ValueError:
            with pytest.raises(ValueError):
                new(n)
            continue
        got = new(n)
        assert got == want and type(got) is int, (n, got, want)


# ----------------------------------------------------------------------------- each caller's set


def test_decode_prompt_lengths_are_unchanged():
    assert buckets.DECODE.sizes == OLD_DECODE_BUCKETS
    _same(buckets.DECODE, old_decode_bucket_length, range(1, 9000))
    for sizes in ((4, 8), (8, 4), (100,), (3, 7, 50)):  # decode.bucket_length(n, buckets=...)
        _same(
            lambda n, s=sizes: bucket(n, s, "multiple"),
            lambda n, s=sizes: old_decode_bucket_length(n, s),
            range(1, 400),
        )


def test_io_refuses_an_empty_prompt_as_decode_did():
    from jsteer.io import _bucket_length

    _same(_bucket_length, old_decode_bucket_length, range(-3, 5000))


def test_probe_row_lengths_are_unchanged():
    assert buckets.PROBE.sizes == (8,)
    _same(buckets.PROBE, old_probe_bucket_length, range(-5, 3000))
    for multiple in (1, 3, 8, 16, 64):  # probe's _length_batches(bucket=multiple)
        _same(
            lambda n, m=multiple: bucket(n, (m,), "multiple"),
            lambda n, m=multiple: old_probe_bucket_length(n, m),
            range(0, 1000),
        )


def test_kala_length_buckets_are_unchanged():
    assert buckets.KALA_LENGTHS.sizes == OLD_KALA_LENGTH_BUCKETS
    _same(buckets.KALA_LENGTHS, old_kala_length_bucket, range(0, 700))
    _same(lambda n: bucket(n, (16, 48)), lambda n: old_kala_length_bucket(n, (16, 48)), range(0, 60))


def test_graph_sizes_are_unchanged():
    assert buckets.GRAPH.sizes == (16,)
    _same(buckets.GRAPH, old_graph_bucket_size, range(-2, 20000))
    for minimum in (1, 3, 12, 16, 40, 96, 1000):  # stack_graphs: bucket_size(n, s) for any s
        _same(
            lambda n, m=minimum: bucket(n, (m,), "double"),
            lambda n, m=minimum: old_graph_bucket_size(n, m),
            range(0, 5000, 7),
        )


def test_batcher_buckets_are_unchanged():
    for sizes in ((16, 32), (8, 16, 32, 64), buckets.bucket_boundaries(100, 16), buckets.bucket_boundaries(40, 3, 1.3)):
        _same(lambda n, s=sizes: bucket(n, s), lambda n, s=sizes: old_pick_bucket(n, s), range(0, 200))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket(33, (16, 32))


def test_callers_use_the_rule():
    """The callers' shapes through their own code paths, against the old functions."""
    from jsteer.data import batching
    from jsteer.kala import data as kdata
    from jsteer.kala import graph as kgraph

    rng = np.random.default_rng(0)
    exs = [{"input_ids": np.arange(1, n + 1, dtype=np.int32)} for n in rng.integers(1, 60, 40)]
    b = batching.Batcher(
        exs,
        8,
        buckets=(8, 16, 32, 64),
        pad_values={"input_ids": 0},
        seed=0,
        sort_window=2,
        process_index=0,
        process_count=1,
    )
    for ids in b.epoch_batches(0):
        want = old_pick_bucket(max(len(exs[i]["input_ids"]) for i in ids), (8, 16, 32, 64))
        assert b.collate(ids)["input_ids"].shape[1] == want
    g = kgraph.ExampleGraph(
        entity=np.zeros(0, np.int32),
        senders=np.zeros(0, np.int32),
        receivers=np.zeros(0, np.int32),
        relation=np.zeros(0, np.int32),
        n_local=0,
    )
    graph, _ = kgraph.batch_graphs([g] * 3, -np.ones((3, 4), np.int32))
    assert (graph.nodes["entity"].shape[0], graph.senders.shape[0]) == (
        old_graph_bucket_size(1),
        old_graph_bucket_size(0),
    )
    assert not hasattr(kdata, "length_bucket") and not hasattr(kgraph, "bucket_size")


def test_rule_arguments():
    with pytest.raises(ValueError, match="no bucket sizes"):
        bucket(3, ())
    with pytest.raises(ValueError, match="beyond must be one of"):
        bucket(3, (4,), "grow")
    assert buckets.Buckets((4, 8), "double")(17) == 32 and buckets.Buckets((4, 8))(5) == 8
