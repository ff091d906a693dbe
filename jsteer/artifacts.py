"""Small artifacts (steers, type vectors, control vectors, trained method heads) as one portable
``.safetensors`` file: the arrays, plus JSON metadata in the file's ``__metadata__``.

    save(path, {"p1": [S, D, R], "p2": [S, D, R]}, {"format": "jsteer.steer/1", "base_model": ...})
    tree, meta = load(path)

Plain ``safetensors`` reads such a file without jsteer (``safetensors.numpy.load_file`` gives
the arrays under their ``/``-joined tree paths; ``safe_open(...).metadata()["jsteer"]`` the JSON
metadata). Nested dicts and lists of arrays round-trip (their structure is kept in the metadata
as ``jsteer_tree``). Writes are atomic (a temporary file beside the target, renamed into place),
so an interrupted save leaves the previous file. :func:`load` still reads the Orbax folders that
jsteer wrote before (``jsteer.artifact/1``).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import uuid
from typing import Any, Mapping, Optional

import numpy as np

PathLike = str | os.PathLike
FORMAT = "jsteer.artifact/2"


def _flatten(tree: Any, prefix: str, out: dict) -> Any:
    """-> the structure with each leaf replaced by its path; fills out[path] = array."""
    if isinstance(tree, Mapping):
        for k in tree:
            if "/" in str(k):
                raise ValueError(f"save_artifact: key {k!r} contains '/', which joins tree paths")
        return {str(k): _flatten(v, f"{prefix}{k}/", out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_flatten(v, f"{prefix}{i}/", out) for i, v in enumerate(tree)]
    name = prefix.rstrip("/")
    out[name] = np.asarray(tree, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    return name


def _unflatten(structure: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(structure, dict):
        return {k: _unflatten(v, arrays) for k, v in structure.items()}
    if isinstance(structure, list):
        return [_unflatten(v, arrays) for v in structure]
    return arrays[structure]


def json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def _header(path: pathlib.Path) -> Optional[dict]:
    """The safetensors ``__metadata__`` of a file, or None when it is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100 * 2**20 or n + 8 > path.stat().st_size:
                return None
            return json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _write_file(path: pathlib.Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """The safetensors format itself (bf16 included, which safetensors.numpy cannot write)."""
    entries, offset = {}, 0
    for name, a in arrays.items():
        if a.dtype.name not in _DTYPES:
            raise ValueError(f"save_artifact: array {name!r} has dtype {a.dtype}, not one safetensors stores")
        entries[name] = {
            "dtype": _DTYPES[a.dtype.name],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    head = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # tensor data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for a in arrays.values():
            f.write(np.asarray(a, order="C").astype(a.dtype.newbyteorder("<")).tobytes())
        f.flush()
        os.fsync(f.fileno())


def save(path: PathLike, tree: Any, meta: Optional[Mapping] = None) -> pathlib.Path:
    """Write ``tree`` (dicts / lists of arrays) and JSON ``meta`` as one safetensors file, atomically."""
    import jsteer
    from jsteer.checkpoints import SIDECAR, clean_stale

    path = pathlib.Path(path).expanduser().absolute()
    old_folder = path.is_dir()
    if old_folder and not (path / SIDECAR).is_file():
        raise FileExistsError(f"refusing to overwrite {path}: it is a folder and not a jsteer artifact")
    if path.is_file() and (_header(path) or {}).get("format") != FORMAT:
        raise FileExistsError(f"refusing to overwrite {path}: it is not a jsteer artifact")
    arrays: dict = {}
    structure = _flatten(tree, "", arrays)
    if not arrays:
        raise ValueError("save_artifact: the tree has no array leaves")
    try:
        meta_json = json.dumps(dict(meta or {}), default=json_default)
    except (TypeError, ValueError) as e:
        raise ValueError(f"save_artifact: meta is not JSON-serialisable ({e})") from None
    header = {
        "format": FORMAT,
        "jsteer": meta_json,
        "jsteer_tree": json.dumps(structure),
        "jsteer_version": jsteer.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_file(tmp, arrays, header)
        if old_folder:  # an artifact of the older Orbax format at this path: set aside, replaced, removed
            import shutil

            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load(path: PathLike) -> tuple[Any, dict]:
    """-> (tree of NumPy arrays, meta). A folder is read as the older Orbax artifact."""
    from jsteer.convert.hf import read_safetensors

    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        from jsteer.checkpoints import load_orbax_artifact

        return load_orbax_artifact(path)
    if not path.is_file():
        raise FileNotFoundError(f"artifact not found: {path}")
    header = _header(path)
    if header is None or header.get("format") != FORMAT:
        got = "not a safetensors file" if header is None else f"safetensors metadata format {header.get('format')!r}"
        raise ValueError(f"{path}: not a jsteer artifact ({got}, expected format {FORMAT!r})")
    try:
        meta, structure = json.loads(header["jsteer"]), json.loads(header["jsteer_tree"])
    except (KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: damaged jsteer artifact metadata ({e})") from None
    return _unflatten(structure, read_safetensors(path, widen=False)), meta


__all__ = ["save", "load", "FORMAT"]
