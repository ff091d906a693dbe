"""Keyword highlighting: which span of a text a steer "explains" best.

Per token t the score is log P_steered(x_t | x_<t) - log P_base(x_t | x_<t); the highlighted
span is the contiguous run of at most ``max_len`` (default 5) tokens with the largest summed
score. The search is the max-sum-window dynamic programme written as a scan over window
lengths: best(j) = max_{l <= L} (P[j+1] - P[j+1-l]) with prefix sums P, all static shapes,
so it runs under jit and vmaps over a batch.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp

from jsteer.steer import head

Array = jnp.ndarray


def token_scores(
    params: head.Params, hidden: Array, embedding: Array, targets: Array, eps: Array, eps_base: Array | None = None
) -> Array:
    """log P_steered(target) - log P_base(target), [B, T].

    hidden: [B, T, D] unsteered final hidden states at positions predicting ``targets`` [B, T]
    (targets = input_ids shifted left). ``eps_base`` (default zeros) is the reference steer
    value, e.g. only the dummy steer on so that the domain shift cancels out.
    """
    eps = jnp.asarray(eps)
    if eps_base is None:
        eps_base = jnp.zeros_like(eps)
    lp_s = jax.nn.log_softmax(head.apply(params, hidden, embedding, eps), axis=-1)
    lp_b = jax.nn.log_softmax(head.apply(params, hidden, embedding, eps_base), axis=-1)
    pick = lambda lp: jnp.take_along_axis(lp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return pick(lp_s) - pick(lp_b)


@functools.partial(jax.jit, static_argnames="max_len")
def best_span(scores: Array, mask: Array | None = None, max_len: int = 5) -> Tuple[Array, Array, Array]:
    """Contiguous span of length 1..max_len with the largest sum of ``scores``.

    scores: [T] (or [B, T] -> batched results); mask: [T] 1 for real tokens (a span never
    covers a masked token). Returns (start, end_exclusive, total) as int32/float arrays.
    """
    if scores.ndim == 2:
        m = jnp.ones_like(scores) if mask is None else mask
        return jax.vmap(lambda s, mm: _best_span_1d(s, mm, max_len))(scores, m)
    return _best_span_1d(scores, mask, max_len)


def _best_span_1d(scores: Array, mask: Array | None, max_len: int) -> Tuple[Array, Array, Array]:
    if scores.ndim != 1:
        raise ValueError(f"scores must be [T] or [B, T], got shape {tuple(scores.shape)}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    t = scores.shape[0]
    valid = jnp.ones((t,), bool) if mask is None else mask.astype(bool)
    s = jnp.where(valid, scores.astype(jnp.float32), 0.0)
    prefix = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(s)])  # [T+1]
    bad_prefix = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(~valid)])
    ends = jnp.arange(1, t + 1)  # exclusive end j+1
    neg = jnp.float32(-jnp.inf)
    best = jnp.full((t,), neg)
    best_len = jnp.zeros((t,), jnp.int32)
    for length in range(1, min(max_len, t) + 1):  # static, <= max_len iterations
        start = ends - length
        ok = start >= 0
        st = jnp.clip(start, 0, t)
        total = prefix[ends] - prefix[st]
        clean = (bad_prefix[ends] - bad_prefix[st]) == 0
        total = jnp.where(ok & clean, total, neg)
        better = total > best
        best = jnp.where(better, total, best)
        best_len = jnp.where(better, length, best_len)
    j = jnp.argmax(best)
    end = (j + 1).astype(jnp.int32)
    return end - best_len[j], end, best[j]


@functools.partial(jax.jit, static_argnames="max_len")
def highlight(
    params: head.Params,
    hidden: Array,
    embedding: Array,
    targets: Array,
    eps: Array,
    mask: Array | None = None,
    max_len: int = 5,
    eps_base: Array | None = None,
):
    """Per-token scores [B, T] and the best span per row (start, end, total) for a batch."""
    sc = token_scores(params, hidden, embedding, targets, eps, eps_base)
    m = jnp.ones(targets.shape, jnp.int32) if mask is None else mask
    return sc, best_span(sc, m, max_len)
