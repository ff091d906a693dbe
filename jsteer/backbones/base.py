"""Types shared by all backbones: outputs, the decoder KV cache, the activation table.

Every backbone is a Flax linen module whose ``__call__`` returns :class:`ModelOutput`.

Encoders (BERT family)::

    out = model.apply({"params": p}, input_ids [B,T], attention_mask=[B,T] | None,
                      token_type_ids=[B,T] | None, hooks=Hooks | None,
                      deterministic=True, output_hidden_states=False)

Decoders (LLaMA family, GPT-2)::

    out = model.apply({"params": p}, input_ids [B,T], attention_mask=[B,T] | None,
                      hooks=Hooks | None, cache=KVCache | None,
                      output_hidden_states=False)

With ``cache`` the T new tokens are written at slots ``cache.index .. cache.index+T-1``
and may attend to every earlier valid slot; ``out.cache`` is the updated cache. Position
ids default to ``cache.pos + cumsum(attention_mask) - 1`` so left-padded rows count from 0
at their first real token (``hooks.position_ids`` overrides).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray


@flax.struct.dataclass
class ModelOutput:
    """logits: [B,T,V] (or head-specific, e.g. [B,T,2] for span QA, None for a bare encoder);
    hidden: [B,T,D] final hidden states (after the final norm in pre-LN decoders: the
    vector the output embedding is dotted with); hidden_states: per-layer outputs
    (embeddings first, L+1 entries) when asked; cache: updated KV cache (decoders); captured:
    {site: activation} for the sites named in ``capture=`` (:mod:`jsteer.interventions`)."""

    logits: Optional[Array]
    hidden: Array
    hidden_states: Optional[Tuple[Array, ...]] = None
    cache: Optional["KVCache"] = None
    captured: Optional[dict] = None


@flax.struct.dataclass
class KVCache:
    """Decoder KV cache with a fixed number of slots S (static shape under jit).

    k:     tuple of L arrays [B, H_kv, Dh, S] (keys stored transposed), or one [L, B, H_kv, Dh, S]
           array for a scanned layer stack
    v:     tuple of L arrays [B, H_kv, S, Dh], or one [L, B, H_kv, S, Dh] array
           (k and v are the operands of attention's two matmuls as they are; in any other
           layout each decode step copies every slot of the cache, layer by layer; one row on
           CPU is written and carried without its batch axis for the same reason: :meth:`unbatched`)
    mask:  [B, S] int32, 1 where a slot holds a real (non-pad) token
    index: [] int32, next slot to write (same for all rows; rows are left-padded)
    pos:   [B] int32, next position id per row: one past the largest real position so far
           (= number of real tokens so far with default positions)
    """

    k: Tuple[Array, ...]
    v: Tuple[Array, ...]
    mask: Array
    index: Array
    pos: Array

    @classmethod
    def init(
        cls,
        n_layers: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        stacked: bool = False,
    ) -> "KVCache":
        zk = jnp.zeros((batch, n_kv_heads, head_dim, max_len), dtype)
        zv = jnp.zeros((batch, n_kv_heads, max_len, head_dim), dtype)
        if stacked:
            k, v = jnp.zeros((n_layers,) + zk.shape, dtype), jnp.zeros((n_layers,) + zv.shape, dtype)
        else:
            k, v = tuple(zk for _ in range(n_layers)), tuple(zv for _ in range(n_layers))
        return cls(
            k=k,
            v=v,
            mask=jnp.zeros((batch, max_len), jnp.int32),
            index=jnp.zeros((), jnp.int32),
            pos=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    @staticmethod
    def unbatched(batch: int) -> bool:
        """Whether a cache of ``batch`` rows is written (:meth:`write`), and carried by
        jsteer.decode's loop (:meth:`without_batch`), without its batch axis: one row on CPU. XLA
        drops that size-1 axis from attention's products; with it kept, each decode step updated
        every layer's cache twice (once per shape) and copied every slot of it
        (experiments/probe_kv_cache_copies.py). At two rows and more the squeezed carry would add
        copies instead; GPUs are unmeasured."""
        return batch == 1 and jax.default_backend() == "cpu"

    def without_batch(self, drop: bool) -> "KVCache":
        """k and v with their batch axis (of size 1) dropped (``drop``) or restored."""
        axis = 0 if isinstance(self.k, tuple) else 1  # per-layer tuples, or one [L, B, ...] stack
        f = (lambda x: jnp.squeeze(x, axis)) if drop else (lambda x: jnp.expand_dims(x, axis))
        return self.replace(k=jax.tree.map(f, self.k), v=jax.tree.map(f, self.v))

    def reset(self) -> "KVCache":
        """The same slots, emptied (the stale keys and values are masked out and overwritten)."""
        return self.replace(
            mask=jnp.zeros_like(self.mask), index=jnp.zeros_like(self.index), pos=jnp.zeros_like(self.pos)
        )

    @staticmethod
    def write(cached_k: Array, cached_v: Array, k: Array, v: Array, index: Array) -> Tuple[Array, Array]:
        """Write T new keys and values [B, T, H_kv, Dh] into one layer's cache (k [B, H_kv, Dh, S],
        v [B, H_kv, S, Dh]) at slots index..index+T-1; returns the updated (k, v)."""
        k = k.astype(cached_k.dtype).transpose(0, 2, 3, 1)
        v = v.astype(cached_v.dtype).transpose(0, 2, 1, 3)
        if KVCache.unbatched(cached_k.shape[0]):
            k = jax.lax.dynamic_update_slice(cached_k[0], k[0], (0, 0, index))[None]
            v = jax.lax.dynamic_update_slice(cached_v[0], v[0], (0, index, 0))[None]
            return k, v
        k = jax.lax.dynamic_update_slice(cached_k, k, (0, 0, 0, index))
        v = jax.lax.dynamic_update_slice(cached_v, v, (0, 0, index, 0))
        return k, v


def default_positions(attention_mask: Array, cache: Optional[KVCache]) -> Array:
    """[B,T] position ids: running count of real tokens (left padding gets clipped to 0)."""
    start = 0 if cache is None else cache.pos[:, None]
    pos = start + jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1
    return jnp.maximum(pos, 0)


def next_positions(cache: "KVCache", attention_mask: Array, positions: Array) -> Array:
    """[B] next position id per row after writing T tokens: one past the largest real
    token's position (positions [B,T], mask [B,T]); rows without a real token keep
    ``cache.pos``. With default positions this is ``cache.pos + mask.sum(-1)``; with explicit
    ``hooks.position_ids`` decoding continues after the largest one."""
    last = jnp.max(jnp.where(attention_mask > 0, positions.astype(jnp.int32) + 1, 0), axis=-1)
    return jnp.maximum(cache.pos, last).astype(jnp.int32)


def check_position_ids(position_ids, table_size: Optional[int], where: str) -> None:
    """Raise ValueError if concrete ``position_ids`` fall outside [0, table_size).

    A learned position table gathers NaN for an out-of-range row (``jnp.take`` fill mode), so
    this is checked wherever the values are known. Traced values (under ``jit``) cannot be
    checked here; :meth:`jsteer.lm.LM.forward` and :func:`jsteer.decode.generate` check them
    before tracing. ``table_size`` None (RoPE: no table) checks nothing.
    """
    if position_ids is None or table_size is None or isinstance(position_ids, jax.core.Tracer):
        return
    p = np.asarray(position_ids)
    if p.size and (p.min() < 0 or p.max() >= table_size):
        raise ValueError(
            f"{where}: hooks.position_ids must lie in [0, {table_size}) (the model's position "
            f"table has {table_size} rows), got values from {p.min()} to {p.max()}"
        )


def attention_slots(mask: Array, bias: Optional[Array], cache: Optional["KVCache"]):
    """Where T new tokens sit among the keys of one decoder call.

    mask [B,T] (1 = real token), bias [B,T,T] | None (hooks.attn_bias), cache or None.
    Returns (index, key_mask [B,K], q_slots [T], k_slots [K], bias [B,T,K] | None) with K = T
    without a cache (index None) and K = cache.max_len with one: the new tokens are written at
    slots index..index+T-1 and the bias is placed over their own slots (zero elsewhere).
    """
    b, t = mask.shape
    if bias is not None and bias.shape != (b, t, t):
        raise ValueError(f"hooks.attn_bias must be [B, T, T] = {(b, t, t)}, got {bias.shape}")
    if cache is None:
        return None, mask, jnp.arange(t), jnp.arange(t), bias
    if cache.mask.shape[0] != b:
        raise ValueError(f"cache batch {cache.mask.shape[0]} != input batch {b}")
    if t > cache.max_len:
        raise ValueError(f"{t} new tokens do not fit a cache of {cache.max_len} slots")
    index = cache.index
    key_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (0, index))
    if bias is not None:
        bias = jax.lax.dynamic_update_slice(jnp.zeros((b, t, cache.max_len), bias.dtype), bias, (0, 0, index))
    return index, key_mask, index + jnp.arange(t), jnp.arange(cache.max_len), bias


NEG_INF = -1e30  # finite so fully-masked (pad) rows stay NaN-free


# ----------------------------------------------------------------------------- row reductions
# XLA:CPU (jaxlib 0.10) reduces the minor axis with max / min several times slower than with add:
# MiniLM's scores [32,12,128,128] 3.7 ms for max(-1) against 0.75 ms for sum(-1) and 0.5 ms here,
# SmolLM2's logits [512,49152] 16 ms -> 2.8 ms. Elementwise maxima over 16-lane slices
# vectorise, and so does a reduce over a non-minor axis. Max and min are exact, so the result is
# the same bit for bit; other backends keep the plain reduce.

_LANES, _SLICES = 16, 64


def _fold(x: Array, pair: Callable, reduce: Callable) -> Array:
    n = x.shape[-1]
    if jax.default_backend() != "cpu" or n % _LANES or n < 2 * _LANES:
        return reduce(x, axis=-1, keepdims=True)
    if n > _LANES * _SLICES:  # first down to <= 1024 lanes, reducing rows of a [.., n / c, c] view
        c = next(c for c in (1024, 512, 256, 128, 64, 32, 16) if n % c == 0)
        x = reduce(x.reshape(x.shape[:-1] + (n // c, c)), axis=-2)
    parts = [x[..., i : i + _LANES] for i in range(0, x.shape[-1], _LANES)]
    while len(parts) > 1:  # a tree, not a chain: independent maxima per level
        parts = [pair(a, b) for a, b in zip(parts[::2], parts[1::2])] + parts[len(parts) - len(parts) % 2 :]
    return reduce(parts[0], axis=-1, keepdims=True)


def row_max(x: Array) -> Array:
    """``x.max(axis=-1, keepdims=True)`` [..., 1], the same values, fast on XLA:CPU."""
    return _fold(x, jnp.maximum, jnp.max)


def row_min(x: Array) -> Array:
    """``x.min(axis=-1, keepdims=True)`` [..., 1], the same values, fast on XLA:CPU."""
    return _fold(x, jnp.minimum, jnp.min)


def logsumexp(x: Array) -> Array:
    """``jax.nn.logsumexp(x, axis=-1)`` [...], the same values, its max through :func:`row_max`."""
    m = row_max(x)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    return jnp.log(jnp.exp(x - m).sum(axis=-1)) + m[..., 0]


# ----------------------------------------------------------------------------- gathers and segment sums
# A gather's gradient is a scatter-add, and a segment sum is one. On GPUs XLA emits bf16 / fp16
# scatter-adds as compare-and-swap loops, which serialise where ids repeat (position and
# token-type rows, padding, KALA's null entity): on an H100, MiniLM's bf16 gradient at batch
# 256 x 32 took 47 ms against 6 ms in fp32 (experiments/gpu_step_anatomy.py). These helpers
# accumulate in float32 instead; tests/test_low_precision_scatter.py checks every model for it.

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _as_f32(x: Array) -> Array:
    return x.astype(jnp.float32) if x.dtype in _LOW_PRECISION else x


@jax.custom_jvp
def take_rows(table: Array, ids: Array) -> Array:
    """``jnp.take(table, ids, axis=0)`` [*ids.shape, ...] in table's dtype, whose tangent is
    gathered from a float32 view of a bf16 / fp16 table's tangent, so that its gradient (the
    transposed gather) accumulates in float32. Out-of-range ids gather NaN (``jnp.take``'s fill
    mode). The primal gathers the table itself: a float32 view there is a whole-table convert per
    call that XLA:GPU keeps inside a decode loop (a 1B model's tied 128k x 2048 table: 0.38 ms of a
    1.8 ms step on an H200, and the head's product then read the float32 copy)."""
    return jnp.take(table, ids, axis=0)


@take_rows.defjvp
def _take_rows_jvp(primals, tangents):
    table, ids = primals
    return take_rows(table, ids), jnp.take(_as_f32(tangents[0]), ids, axis=0).astype(table.dtype)


def segment_sum(data: Array, segment_ids: Array, num_segments: int) -> Array:
    """``jax.ops.segment_sum`` accumulated in float32 for bf16 / fp16 ``data``, returned in
    data's dtype: [num_segments, *data.shape[1:]]."""
    return jax.ops.segment_sum(_as_f32(data), segment_ids, num_segments).astype(data.dtype)


class Embed(nn.Embed):
    """``nn.Embed`` whose lookup is :func:`take_rows` (same params, same values; a float32
    gradient accumulation for a bf16 / fp16 table), cast to ``dtype`` when that is set."""

    def __call__(self, inputs: Array) -> Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed: ids must be integers, got {inputs.dtype}")
        table = self.embedding
        return take_rows(table, inputs).astype(self.dtype or table.dtype)


def gelu_exact(x: jax.Array) -> jax.Array:
    """x * Phi(x) via erf, as PyTorch computes it. jax.nn.gelu(approximate=False) goes through
    erfc, whose XLA:CPU expansion evaluates two branches: ~4x slower, same values in fp32."""
    return x * 0.5 * (1.0 + jax.lax.erf(x * 0.7071067811865476))


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


# HF ``hidden_act`` / ``activation_function`` name -> function (the names transformers' ACT2FN uses).
ACTIVATIONS: Dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu_exact,
    "gelu_python": gelu_exact,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_10": lambda x: jnp.clip(gelu_exact(x), -10.0, 10.0),
    "quick_gelu": _quick_gelu,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "linear": lambda x: x,
}


def eos_ids(eos_token_id) -> tuple[int, ...]:
    """An HF config's ``eos_token_id`` (None, one id or a list) as a tuple of ids."""
    if eos_token_id is None:
        return ()
    return (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(int(i) for i in eos_token_id)
