"""Sharding models across devices: logical axis names mapped onto mesh axes by rules (as MaxText
and Levanter do it), with ``jax.jit`` + ``Mesh`` / ``NamedSharding``.

Every backbone param has logical axis names (``Family.logical_axes``: embed, vocab, heads,
kv_heads, head_dim, mlp, layers, norm, ...). A mesh has up to three axes, ``data``, ``fsdp`` and
``tensor`` (:func:`make_mesh`); *rules* map logical names to mesh axes:

=========  ===========================================================================================
preset     what it does
=========  ===========================================================================================
``dp``     params replicated on every device; the batch is split (today's data parallelism)
``fsdp``   ZeRO-3: every weight's ``embed`` axis split over ``fsdp`` (XLA gathers a layer's weights
           where it is used), optimizer state likewise; the batch split over ``data`` x ``fsdp``
``tp``     Megatron: attention split by heads, the MLP by its hidden units (column-parallel in,
           row-parallel out), embedding and logits by vocabulary, all over ``tensor``
``fsdp_tp`` both
=========  ===========================================================================================

Custom rules are a dict {logical name: mesh axis | None}; unnamed logical axes are replicated. A
dimension that a mesh axis does not divide is an error naming the param, its dimension and the
axis (never a silent fallback to replication). Batches are split over every batch axis present
(``data``, ``fsdp``: :func:`batch_spec`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
_TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
PRESETS: dict[str, dict] = {
    "dp": {},
    "fsdp": {"embed": "fsdp"},
    "tp": dict(_TP),
    "fsdp_tp": {"embed": "fsdp", **_TP},
}
Rules = Union[str, Mapping[str, Optional[str]]]


def make_mesh(data: Optional[int] = None, fsdp: int = 1, tensor: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (default: every device); ``data`` None takes the
    devices left over. Errors name the sizes that do not multiply out."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if data is None:
        if n % (fsdp * tensor):
            raise ValueError(f"make_mesh: {n} devices are not a multiple of fsdp={fsdp} x tensor={tensor}")
        data = n // (fsdp * tensor)
    if data * fsdp * tensor != n:
        raise ValueError(f"make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} != {n} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), AXES)


def resolve_rules(rules: Rules) -> dict:
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(
                f"unknown sharding rules {rules!r}; presets: {', '.join(PRESETS)} (or a dict "
                f"{{logical axis: mesh axis}})"
            )
        return dict(PRESETS[rules])
    return dict(rules)


def batch_spec(mesh: Mesh, ndim: int = 1) -> P:
    """The batch (leading) dim split over the mesh's batch axes, the rest replicated."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    lead = axes if len(axes) > 1 else (axes[0] if axes else None)
    return P(lead, *([None] * (ndim - 1)))


def batch_size_multiple(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names]))


def spec_for(name: str, shape: Sequence[int], axes: Optional[Sequence[Optional[str]]], rules: Mapping, mesh: Mesh) -> P:
    """PartitionSpec of one param. ``name`` (its path) and ``shape`` are for the error messages."""
    if axes is None:
        return P()
    if len(axes) != len(shape):
        raise ValueError(f"param {name}: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    spec, used = [], set()
    for logical, size in zip(axes, shape, strict=True):
        target = rules.get(logical) if logical is not None else None
        if target is None or target not in mesh.axis_names or mesh.shape[target] == 1:
            spec.append(None)
            continue
        if target in used:
            raise ValueError(f"param {name}: rules put two of its axes {tuple(axes)} on mesh axis {target!r}")
        n = mesh.shape[target]
        if size % n:
            raise ValueError(
                f"param {name} (shape {tuple(shape)}): its {logical!r} dimension ({size}) does not divide over "
                f"mesh axis {target!r} of size {n}. Use a {target!r} size that divides {size}, or rules that "
                f"leave {logical!r} unsharded, e.g. {{**jsteer.sharding.PRESETS[...], {logical!r}: None}}"
            )
        used.add(target)
        spec.append(target)
    return P(*spec)


def infer_axes(params: Any) -> Any:
    """Logical axes for every backbone inside ``params`` (a decoder's tree, a BERT model's or
    encoder's, at any depth: under "backbone", "encoder", ...); every other leaf None (replicated:
    method params are small). Works on arrays and ShapeDtypeStructs."""
    from jsteer.backbones import bert, decoder

    def walk(node):
        if not isinstance(node, Mapping):
            return None
        if "embed" in node and "final_norm" in node:
            return decoder.logical_axes(node)
        if "embeddings" in node and any(str(k).startswith("layer_") for k in node):
            return bert.logical_axes(node)
        if isinstance(node.get("encoder"), Mapping) and "embeddings" in node["encoder"]:
            known = {k: v for k, v in node.items() if k in ("encoder", "head")}
            return {**{k: walk(v) for k, v in node.items() if k not in known}, **bert.logical_axes(known)}
        return {k: walk(v) for k, v in node.items()}

    axes = walk(params)
    # leaves outside any backbone: one None per array leaf, in the params' structure
    return jax.tree.map(lambda x, a: a, params, _fill(params, axes), is_leaf=lambda x: x is None)


def _fill(params, axes):
    if isinstance(params, Mapping):
        return {k: _fill(v, axes.get(k) if isinstance(axes, Mapping) else None) for k, v in params.items()}
    return axes


def _path_name(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def shardings(shapes: Any, axes: Any, mesh: Mesh, rules: Rules = "dp") -> Any:
    """NamedSharding for every leaf of ``shapes`` (arrays or ShapeDtypeStructs), from its logical
    ``axes`` (a matching tree of tuples; None leaves: replicated)."""
    rules = resolve_rules(rules)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple) or x is None)[0])

    def one(path, leaf):
        key = tuple(path)
        return NamedSharding(mesh, spec_for(_path_name(path), np.shape(leaf), flat_axes.get(key), rules, mesh))

    return jax.tree_util.tree_map_with_path(one, shapes)


def shard(params: Any, axes: Any, mesh: Mesh, rules: Rules = "dp") -> Any:
    """``params`` placed onto ``mesh`` by their logical ``axes`` and ``rules``."""
    return jax.device_put(params, shardings(params, axes, mesh, rules))


def bytes_per_device(tree: Any) -> dict:
    """{device: bytes of the tree's shards it holds} (addressable shards of every leaf)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


__all__ = [
    "AXES",
    "BATCH_AXES",
    "PRESETS",
    "make_mesh",
    "resolve_rules",
    "batch_spec",
    "batch_size_multiple",
    "spec_for",
    "infer_axes",
    "shardings",
    "shard",
    "bytes_per_device",
]
