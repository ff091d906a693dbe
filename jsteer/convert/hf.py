"""Read a HuggingFace checkpoint folder into NumPy arrays (no torch needed for safetensors).

A folder holds ``config.json`` plus one of, in order of preference:

- ``model.safetensors``
- ``model.safetensors.index.json`` + the shards its ``weight_map`` names
- ``pytorch_model.bin`` (torch imported lazily, ``weights_only=True``)
- ``pytorch_model.bin.index.json`` + its shards

Safetensors files are parsed here directly (8-byte little-endian header length, JSON header,
raw little-endian data), so bf16 works without torch and a truncated file is caught with the
file named.

Two ways in:

- :func:`open_hf_dir` -> (config, state): for safetensors a lazy :class:`SafetensorsState` whose
  names, dtypes and shapes come from the headers alone and whose ``state[name]`` reads that one
  tensor from disk into a fresh array, in its stored dtype (bf16 as ``ml_dtypes.bfloat16``,
  fp16 as float16), and whose :meth:`SafetensorsState.view` maps it read-only instead (no copy:
  for a reader that copies what it takes). Fed to :func:`jsteer.convert.layout.apply_layout`,
  only the few source tensors being converted at once are on the host. ``.bin`` checkpoints are
  read eagerly (torch unpickles whole files).
- :func:`read_hf_dir` -> (config, dict): everything read, half precision widened to float32.

Arrays are read as little-endian (the format's byte order, and every host JAX runs on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import struct
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

PathLike = str | os.PathLike

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHT_NAMES = (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, BIN_NAME, BIN_INDEX_NAME)

# model_type -> backbone family (the decoder types: jsteer.backbones.families.MODEL_TYPES)
FAMILIES = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "camembert": "bert",
    **{
        t: "decoder"
        for t in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox", "gpt2")
    },
}

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

_HEADER_LIMIT = 100 * 1024 * 1024  # the safetensors format caps the JSON header at 100 MB
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_PAGE = 4096
_OWN_MAPPING = 1 << 20  # bytes from which a read buffer is its own anonymous mapping


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns [...] -> float32 [...] (exact: bf16 is truncated fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one safetensors tensor lives: ``file``, dtype name (``"BF16"``), ``shape``, and its
    bytes ``[start, start + nbytes)`` counted from the start of the file."""

    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_safetensors_header(path: PathLike) -> dict[str, TensorInfo]:
    """One ``.safetensors`` file's header -> {name: TensorInfo}; no tensor data is read. Raises
    ValueError naming the file (and the tensor) when the header is malformed, a tensor's byte
    range leaves the file (truncated?), or a dtype is unsupported."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes, truncated?)")
        (n_header,) = struct.unpack("<Q", head)
        if n_header > _HEADER_LIMIT or 8 + n_header > size:
            raise ValueError(
                f"{path}: corrupt or truncated safetensors file (header claims {n_header} bytes, file has {size})"
            )
        raw = f.read(n_header)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)

    data_start = 8 + n_header
    data_size = size - data_start
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name!r}: {info}") from None
        if dtype_name not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name}")
        n_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype_name]).itemsize
        if not (0 <= begin <= end <= data_size) or end - begin != n_bytes:
            raise ValueError(
                f"{path}: corrupt or truncated safetensors file: tensor {name!r} {dtype_name}"
                f"{list(shape)} needs bytes [{begin}, {end}) ({n_bytes} expected) of a "
                f"{data_size}-byte data section"
            )
        out[name] = TensorInfo(path, dtype_name, shape, data_start + begin, n_bytes)
    return out


def _aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a page boundary: on CPU, ``jax.device_put`` adopts such a buffer
    as the device array instead of copying it (a second copy costs time and peak memory). From
    1 MiB up, the buffer is its own anonymous mapping: unmapped as soon as it is dropped, faulted in
    at once by the kernel (MAP_POPULATE: ~1.5x faster than page by page), and not madvised for
    transparent huge pages as NumPy's large allocations are (where huge pages must first be
    compacted, faulting those in cost ~3x the read itself)."""
    if nbytes >= _OWN_MAPPING:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
    raw = np.empty(nbytes + _PAGE, np.uint8)
    start = -raw.ctypes.data % _PAGE
    return raw[start : start + nbytes]


def read_tensor(
    name: str, info: TensorInfo, widen: bool = False, alloc: Callable[[int], np.ndarray] = _aligned_empty
) -> np.ndarray:
    """Read one tensor into ``alloc(nbytes)`` (uint8 [nbytes]; default a fresh page-aligned
    buffer) as its stored dtype (``widen``: fp16 / bf16 -> a new float32 array). Raises
    ValueError naming the file and tensor if the file has shrunk since its header was read."""
    buf = alloc(info.nbytes)
    try:
        with open(info.file, "rb") as f:
            f.seek(info.start)
            got = f.readinto(memoryview(buf)) if info.nbytes else 0
    except FileNotFoundError:
        raise FileNotFoundError(f"{info.file}: file disappeared before tensor {name!r} was read") from None
    if got != info.nbytes:
        raise ValueError(
            f"{info.file}: truncated safetensors file: tensor {name!r} needs {info.nbytes} bytes "
            f"at offset {info.start}, only {got} could be read"
        )
    arr = buf.view(_ST_DTYPES[info.dtype]).reshape(info.shape)
    return arr.astype(np.float32) if widen and arr.dtype in _HALF else arr


