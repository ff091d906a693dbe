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

``LM.forward`` / ``LM.generate`` with ``mesh=`` run data-parallel through :class:`BatchSplit`: a
batch of B rows ([B, T] ids and mask, [B, T, D] hook arrays, ...) is padded with copies of row 0
to a multiple of the batch axes' size, split over them, and cut back to B rows on the way out
(:func:`resolve_data_mesh` checks the mesh; :data:`HOOK_ROW_RANK` says which hook fields are
per row).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
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
    from jsteer.backbones import bert, decoder_params

    def walk(node):
        if not isinstance(node, Mapping):
            return None
        if "embed" in node and "final_norm" in node:
            return decoder_params.logical_axes(node)
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


# ----------------------------------------------------------------------------- data-parallel LM calls

DATA_AXIS = "data"  # the mesh axis the batch is split over (jsteer.train.data_mesh names it so)

# Hooks fields that hold one row per batch element, with their documented rank: a leaf of that
# rank whose leading dim is B is split over "data"; anything else (e.g. a [1, D] step offset
# broadcast over rows) is replicated. Steer: ``eps`` [B, S] is per row; its other fields are per
# steer ([S, ...]) and always replicated, even where S happens to equal B.
HOOK_ROW_RANK = {"embed_offset": 3, "step_offset": 2, "attn_bias": 3, "position_ids": 2}


def resolve_data_mesh(mesh, where: str):
    """None / False -> None; True -> a "data" mesh over this process's devices; a Mesh is checked."""
    if mesh is None or mesh is False:
        return None
    if mesh is True:
        from jsteer.train.step import data_mesh

        return data_mesh(jax.local_devices())
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"LM.{where}: mesh must be a jax.sharding.Mesh with a {DATA_AXIS!r} axis, True (every "
            f"device of this process) or None, got {type(mesh).__name__}"
        )
    if DATA_AXIS not in mesh.axis_names:
        raise ValueError(
            f"LM.{where}: the mesh has axes {tuple(mesh.axis_names)} but no {DATA_AXIS!r} axis to "
            f"split the batch over; build one with jsteer.train.data_mesh()"
        )
    if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
        raise ValueError(
            f"LM.{where}: the mesh spans devices of other processes; mesh= splits one process's "
            f"batch over its own devices (pass data_mesh(jax.local_devices()) or mesh=True)"
        )
    return mesh


class BatchSplit:
    """Pads B rows to a multiple of the mesh's batch axes' size ("data" x "fsdp"; copies of row 0)
    and places arrays: batch leaves split over those axes, everything else replicated;
    :meth:`drop_padding` undoes the padding on outputs."""

    def __init__(self, mesh, batch: int):
        n = batch_size_multiple(mesh)
        self.batch, self.padded = batch, -(-batch // n) * n
        self._split = NamedSharding(mesh, batch_spec(mesh))
        self._replicated = NamedSharding(mesh, P())

    def rows(self, x):
        """[B, ...] -> [B_padded, ...] split over "data" (padding rows copy row 0)."""
        extra = self.padded - self.batch
        if extra:
            xp = jnp if isinstance(x, jax.Array) else np
            x = xp.concatenate([x, xp.repeat(x[:1], extra, axis=0)])
        return jax.device_put(x, self._split)

    def replicated(self, x):
        return None if x is None else jax.device_put(x, self._replicated)

    def _is_rows(self, x, rank: Optional[int] = None) -> bool:
        return np.ndim(x) >= 1 and np.shape(x)[0] == self.batch and (rank is None or np.ndim(x) == rank)

    def tree(self, tree):
        """Any pytree (module keyword arrays: token_type_ids [B, T], a KV cache): leaves whose
        leading dim is B are split, others replicated."""
        return jax.tree.map(lambda x: self.rows(x) if self._is_rows(x) else self.replicated(x), tree)

    def hooks(self, hooks):
        if hooks is None:
            return None

        def place(x, rank, name, broadcast_ok=True):
            if x is None:
                return None
            if np.ndim(x) == rank and np.shape(x)[0] != self.batch and not (broadcast_ok and np.shape(x)[0] == 1):
                # checked here: after padding, the backbone would compare it with the padded batch
                raise ValueError(
                    f"hooks.{name} has a leading (batch) dim of {np.shape(x)[0]}, but the batch has "
                    f"{self.batch} rows" + ("" if not broadcast_ok else " (or 1, shared by every row)")
                )
            return self.rows(x) if self._is_rows(x, rank) else self.replicated(x)

        changes = {}
        for f in dataclasses.fields(hooks):
            value = getattr(hooks, f.name)
            if value is None:
                continue
            if f.name in HOOK_ROW_RANK:
                changes[f.name] = place(value, HOOK_ROW_RANK[f.name], f.name)
            elif f.name == "film":  # {layer: FiLM}, every field [B, T, D]
                changes[f.name] = {
                    k: jax.tree.map(lambda x, k=k: place(x, 3, f"film[{k}]"), v) for k, v in value.items()
                }
            elif f.name == "steer":
                changes[f.name] = dataclasses.replace(
                    jax.tree.map(self.replicated, value), eps=place(value.eps, 2, "steer.eps", broadcast_ok=False)
                )
            else:
                raise ValueError(
                    f"mesh=: no rule for splitting hooks.{f.name} over the batch "
                    f"(add it to jsteer.sharding.HOOK_ROW_RANK)"
                )
        return dataclasses.replace(hooks, **changes)

    def drop_padding(self, tree):
        """Outputs [B_padded, ...] -> [B, ...] (other leaves, e.g. a cache's scalar index, kept)."""
        if self.padded == self.batch:
            return tree
        return jax.tree.map(lambda x: x[: self.batch] if np.ndim(x) >= 1 and x.shape[0] == self.padded else x, tree)


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
    "DATA_AXIS",
    "HOOK_ROW_RANK",
    "resolve_data_mesh",
    "BatchSplit",
]
