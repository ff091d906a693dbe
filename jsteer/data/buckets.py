"""One rule for static shapes: round a length (or a graph size) up to the next bucket.

jit compiles one program per input shape, so every size that varies from call to call
(a prompt's length, a batch's longest sentence, a batch graph's node count) is first rounded
up to a member of a small set; the number of programs stays bounded by the set's size.

:func:`bucket` is that rule: the smallest member of a sorted set >= n, and past the largest
member what ``beyond`` says (an error, the next multiple of the largest, or the largest
doubled until it holds n). :class:`Buckets` pairs a set with its ``beyond``; the named sets
below are the ones jsteer's callers use, each kept as it was when it was that caller's own
function, so every shape a caller produced it still produces:

================  ===============================  =========  ==================================
name              sizes                            beyond     caller
================  ===============================  =========  ==================================
DECODE            16, 32, ..., 2048                multiple   prompt lengths (jsteer.generation)
KALA_LENGTHS      32, 64, 128, 256, 384, 512       error      KALA batches (jsteer.kala.data)
PROBE             8                                multiple   LAMA probe rows (jsteer.typevec.probe)
GRAPH             16                               double     batch graphs (jsteer.kala.graph)
================  ===============================  =========  ==================================

:class:`jsteer.data.batching.Batcher` takes its set from its caller (``bucket(n, buckets)``),
often one made by :func:`bucket_boundaries`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

BEYOND = ("error", "multiple", "double")


def bucket(n: int, sizes: Sequence[int], beyond: str = "error") -> int:
    """Smallest of ``sizes`` that is >= ``n``. Past the largest (``top``), ``beyond`` decides:
    ``"error"`` raises ValueError, ``"multiple"`` gives the next multiple of ``top``,
    ``"double"`` gives ``top * 2^k`` for the smallest k that holds ``n``.
    Any ``n`` at or below the smallest size (0 included) gives the smallest size."""
    if not sizes:
        raise ValueError("bucket: no bucket sizes")
    if beyond not in BEYOND:
        raise ValueError(f"bucket: beyond must be one of {BEYOND}, got {beyond!r}")
    ordered = sorted(int(s) for s in sizes)
    for s in ordered:
        if n <= s:
            return s
    top = ordered[-1]
    if beyond == "multiple":
        return -(-int(n) // top) * top
    if beyond == "double":
        size = top
        while size < n:
            size *= 2
        return size
    raise ValueError(f"{n} exceeds the largest bucket {top}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """A bucket set and what happens past its largest member: ``Buckets(...)(n)`` is
    :func:`bucket` ``(n, sizes, beyond)``."""

    sizes: tuple[int, ...]
    beyond: str = "error"

    def __call__(self, n: int) -> int:
        return bucket(n, self.sizes, self.beyond)


DECODE = Buckets((16, 32, 64, 128, 256, 512, 1024, 2048), "multiple")
KALA_LENGTHS = Buckets((32, 64, 128, 256, 384, 512))
PROBE = Buckets((8,), "multiple")
GRAPH = Buckets((16,), "double")


def bucket_boundaries(max_len: int, min_len: int = 16, growth: float = 2.0) -> tuple[int, ...]:
    """Geometric bucket sizes ``min_len, min_len*growth, ...`` capped by and ending at ``max_len``.

    Strictly increasing (what :class:`jsteer.data.batching.Batcher` requires): where rounding
    down would repeat a length (small ``growth``), the next bucket is one longer than the last.
    """
    if min_len < 1 or max_len < min_len or growth <= 1.0:
        raise ValueError(f"need 1 <= min_len <= max_len and growth > 1 (got {min_len}, {max_len}, {growth})")
    out = []
    b = float(min_len)
    length = min_len
    while length < max_len:
        out.append(length)
        b *= growth
        length = max(int(b), length + 1)
    out.append(max_len)
    return tuple(out)
