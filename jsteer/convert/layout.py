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
leaves are placed (default: ``jax.device_put``). A few tensors are converted at once, one per
worker thread (reading, the runtime's copies and the kernel's page faults all run outside the
GIL), and the params are assembled in layout order, so the tree and the first error raised are
those of a one-at-a-time load. With a lazy state dict (tensors read on access) only those few
source tensors are on the host at a time, and with ``dtype=bfloat16`` no float32 copy of the
model is ever made.

A state dict may be a *reader* (the safetensors one is): ``view(name)`` gives tensor ``name``
read-only over a memory map of its file (no read, no copy when the file is in the page cache),
and each ``[name]`` is a fresh array that nothing else holds. From a reader, a tensor whose
leaves are all transforms of it is taken as such a view (``device_put`` copies it into the
leaves, and the mapping is dropped once they are placed), and a leaf that needs no transform is
a fresh read that becomes the param itself on CPU (``device_put`` adopts an aligned NumPy buffer
without a copy). No param ever shares memory with the file: a leaf that would (a contiguous
transform of a view) is copied first, so rewriting or deleting the checkpoint cannot change a
loaded model. (Adopting the mapped file as params, as transformers does, is not possible in
general: XLA:CPU adopts only 64-byte-aligned buffers, and safetensors aligns tensors to 8 bytes.)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from concurrent.futures import ThreadPoolExecutor
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
        if hasattr(state_dict, "view"):  # a reader stays one (module docstring)
            self.view = lambda name: state_dict.view(self._names[name])

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


def load_threads() -> int:
    """Worker threads :func:`apply_layout` uses by default: the CPUs this process may run on, at
    most 4 (each holds one tensor in flight; more only adds host memory)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def apply_layout(
    state_dict: Mapping[str, Any],
    layout: Mapping[str, Entry],
    *,
    dtype: Any = None,
    place: Optional[Callable[[Path, np.ndarray], Any]] = None,
    ignore: Sequence[str] = (),
    source: Any = "state dict",
    threads: Optional[int] = None,
) -> dict:
    """Build a nested param dict from ``state_dict`` through ``layout`` (module docstring).

    dtype: floating tensors are cast to it on the host, once per source tensor, before the
    transforms (None: as read). place(path, array) -> leaf: where each leaf goes; ``array`` may be
    a strided view of the source (a transpose), which ``jax.device_put`` copies in one pass; it is
    called from worker threads. Default: ``jax.device_put`` onto the default device (the calling
    thread's), sharing memory with the source only where it is a fresh read (module docstring).
    ignore: glob patterns of source tensors that are expected and unused (buffers such as
    ``*.rotary_emb.inv_freq``). threads: tensors converted at once (default :func:`load_threads`;
    1: one after another in the calling thread). Errors name ``source`` (a path or a description);
    the first failing tensor in layout order is the one reported.
    """
    import jax

    check_names(state_dict, layout, ignore=ignore, source=source)
    view = getattr(state_dict, "view", None)
    items = [(name, e) for name, e in layout.items() if name in state_dict and e.outputs]
    device, x64 = jax.config.jax_default_device, jax.config.jax_enable_x64  # thread-local: pass them on

    def convert(name: str, e: Entry) -> list:
        mapped = place is None and view is not None and all(fn is not None for _, fn in e.outputs)
        read = np.asarray(view(name) if mapped else state_dict[name])
        if tuple(read.shape) != e.shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(read.shape)}, expected {e.shape} "
                f"(does config.json match the weights?)"
            )
        x = _host_cast(read, dtype)
        # memory that is not ours (a mapped file, the caller's array): on CPU device_put would adopt
        # an aligned contiguous leaf as is, so such a leaf is copied first
        borrowed = x is read and (mapped or view is None)
        leaves = []
        with jax.default_device(device), jax.enable_x64(x64):
            for path, fn in e.outputs:
                y = fn(x) if fn is not None else x
                if place is not None:
                    leaves.append((path, place(path, y)))
                else:
                    leaves.append((path, jax.device_put(y.copy() if borrowed and y.flags.c_contiguous else y)))
        if place is None:
            jax.block_until_ready([leaf for _, leaf in leaves])  # done with the source before it goes
        return leaves

    params: dict = {}
    workers = max(1, min(load_threads() if threads is None else int(threads), len(items)))
    if workers == 1:
        for name, e in items:
            for path, leaf in convert(name, e):
                _set(params, path, leaf)
        return params
    with ThreadPoolExecutor(workers, thread_name_prefix="jsteer-load") as pool:
        futures = [pool.submit(convert, name, e) for name, e in items]
        try:
            for future in futures:  # in layout order: the first error raised is the first tensor's
                for path, leaf in future.result():
                    _set(params, path, leaf)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
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


__all__ = [
    "Entry",
    "entry",
    "transpose",
    "split",
    "cut",
    "RenamedView",
    "apply_layout",
    "check_names",
    "flatten_paths",
    "load_threads",
]
