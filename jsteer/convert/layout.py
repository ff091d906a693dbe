"""One conversion idiom: a state dict (HF names) through a family's *layout* into a param tree.

A layout maps each source tensor name to an :class:`Entry`: the shape the source must have and
the param leaves made from it (a path in our tree and a host-side NumPy transform, e.g. a
transpose from torch's [out, in] to Flax's [in, out], or the split of a fused qkv tensor)::

    layout = {"model.embed_tokens.weight": entry(("embed", "embedding"), (V, D)),
              "model.layers.0.self_attn.q_proj.weight": entry((..., "kernel"), (Q, D), transpose)}
    params = apply_layout(state_dict, layout, dtype=jnp.bfloat16, source=path)

:func:`apply_layout` does every check once, for every family: all missing tensors and all
unexpected ones are reported before any tensor is read (each error names the source and the
tensor), then each tensor is read once, checked against its shape, transformed and cast on the
host, and handed to ``place(path, array)`` (default: ``jnp.asarray``) before the next one is
read. With a lazy state dict (tensors read on access) at most one source tensor is on the host
at a time, and with ``dtype=bfloat16`` no float32 copy of the model is ever made.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

Path = tuple[str, ...]
Transform = Optional[Callable[[np.ndarray], np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One source tensor: its required ``shape`` and the ``outputs`` made from it, each a
    (param path, host transform or None). ``optional``: an absent tensor is skipped (e.g. an
    ``lm_head.weight`` that some tied checkpoints store and others omit)."""

    shape: tuple[int, ...]
    outputs: tuple[tuple[Path, Transform], ...]
    optional: bool = False


def entry(path: Path, shape: Sequence[int], fn: Transform = None, optional: bool = False) -> Entry:
    """The common case: one source tensor -> one param leaf."""
    return Entry(tuple(int(s) for s in shape), ((tuple(path), fn),), optional)


def transpose(x: np.ndarray) -> np.ndarray:
    """torch Linear [out, in] -> Flax Dense kernel [in, out]."""
    return x.T


def split(index: int, parts: int, axis: int = 0, then: Transform = None) -> Callable[[np.ndarray], np.ndarray]:
    """Piece ``index`` of ``parts`` equal pieces along ``axis`` (fused projections), then ``then``."""
    def f(x: np.ndarray) -> np.ndarray:
        y = np.split(x, parts, axis=axis)[index]
        return then(y) if then is not None else y
    return f


def cut(start: int, stop: int, axis: int = 0, then: Transform = None) -> Callable[[np.ndarray], np.ndarray]:
    """Rows ``start:stop`` along ``axis`` (fused projections of unequal widths), then ``then``."""
    def f(x: np.ndarray) -> np.ndarray:
        y = np.take(x, np.arange(start, stop), axis=axis)
        return then(y) if then is not None else y
    return f


class RenamedView(Mapping):
    """A read-through view of ``state_dict`` under new names ``rename(name)``: checkpoints saved
    from a bare base model name their tensors without the causal-LM class's ``model.`` prefix,
    and a family's head may have had another name in older transformers. Reads stay lazy."""

    def __init__(self, state_dict: Mapping[str, Any], rename: Callable[[str], str]):
        self._sd = state_dict
        self._names = {rename(k): k for k in state_dict}

    def __getitem__(self, name: str):
        return self._sd[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name) -> bool:
        return name in self._names


def _host_cast(x: np.ndarray, dtype) -> np.ndarray:
    if dtype is None or not np.issubdtype(x.dtype, np.floating) and x.dtype.name != "bfloat16":
        return x
    return x.astype(dtype, copy=False)


def _set(tree: dict, path: Path, value) -> None:
    node = tree
    for p in path[:-1]:
        node = node.setdefault(p, {})
    if path[-1] in node:
        raise ValueError(f"layout writes param {'/'.join(path)} twice")
    node[path[-1]] = value


def check_names(state_dict: Mapping[str, Any], layout: Mapping[str, Entry], *, ignore: Sequence[str] = (),
                source: Any = "state dict") -> None:
    """Raise ValueError naming ``source`` and the tensors when a required tensor is missing or a
    tensor matches neither the layout nor an ``ignore`` glob pattern."""
    missing = [n for n, e in layout.items() if not e.optional and n not in state_dict]
    if missing:
        raise ValueError(f"{source}: missing tensor {missing[0]!r} (expected shape {layout[missing[0]].shape})"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    extra = sorted(k for k in state_dict if k not in layout and not any(fnmatch.fnmatchcase(k, p) for p in ignore))
    if extra:
        raise ValueError(f"{source}: {len(extra)} unexpected tensor(s) for this config, e.g. {extra[:4]} "
                         f"(does config.json match the weights?)")


def apply_layout(state_dict: Mapping[str, Any], layout: Mapping[str, Entry], *, dtype: Any = None,
                 place: Optional[Callable[[Path, np.ndarray], Any]] = None, ignore: Sequence[str] = (),
                 source: Any = "state dict") -> dict:
    """Build a nested param dict from ``state_dict`` through ``layout`` (module docstring).

    dtype: floating leaves are cast to it on the host (None: as read). place(path, array) ->
    leaf: where each leaf goes (default ``jnp.asarray``: the default device). ignore: glob
    patterns of source tensors that are expected and unused (buffers such as
    ``*.rotary_emb.inv_freq``). Errors name ``source`` (a path or a description).
    """
    import jax.numpy as jnp

    check_names(state_dict, layout, ignore=ignore, source=source)
    place = place or (lambda path, x: jnp.asarray(x))
    params: dict = {}
    for name, e in layout.items():
        if name not in state_dict or not e.outputs:
            continue  # optional and absent, or expected and unused
        x = np.asarray(state_dict[name])
        if tuple(x.shape) != e.shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, expected {e.shape} "
                             f"(does config.json match the weights?)")
        for path, fn in e.outputs:
            y = _host_cast(np.ascontiguousarray(fn(x) if fn is not None else x), dtype)
            _set(params, path, place(path, y))
        del x
    return params


def flatten_paths(tree: Mapping, prefix: Path = ()) -> dict[Path, Any]:
    """Nested dict -> {path: leaf}."""
    out: dict[Path, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten_paths(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


__all__ = ["Entry", "entry", "transpose", "split", "cut", "RenamedView", "apply_layout", "check_names",
           "flatten_paths"]
