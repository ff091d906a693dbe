"""One conversion idiom: a state dict (HF names) through a family's *layout* into a param tree.

A layout maps each source tensor name to an :class:`Entry`: the shape the source must have and
the param leaves made from it (a path in our tree and a transform, e.g. a transpose from torch's
[out, in] to Flax's [in, out], or the split of a fused qkv tensor)::

    layout = {"model.embed_tokens.weight": entry(("embed", "embedding"), (V, D)),
              "model.layers.0.self_attn.q_proj.weight": entry((..., "kernel"), (Q, D), transpose)}
    params = apply_layout(state_dict, layout, dtype=jnp.bfloat16, source=path)

Transforms only move data (transpose, reshape, basic slicing) and return NumPy *views* of the
source: no host copy is made, and ``jax.device_put`` copies the strided view into the device
buffer in one cache-blocked pass of the runtime (XLA's transpose routine: 2.2-4 GB/s here against
0.3 GB/s for NumPy's ``ascontiguousarray(x.T)``, and no per-shape compilation as a jitted
transform would need). A transform that returns a copy still works; it costs a host pass.

:func:`apply_layout` does every check once, for every family: all missing tensors and all
unexpected ones are reported before any tensor is read (each error names the source and the
tensor), then each tensor is read once, checked against its shape, cast on the host, and its
leaves are placed (default: ``jax.device_put``) before the next one is read. With a lazy state
dict (tensors read on access) at most one source tensor is on the host at a time, and with
``dtype=bfloat16`` no float32 copy of the model is ever made.

A state dict may be a *reader* (the safetensors one is): ``read_into(name, alloc)`` reads tensor
``name`` into ``alloc(nbytes)`` (a uint8 buffer of the caller's) and returns it as a typed array,
and each ``[name]`` is a fresh array that nothing else holds. From a reader, a tensor whose
leaves are all transforms of it is read into one buffer reused for the next such tensor (no
fresh pages to fault in for a buffer dropped right after), and a leaf that needs no transform is
the read buffer itself on CPU (``device_put`` adopts an aligned NumPy buffer without a copy).
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
    (param path, transform or None; a transform returns a view where it can, module docstring).
    ``optional``: an absent tensor is skipped (e.g. an ``lm_head.weight`` that some tied
    checkpoints store and others omit)."""

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
        y = x[(slice(None),) * axis + (slice(start, stop),)]
        return then(y) if then is not None else y

    return f


class RenamedView(Mapping):
    """A read-through view of ``state_dict`` under new names ``rename(name)``: checkpoints saved
    from a bare base model name their tensors without the causal-LM class's ``model.`` prefix,
    and a family's head may have had another name in older transformers. Reads stay lazy."""

    def __init__(self, state_dict: Mapping[str, Any], rename: Callable[[str], str]):
        self._sd = state_dict
        self._names = {rename(k): k for k in state_dict}
        if hasattr(state_dict, "read_into"):  # a reader stays one (module docstring)
            self.read_into = lambda name, alloc: state_dict.read_into(self._names[name], alloc)

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


def check_names(
    state_dict: Mapping[str, Any],
    layout: Mapping[str, Entry],
    *,
    ignore: Sequence[str] = (),
    source: Any = "state dict",
) -> None:
    """Raise ValueError naming ``source`` and the tensors when a required tensor is missing or a
    tensor matches neither the layout nor an ``ignore`` glob pattern."""
    missing = [n for n, e in layout.items() if not e.optional and n not in state_dict]
    if missing:
        raise ValueError(
            f"{source}: missing tensor {missing[0]!r} (expected shape {layout[missing[0]].shape})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    extra = sorted(k for k in state_dict if k not in layout and not any(fnmatch.fnmatchcase(k, p) for p in ignore))
    if extra:
        raise ValueError(
            f"{source}: {len(extra)} unexpected tensor(s) for this config, e.g. {extra[:4]} "
            f"(does config.json match the weights?)"
        )


class _Scratch:
    """The reused read buffer (uint8, grown to the largest request): handed out again only once the
    runtime has finished copying out of it into the leaves made from the last tensor."""

    def __init__(self):
        self.buf, self.users = np.empty(0, np.uint8), []

    def __call__(self, nbytes: int) -> np.ndarray:
        import jax

        jax.block_until_ready(self.users)
        self.users = []
        if self.buf.size < nbytes:
            self.buf = np.empty(0, np.uint8)  # drop the old one first
            self.buf = np.empty(nbytes, np.uint8)
        return self.buf[:nbytes]


def apply_layout(
    state_dict: Mapping[str, Any],
    layout: Mapping[str, Entry],
    *,
    dtype: Any = None,
    place: Optional[Callable[[Path, np.ndarray], Any]] = None,
    ignore: Sequence[str] = (),
    source: Any = "state dict",
) -> dict:
    """Build a nested param dict from ``state_dict`` through ``layout`` (module docstring).

    dtype: floating tensors are cast to it on the host, once per source tensor, before the
    transforms (None: as read). place(path, array) -> leaf: where each leaf goes; ``array`` may be
    a strided view of the source (a transpose), which ``jax.device_put`` copies in one pass.
    Default: ``jax.device_put`` onto the default device, sharing the source's memory on CPU only
    when the state dict is a reader (module docstring); a reader's read buffer is reused only
    with this default. ignore: glob patterns of source tensors that are expected and unused
    (buffers such as ``*.rotary_emb.inv_freq``). Errors name ``source`` (a path or a description).
    """
    import jax

    check_names(state_dict, layout, ignore=ignore, source=source)
    read_into = getattr(state_dict, "read_into", None)
    scratch = _Scratch()
    params: dict = {}
    for name, e in layout.items():
        if name not in state_dict or not e.outputs:
            continue  # optional and absent, or expected and unused
        reuse = place is None and read_into is not None and all(fn is not None for _, fn in e.outputs)
        read = np.asarray(read_into(name, scratch) if reuse else state_dict[name])
        if tuple(read.shape) != e.shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(read.shape)}, expected {e.shape} "
                f"(does config.json match the weights?)"
            )
        x = _host_cast(read, dtype)
        # on CPU device_put adopts an aligned contiguous buffer as is: copy one that is reused or the caller's
        shared = x is read and (reuse or read_into is None)
        for path, fn in e.outputs:
            y = fn(x) if fn is not None else x
            if place is not None:
                leaf = place(path, y)
            else:
                leaf = jax.device_put(y.copy() if shared and y.flags.c_contiguous else y)
                if reuse:
                    scratch.users.append(leaf)
            _set(params, path, leaf)
        del read, x
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


__all__ = ["Entry", "entry", "transpose", "split", "cut", "RenamedView", "apply_layout", "check_names", "flatten_paths"]
