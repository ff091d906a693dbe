"""Content hashes of source files, remembered between runs so big files are not re-read.

The cache key of a prepared data set is the sha256 of each source file's *content*, never its
path or mtime: an edited file invalidates the cache even when its size and mtime were put back,
and a copy of a file reuses it. Hashing is streamed (constant memory).

:func:`file_sha256` remembers each hash in a small JSON sidecar (``<data_dir>/source_hashes.json``),
keyed by the file's path and its ``(device, inode, size, mtime_ns, ctime_ns)``. Writing a file
changes its ctime, and ``os.utime`` cannot set the ctime back (it sets it to now), so an edit
always misses the sidecar. A hash taken within :data:`RACY_SECONDS` of the file's last change is
not remembered: timestamps are coarse (a few ms), and a second write inside the same tick would
keep every stamp (git's "racy clean" rule).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from typing import Optional, Union

PathLike = Union[str, os.PathLike]

SIDECAR = "source_hashes.json"
RACY_SECONDS = 2.0
CHUNK_BYTES = 1 << 20
MAX_ENTRIES = 4096  # oldest dropped beyond this (the sidecar stays a few hundred KB)


def sha256_stream(path: PathLike, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_sidecar(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or damaged: it is only a cache
    return data if isinstance(data, dict) else {}


def _write_sidecar(path: pathlib.Path, entries: dict) -> None:
    if len(entries) > MAX_ENTRIES:
        keep = sorted(entries.items(), key=lambda kv: kv[1].get("at", 0))[-MAX_ENTRIES:]
        entries = dict(keep)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)  # readers see the old or the new sidecar, never half of one
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache folder: hashes are just not remembered


def file_sha256(path: PathLike, cache_dir: Optional[PathLike] = None) -> str:
    """Hex sha256 of ``path``'s content; with ``cache_dir``, remembered in its sidecar (see the
    module docstring) and read from there while the file is unchanged."""
    p = pathlib.Path(path).resolve()
    if cache_dir is None:
        return sha256_stream(p)
    sidecar = pathlib.Path(cache_dir) / SIDECAR
    before = os.stat(p)
    entries = _read_sidecar(sidecar)
    hit = entries.get(str(p))
    if isinstance(hit, dict) and hit.get("stat") == _stamp(before) and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = sha256_stream(p)
    after = os.stat(p)
    now = time.time()
    changed_at = max(after.st_mtime_ns, after.st_ctime_ns) / 1e9
    if _stamp(after) == _stamp(before) and now - changed_at >= RACY_SECONDS:
        entries = _read_sidecar(sidecar)  # another process may have added entries meanwhile
        entries[str(p)] = {"stat": _stamp(after), "sha256": digest, "at": now}
        _write_sidecar(sidecar, entries)
    return digest
