"""The :class:`ControlVector`: per-layer residual-stream directions and what they belong to.

A control vector is a pytree ``{layer: direction [D]}`` (0-based layers of ``resid_post``, the
residual stream after that layer, HF's ``hidden_states[layer + 1]``) plus metadata: the base
model's identity (:attr:`jsteer.lm.LM.identity`), its hidden size D and ``model_type``, the
method that made it and its recipe. :meth:`ControlVector.hooks` turns it into one
:class:`jsteer.interventions.Add` per layer; the strength is traced, so changing it never
recompiles.

Portable file (:meth:`ControlVector.save`): one ``.safetensors`` file with a float32 tensor
``direction.<layer>`` [D] per layer and string metadata, readable without jsteer::

    format       "jsteer.controlvector/1"
    base_model   "sha256:..."            (LM.identity)
    model_type   "llama"                 (also written to GGUF as controlvector.model_hint)
    method       "caa" | "pca" | "actadd" | "gguf" (read from a GGUF without jsteer metadata)
    hidden_size  "576"                   (decimal)
    layers       "[10, 12]"              (JSON list)
    recipe       "{...}"                 (JSON object: how the directions were computed)

llama.cpp / repeng GGUF files: :meth:`ControlVector.export_gguf` / :meth:`ControlVector.from_gguf`
(:mod:`jsteer.actsteer.llamacpp`, which documents the layer numbering).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.hooks import Hooks
from jsteer.interventions import Add

FORMAT = "jsteer.controlvector/1"
TENSOR = re.compile(r"^direction\.(\d+)$")
META_KEYS = ("format", "base_model", "model_type", "method", "hidden_size", "layers", "recipe")


class WrongModelError(ValueError):
    """A control vector was applied to a model it was not computed on (identity or hidden size)."""


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class ControlVector:
    """``directions`` {layer: [D] float32}; metadata as in the module docstring. Build one with
    :func:`jsteer.actsteer.train`, :meth:`load` or :meth:`from_gguf`."""

    directions: Mapping[int, Any]
    base_model: Optional[str]
    hidden_size: int
    method: str
    model_type: Optional[str] = None
    recipe: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.directions:
            raise ValueError("ControlVector: no directions (one [D] vector per layer is needed)")
        for layer, vec in self.directions.items():
            if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) or layer < 0:
                raise ValueError(f"ControlVector: layer key {layer!r} must be a 0-based int layer index")
            if tuple(np.shape(vec)) != (self.hidden_size,):
                raise ValueError(
                    f"ControlVector: direction.{layer} has shape {tuple(np.shape(vec))}, "
                    f"expected ({self.hidden_size},) (the hidden size)"
                )

    # ------------------------------------------------------------------ pytree

    def tree_flatten(self):
        layers = self.layers
        aux = (
            layers,
            self.base_model,
            self.hidden_size,
            self.method,
            self.model_type,
            json.dumps(self.recipe, sort_keys=True),
        )  # hashable, as jit's cache keys need
        return tuple(self.directions[k] for k in layers), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        layers, base, hidden, method, model_type, recipe = aux
        obj = object.__new__(cls)  # no __post_init__ checks: jax unflattens with placeholder leaves too
        for name, value in (
            ("directions", dict(zip(layers, children))),
            ("base_model", base),
            ("hidden_size", hidden),
            ("method", method),
            ("model_type", model_type),
            ("recipe", json.loads(recipe)),
        ):
            object.__setattr__(obj, name, value)
        return obj

    # ------------------------------------------------------------------ use

    @property
    def layers(self) -> tuple:
        return tuple(sorted(int(k) for k in self.directions))

    def hooks(self, strength: Any = 1.0) -> Hooks:
        """Hooks adding ``strength * direction[l]`` to ``resid_post.l`` for every layer l, at every
        position (prompt and generated tokens). ``strength``: a scalar or [B] (one per row),
        traced: every nonzero value shares one compiled forward / generate loop.

        A concrete strength of 0 (every row) gives empty hooks, i.e. the unsteered program: adding
        0 x direction computes the same values, but XLA fuses the extra add with its neighbours
        differently, which moves logits by ~1e-7 relative; the empty hooks are bit-identical to
        none."""
        s = jnp.asarray(strength, jnp.float32)
        if s.ndim > 1:
            raise ValueError(f"ControlVector.hooks: strength must be a scalar or [B], got shape {s.shape}")
        if not isinstance(s, jax.core.Tracer) and not np.asarray(s).any():
            return Hooks()
        return Hooks(
            interventions={
                f"resid_post.{k}": Add(vec=jnp.asarray(self.directions[k], jnp.float32), strength=s)
                for k in self.layers
            }
        )

    def select(self, layers) -> "ControlVector":
        """This vector at some of its layers only (e.g. to compare layers after one extraction)."""
        layers = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
        missing = [k for k in layers if k not in self.directions]
        if missing or not layers:
            raise ValueError(
                f"select: layer {missing[0] if missing else None} is not in this vector (layers {list(self.layers)})"
            )
        return dataclasses.replace(
            self, directions={k: self.directions[k] for k in layers}, recipe={**self.recipe, "layers": sorted(layers)}
        )

    def check(self, lm, where: str = "control vector") -> "ControlVector":
        """Raise :class:`WrongModelError` unless this vector fits ``lm``: same identity (when the
        vector records one), same hidden size, every layer in range. Returns self."""
        hidden, n_layers = lm.config.hidden_size, lm.config.num_layers
        if self.hidden_size != hidden:
            raise WrongModelError(
                f"{where}: its directions have hidden size {self.hidden_size}, the model {lm.identity} has {hidden}"
            )
        if self.base_model is not None and self.base_model != lm.identity:
            raise WrongModelError(
                f"{where}: it was computed on base model {self.base_model}, but the model is "
                f"{lm.identity}; directions do not carry over between models"
            )
        bad = [k for k in self.layers if k >= n_layers]
        if bad:
            raise WrongModelError(
                f"{where}: layer {bad[0]} is out of range (the model has {n_layers} layers: 0..{n_layers - 1})"
            )
        return self

    def numpy(self) -> dict:
        """{layer: np.float32 [D]}."""
        return {k: np.asarray(self.directions[k], np.float32) for k in self.layers}

    def metadata(self) -> dict:
        """The file metadata (all strings; see the module docstring)."""
        return {
            "format": FORMAT,
            "base_model": self.base_model or "",
            "model_type": self.model_type or "",
            "method": self.method,
            "hidden_size": str(self.hidden_size),
            "layers": json.dumps(list(self.layers)),
            "recipe": json.dumps(self.recipe, sort_keys=True),
        }

    @classmethod
    def from_metadata(cls, directions: Mapping[int, Any], meta: Mapping[str, str], where: str) -> "ControlVector":
        """Inverse of :meth:`metadata`, checking every field against the tensors."""
        missing = [k for k in META_KEYS if k not in meta]
        if missing:
            raise ValueError(
                f"{where}: metadata field {missing[0]!r} is missing (a jsteer control vector has "
                f"{', '.join(META_KEYS)})"
            )
        if meta["format"] != FORMAT:
            raise ValueError(f"{where}: metadata format is {meta['format']!r}, expected {FORMAT!r}")
        try:
            hidden, layers, recipe = int(meta["hidden_size"]), json.loads(meta["layers"]), json.loads(meta["recipe"])
        except ValueError as e:
            raise ValueError(f"{where}: unreadable metadata hidden_size / layers / recipe ({e})") from None
        if sorted(layers) != sorted(directions):
            raise ValueError(f"{where}: metadata layers {layers} but tensors for layers {sorted(directions)}")
        return cls(
            dict(directions), meta["base_model"] or None, hidden, meta["method"], meta["model_type"] or None, recipe
        )

    # ------------------------------------------------------------------ files

    def save(self, path) -> pathlib.Path:
        """Write one ``.safetensors`` file (module docstring), atomically."""
        from safetensors.numpy import save_file

        path = pathlib.Path(path)
        tensors = {f"direction.{k}": v for k, v in self.numpy().items()}
        return _atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=self.metadata()))

    @classmethod
    def load(cls, path, lm=None) -> "ControlVector":
        """Read a file written by :meth:`save`; with ``lm``, check it fits (:meth:`check`)."""
        from safetensors import SafetensorError, safe_open

        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such control-vector file")
        try:
            with safe_open(str(path), "np") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        cv = cls.from_metadata(directions_from_tensors(tensors, str(path)), meta, str(path))
        return cv if lm is None else cv.check(lm, str(path))

    def export_gguf(self, path) -> pathlib.Path:
        """Write llama.cpp's control-vector GGUF (see :mod:`jsteer.actsteer.llamacpp`)."""
        from jsteer.actsteer import llamacpp

        return llamacpp.write(self, path)

    @classmethod
    def from_gguf(cls, path, lm=None) -> "ControlVector":
        """Read a llama.cpp / repeng control-vector GGUF; with ``lm``, check it fits."""
        from jsteer.actsteer import llamacpp

        cv = llamacpp.read(path, cls)
        return cv if lm is None else cv.check(lm, str(path))

    def __repr__(self) -> str:
        return (
            f"ControlVector(method={self.method!r}, layers={list(self.layers)}, hidden_size={self.hidden_size}, "
            f"base_model={self.base_model!r})"
        )


def directions_from_tensors(tensors: Mapping[str, Any], where: str) -> dict:
    """{"direction.<layer>": [D]} -> {layer: float32 [D]}; any other name or rank is an error."""
    out = {}
    for name, t in tensors.items():
        m = TENSOR.match(name)
        if m is None:
            raise ValueError(
                f"{where}: tensor {name!r} is not a control-vector direction (expected names 'direction.<layer>')"
            )
        if np.ndim(t) != 1:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(np.shape(t))}; a direction is 1-D [D]")
        layer = int(m.group(1))
        if layer in out:
            raise ValueError(f"{where}: layer {layer} has two tensors")
        out[layer] = np.asarray(t, np.float32)
    if not out:
        raise ValueError(f"{where}: no 'direction.<layer>' tensors")
    return out


def _atomic(path: pathlib.Path, write) -> pathlib.Path:
    """``write(tmp)`` beside ``path``, then renamed over it: a failed write leaves no partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
