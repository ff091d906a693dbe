"""Choosing the next token: greedy or sampled (temperature, top-k, top-p), and the logits
processors that act before it (HF's order): the repetition penalty and min_new_tokens.

Shapes: logits [B, V] float32, per-row settings [B], ``step`` [] int32 (the index of the token
being chosen), ``keys`` [B] PRNG keys (row b draws with ``fold_in(keys[b], step)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jsteer.backbones.base import logsumexp, row_max, row_min

Array = jnp.ndarray


def repetition_penalty(logits: Array, seen: Array, penalty: Array) -> Array:
    """HF's repetition penalty: every token already in the sequence (``seen`` [B, V] bool: the
    prompt ids, padding included as HF does, and the generated ones) has its logit divided by
    ``penalty`` [B] where positive, multiplied where negative; 1 leaves a row unchanged."""
    p = penalty[:, None]
    return jnp.where(seen, jnp.where(logits < 0, logits * p, logits / p), logits)


def hold_stops(logits: Array, stop_ids: Array, step: Array, min_new_tokens: Array) -> Array:
    """min_new_tokens: the stop ids (``stop_ids`` [S], -1 padding) may not be chosen while
    ``step`` < ``min_new_tokens`` (HF's MinNewTokensLengthLogitsProcessor)."""
    v = logits.shape[-1]
    is_stop = jnp.zeros((v,), bool).at[jnp.where(stop_ids >= 0, stop_ids, v)].set(True, mode="drop")
    return jnp.where((step < min_new_tokens) & is_stop[None, :], -jnp.inf, logits)


NUCLEUS_CANDIDATES = 256  # top-k/top-p look at this many best tokens first (exact; see below)


def _nucleus_threshold(desc: Array, k: Array, top_p: Array, log_norm: Array) -> tuple[Array, Array]:
    """desc [B, n]: the n best logits, sorted descending; k [B, 1] the top-k size; log_norm [B, 1]
    the log-partition of the top-k distribution. Returns (threshold [B, 1]: the smallest kept
    logit, probs [B, n] of the top-k distribution); the most likely token is always kept."""
    rank = jnp.arange(desc.shape[-1])[None, :]
    in_k = rank < k
    probs = jnp.where(in_k, jnp.exp(desc - log_norm), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # a prefix of the sorted order; top_p 1 keeps the whole top-k even where fp32 mass rounds to 1
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))
    return jnp.take_along_axis(desc, keep.sum(axis=-1, keepdims=True) - 1, axis=-1), probs