_MAP_FLAGS = (
    dict(flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    if hasattr(mmap, "MAP_SHARED")
    else dict(access=mmap.ACCESS_READ)
)


def map_tensor(name: str, info: TensorInfo) -> np.ndarray:
    """One tensor as a read-only array over a memory map of just its pages (mapped at once: a
    file in the page cache costs no read and no copy; unmapped when the array and every view of it
    are dropped). Its values are the file's for as long as it lives: take a copy of what must
    outlive the read (and a file truncated while the copy runs ends the process with SIGBUS, as
    with any memory map). Raises as :func:`read_tensor` if the file no longer holds the tensor."""
    dtype = np.dtype(_ST_DTYPES[info.dtype])
    if info.nbytes == 0:
        return np.empty(info.shape, dtype)
    start = info.start - info.start % mmap.ALLOCATIONGRANULARITY
    try:
        with open(info.file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < info.start + info.nbytes:
                raise ValueError(
                    f"{info.file}: truncated safetensors file: tensor {name!r} needs {info.nbytes} bytes "
                    f"at offset {info.start}, only {max(0, size - info.start)} could be read"
                )
            m = mmap.mmap(f.fileno(), info.start + info.nbytes - start, offset=start, **_MAP_FLAGS)
    except FileNotFoundError:
        raise FileNotFoundError(f"{info.file}: file disappeared before tensor {name!r} was read") from None
    return np.frombuffer(m, dtype, count=info.nbytes // dtype.itemsize, offset=info.start - start).reshape(info.shape)


class SafetensorsState(Mapping):
    """Lazy state dict over safetensors files: ``{name: array}`` whose keys (and :meth:`info`)
    come from the headers, and whose ``[name]`` reads that tensor from disk on each access
    (nothing is cached) into a fresh array no one else holds, and whose :meth:`view` maps it
    read-only instead (the reader protocol of :func:`jsteer.convert.layout.apply_layout`).
    ``widen``: fp16 / bf16 come back as float32."""

    def __init__(self, infos: Mapping[str, TensorInfo], widen: bool = False):
        self._infos, self.widen = dict(infos), widen

    def view(self, name: str) -> np.ndarray:
        """Tensor ``name`` read-only over a memory map of its file (:func:`map_tensor`; no copy), or
        with ``widen`` a fresh float32 array made from it."""
        x = map_tensor(name, self._infos[name])
        return x.astype(np.float32) if self.widen and x.dtype in _HALF else x

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    @property
    def files(self) -> list[pathlib.Path]:
        return list(dict.fromkeys(i.file for i in self._infos.values()))

    def __getitem__(self, name: str) -> np.ndarray:
        return read_tensor(name, self._infos[name], self.widen)

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __repr__(self) -> str:
        return f"SafetensorsState({len(self)} tensors in {len(self.files)} file(s))"


def read_safetensors(path: PathLike, widen: bool = True) -> dict[str, np.ndarray]:
    """One ``.safetensors`` file -> {name: array}, every tensor read (``widen``: half precision
    as float32). Errors as :func:`read_safetensors_header`."""
    return dict(SafetensorsState(read_safetensors_header(path), widen))


# ----------------------------------------------------------------------------- torch .bin


def read_torch_bin(path: PathLike, widen: bool = True) -> dict[str, np.ndarray]:
    """One ``pytorch_model.bin`` -> {name: array}, loaded with ``weights_only=True``
    (``widen``: half precision as float32, else fp16 / ``ml_dtypes.bfloat16`` as stored)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pytorch weights file not found: {path}")
    import torch  # lazy: only .bin checkpoints need torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise ValueError(f"{path}: cannot load pytorch weights ({type(e).__name__}: {e})") from None
    if not isinstance(sd, Mapping):
        raise ValueError(f"{path}: expected a state dict (name -> tensor), got {type(sd).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach()
        if widen and t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        if t.dtype == torch.bfloat16:  # numpy has no bf16: hand over the bits
            out[name] = np.array(t.view(torch.int16).numpy(), copy=True).view(ml_dtypes.bfloat16)
        else:
            out[name] = np.array(t.numpy(), copy=True)
    return out


# ----------------------------------------------------------------------------- folders


def _check_dir(path: PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"not a checkpoint folder (it is a file): {path}")
    return path


def read_config(path: PathLike) -> dict:
    """``<path>/config.json`` -> dict."""
    path = _check_dir(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: missing config.json in checkpoint folder {path}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _read_index(index_path: pathlib.Path) -> dict[str, list[str]]:
    """Shard index -> {shard file name: [tensor names]} (shards in first-seen order)."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path}: invalid shard index ({type(e).__name__}: {e})") from None
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    return shards


def _locate(path: pathlib.Path) -> tuple[list[pathlib.Path], pathlib.Path | None, dict]:
    """-> (weight files, shard index or None, {shard name: [tensor names]})."""
    for name in WEIGHT_NAMES:
        f = path / name
        if not f.is_file():
            continue
        if not name.endswith(".index.json"):
            return [f], None, {}
        shard_map = _read_index(f)
        shards = [path / s for s in shard_map]
        for s in shards:
            if not s.is_file():
                raise FileNotFoundError(f"shard {s.name} listed in {f} is missing: {s}")
        return shards, f, shard_map
    raise FileNotFoundError(f"no weights file in checkpoint folder {path}: looked for {', '.join(WEIGHT_NAMES)}")


def find_weight_files(path: PathLike) -> list[pathlib.Path]:
    """The weight files ``read_hf_dir`` would read (the shards themselves for an index)."""
    return _locate(_check_dir(path))[0]


def _check_shard(
    f: pathlib.Path, names: Iterable[str], index: pathlib.Path | None, shard_map: dict, seen: Mapping
) -> None:
    """A shard must hold every tensor its index lists for it, and none an earlier shard holds."""
    names = set(names)
    if index is not None:
        missing = set(shard_map[f.name]) - names
        if missing:
            raise ValueError(f"{f}: tensor {sorted(missing)[0]!r} listed for it in {index.name} is absent")
    dup = names & seen.keys()
    if dup:
        raise ValueError(f"{f}: tensor {sorted(dup)[0]!r} also appears in an earlier shard")


def open_hf_dir(path: PathLike, widen: bool = False) -> tuple[dict, Mapping[str, np.ndarray]]:
    """HF checkpoint folder -> (config dict, state dict) without reading safetensors data.

    Safetensors: a :class:`SafetensorsState` (every header read and checked: a missing shard, a
    truncated file or a tensor absent from the shard its index names raise here, naming the file
    and tensor). ``.bin``: a dict, read now. Half precision stays as stored unless ``widen``.
    """
    path = _check_dir(path)
    config = read_config(path)
    files, index, shard_map = _locate(path)
    if files[0].suffix == ".safetensors":
        infos: dict[str, TensorInfo] = {}
        for f in files:
            part = read_safetensors_header(f)
            _check_shard(f, part, index, shard_map, infos)
            infos.update(part)
        return config, SafetensorsState(infos, widen)
    state: dict[str, np.ndarray] = {}
    for f in files:
        part = read_torch_bin(f, widen)
        _check_shard(f, part, index, shard_map, state)
        state.update(part)
    return config, state


def read_hf_dir(path: PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """HF checkpoint folder -> (config dict, {tensor name: np.ndarray}), every tensor read.

    Half-precision tensors are widened to float32; names are kept exactly as stored.
    """
    config, state = open_hf_dir(path, widen=True)
    return config, dict(state)


# ----------------------------------------------------------------------------- provenance


def file_sha256(path: PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def dir_fingerprint(paths: Iterable[PathLike]) -> str:
    """Hex sha256 identifying a set of weight files.

    One file: its own sha256 (so a single safetensors/GGUF file and its folder agree).
    Several (shards): sha256 over the per-file digests in file-name order, one per line.
    """
    paths = sorted((pathlib.Path(p) for p in paths), key=lambda p: p.name)
    if not paths:
        raise ValueError("dir_fingerprint needs at least one weight file")
    if len(paths) == 1:
        return file_sha256(paths[0])
    h = hashlib.sha256()
    for p in paths:
        h.update((file_sha256(p) + "\n").encode("ascii"))
    return h.hexdigest()


def detect_family(config: Mapping, source: PathLike | None = None) -> str:
    """HF config dict -> "bert" | "decoder" from its ``model_type``."""
    where = f"{source}" if source is not None else "config.json"
    if "jsteer_decoder" in config:  # DecoderConfig.to_dict()
        return "decoder"
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"{where}: config has no model_type; cannot tell the architecture")
    family = FAMILIES.get(str(model_type).lower())
    if family is None:
        raise ValueError(f"{where}: unsupported model_type {model_type!r} (supported: {', '.join(sorted(FAMILIES))})")
    return family


__all__: Sequence[str] = (
    "read_hf_dir",
    "open_hf_dir",
    "read_config",
    "find_weight_files",
    "read_safetensors",
    "read_torch_bin",
    "read_safetensors_header",
    "read_tensor",
    "map_tensor",
    "SafetensorsState",
    "TensorInfo",
    "file_sha256",
    "dir_fingerprint",
    "detect_family",
    "bf16_bits_to_f32",
    "FAMILIES",
)
