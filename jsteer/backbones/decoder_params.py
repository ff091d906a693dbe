"""The decoder's param tree: embedding matrices, CPU-kernel packing, scanned / unrolled layer
stacks, logical axis names and parameter counts.

Trees as :mod:`jsteer.backbones.decoder` draws them: ``embed/embedding`` [V, D], ``layers_{i}/...``
unrolled or ``layers/...`` scanned (every leaf with a leading [L] axis), ``lm_head/kernel`` [D, V]
when untied. Attention output kernels are [N, H, D] (two input axes); every other kernel has one.
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import jax
import jax.numpy as jnp

from jsteer.backbones import cpu
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.backbones.matmul import pack_kernels

Array = jnp.ndarray


def input_embeddings(params) -> Array:
    """Token-embedding matrix [V, D]."""
    return params["embed"]["embedding"]


def output_embeddings(params, config: DecoderConfig) -> Array:
    """Output-embedding matrix E [V, D] (logits = h E^T): the input embedding when tied."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"]
    return params["lm_head"]["kernel"].T


def _in_axes(path: Tuple[str, ...]) -> int:
    return 2 if path[-2:] == ("o", "kernel") else 1


def decode_pack(params: dict, config: DecoderConfig) -> dict:
    """Every kernel packed for ``cpu.small_gemm`` as its 2-D [in, out] form, at the same path (a
    scanned stack's kernels per layer, stacked), plus ``embed_attend`` (the tied embedding's
    transpose). Pure; call it under jit."""
    packed = pack_kernels(params, _in_axes, skip=("embed",))
    if config.tie_word_embeddings:
        packed["embed_attend"] = cpu.pack(params["embed"]["embedding"].T)
    return packed


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled params (``layers_{i}``) -> the scanned form (``layers``, leaves stacked [L, ...])."""
    layers = [params[f"layers_{i}"] for i in range(num_layers)]
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return out


def unstack_layers(params: dict) -> dict:
    """The scanned form -> unrolled ``layers_{i}``."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)})
    return out


# Logical axis names of each param by its trailing path (sharding rules map them to mesh axes).
_AXES = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("pos_embed", "embedding"): (None, "embed"),
    ("q", "kernel"): ("embed", "heads", "head_dim"),
    ("q", "bias"): ("heads", "head_dim"),
    ("k", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("k", "bias"): ("kv_heads", "head_dim"),
    ("v", "kernel"): ("embed", "kv_heads", "head_dim"),
    ("v", "bias"): ("kv_heads", "head_dim"),
    ("o", "kernel"): ("heads", "head_dim", "embed"),
    ("o", "bias"): ("norm",),
    ("gate", "kernel"): ("embed", "mlp"),
    ("gate", "bias"): ("mlp",),
    ("up", "kernel"): ("embed", "mlp"),
    ("up", "bias"): ("mlp",),
    ("down", "kernel"): ("mlp", "embed"),
    ("down", "bias"): ("norm",),
    ("lm_head", "kernel"): ("embed", "vocab"),
}


def logical_axes(params) -> Any:
    """The params' pytree with each leaf replaced by its logical axis names (a tuple, one per dim);
    norm scales / biases are ("norm",); a scanned stack's leaves lead with "layers". Works on
    arrays or ShapeDtypeStructs."""

    def one(path, leaf):
        names = tuple(getattr(p, "key", str(p)) for p in path)
        stacked = names[0] == "layers"
        ndim = len(leaf.shape) - stacked
        axes = _AXES.get(names[-2:], ("norm",) if ndim == 1 else None)
        if axes is None or len(axes) != ndim:
            raise ValueError(f"no logical axes for param {'/'.join(names)} of shape {tuple(leaf.shape)}")
        return ("layers",) + axes if stacked else axes

    return jax.tree_util.tree_map_with_path(one, params)


def param_count(c: DecoderConfig) -> int:
    """Parameters of a config (for benchmarks and memory plans)."""
    from jsteer.backbones.decoder import Decoder

    shapes = jax.eval_shape(Decoder(c).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)))