def _filter_sorted(logits: Array, top_k: Array, top_p: Array) -> Array:
    """Reference filter over a full-vocabulary sort (the slow path of :func:`_filter_top_k_top_p`)."""
    v = logits.shape[-1]
    desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    log_norm = logsumexp(jnp.where(jnp.arange(v)[None, :] < k, desc, -jnp.inf))[:, None]
    threshold, _ = _nucleus_threshold(desc, k, top_p, log_norm)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _order_keys(x: Array) -> Array:
    """float32 [..] -> uint32 keys in the same order (-inf lowest, +inf highest; no NaNs expected)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _nucleus_bisect(logits: Array, top_p: Array) -> Array:
    """logits [B,V], top_p [B] -> the nucleus threshold as an order key [B, 1] (keep keys >= it),
    found without sorting: the smallest logit value x whose strictly-higher mass G(x) is < top_p,
    the same set a descending sort keeps (its mass before a token < top_p). G falls as x rises, so
    32 halvings of the uint32 key range pin x exactly; only the summation order of the mass differs
    from the sorted cumsum."""
    keys = _order_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    hi = keys.max(axis=-1, keepdims=True)  # G(max) = 0 < top_p
    lo = jnp.zeros_like(hi)  # below every key: G = 1 >= top_p

    def halve(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p[:, None]
        return jnp.where(above, lo, mid), jnp.where(above, mid, hi)

    return lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _filter_top_k_top_p(logits: Array, top_k: Array, top_p: Array, candidates: int = NUCLEUS_CANDIDATES) -> Array:
    """logits [B,V] (temperature applied) -> logits with tokens outside the top-k, then
    outside the top-p nucleus of the renormalised top-k distribution, set to -inf.
    top_k [B] (0: off), top_p [B] (1: off); the most likely token is always kept.

    A full-vocabulary sort per decode step costs more than a small model's forward on CPU, so
    the filter first takes the ``candidates`` best tokens (``lax.top_k``). That is exact
    whenever the kept set lies inside them (top_k <= candidates, or no top-k and the
    candidates already hold top_p of the mass: the usual case for a peaked distribution). Rows
    without top-k whose nucleus is wider (flat distributions, often one row in a large sampling
    batch) get their threshold by bisection (:func:`_nucleus_bisect`, no sort); only a top_k
    between ``candidates`` and V falls back to the full sort."""
    v = logits.shape[-1]
    c = min(candidates, v)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    desc = lax.top_k(logits, c)[0]  # [B, c]
    log_norm = jnp.where(
        k <= c,
        logsumexp(jnp.where(jnp.arange(c)[None, :] < k, desc, -jnp.inf))[:, None],
        logsumexp(logits)[:, None],
    )
    threshold, probs = _nucleus_threshold(desc, k, top_p, log_norm)
    no_filter = (k[:, 0] == v) & (top_p >= 1.0)
    threshold = jnp.where(no_filter[:, None], -jnp.inf, threshold)
    exact = no_filter | (k[:, 0] <= c) | ((k[:, 0] == v) & (probs.sum(axis=-1) >= top_p))

    def wide_nucleus(x):
        cut = _nucleus_bisect(x, top_p)
        return jnp.where(
            exact[:, None], jnp.where(x >= threshold, x, -jnp.inf), jnp.where(_order_keys(x) >= cut, x, -jnp.inf)
        )

    branch = jnp.where(jnp.all(exact), 0, jnp.where(jnp.any((k[:, 0] > c) & (k[:, 0] < v)), 2, 1))
    return lax.switch(
        branch,
        [lambda x: jnp.where(x >= threshold, x, -jnp.inf), wide_nucleus, lambda x: _filter_sorted(x, top_k, top_p)],
        logits,
    )


def argmax_tokens(logits: Array) -> Array:
    """logits [B,V] -> [B] int32, ``jnp.argmax(logits, -1)`` (the first of tied maxima) as a max
    and a min, both folded (:func:`~jsteer.backbones.base.row_max`): XLA:CPU's variadic argmax
    reduction is slower (SmolLM2's 49152 logits, session 41's Xeon: batch 1 253 -> 85 us, 8 rows
    798 -> 300, 64 rows 6.1 -> 1.2 ms). A row with a NaN gets the last token (argmax: the NaN's)."""
    v = logits.shape[-1]
    first = row_min(jnp.where(logits == row_max(logits), jnp.arange(v, dtype=jnp.int32), v))[..., 0]
    return jnp.minimum(first, v - 1)


def next_token(logits: Array, step: Array, keys, temperature: Array, top_k: Array, top_p: Array) -> Array:
    """logits [B,V] -> token [B]: argmax where temperature == 0, else a sample. The sampling
    branch (and its full-vocab sort) only runs when some row needs it."""
    greedy = argmax_tokens(logits)
    sampling = temperature > 0

    def sample():
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
        filtered = lax.cond(
            jnp.any(sampling & ((top_k > 0) | (top_p < 1.0))),
            lambda x: _filter_top_k_top_p(x, top_k, top_p),
            lambda x: x,
            scaled,
        )
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        drawn = jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    return lax.cond(jnp.any(sampling), sample, lambda: greedy)


__all__ = ["argmax_tokens", "next_token", "repetition_penalty", "hold_stops", "NUCLEUS_CANDIDATES"]
