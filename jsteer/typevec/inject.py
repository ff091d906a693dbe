"""Adding lambda * TE through a backbone's input-embedding offset hook.

Where the offset goes:

* MLM encoders: the [MASK] position (:func:`mask_positions`).
* Decoders, cloze probing: the predicting position (the last prompt token, whose output
  is the answer's distribution; :func:`last_positions`) or every prompt token
  (``attention_mask`` itself).
* Decoders, generation: every prompt token via ``embed_offset`` plus every generated token
  via ``step_offset`` (:func:`generation_hooks`), the paper's "all tokens" mode.
* Decoders, residual stream (not in the paper; :func:`residual_hooks`): lambda * TE added to the
  residual stream after decoder layer ``l`` (``FiLM.beta_out``) at the marked positions. In a
  decoder the predicting position's *input* is the previous token, so an input-side TE there
  says "the current token is of this type" (the model then predicts what *follows* such a
  token: punctuation); the late-layer residual of that position encodes the *next* token,
  in the (tied) embedding space the TE lives in - the decoder analogue of the [MASK] slot.

Scale: lambda multiplies a unit-norm TE (method "svd"). Embedding spaces differ in scale
(mean input-embedding row norm: BERT-base ~1.4, SmolLM2-135M 3.20, MiniLM ~1.0), so the
experiments express lambda in units of :func:`row_norm_unit` (mean row norm) for input-side
injection and of the mean residual norm at the layer for :func:`residual_hooks`.

All functions are pure and jittable; lambda may be a scalar or one value per row [B], and is
a traced value (sweeping it never recompiles).

The package re-exports :func:`inject` under this module's name, so ``jsteer.typevec.inject``
is this module and is also callable as that function: ``tv.inject(te, lam, where)`` and
``import jsteer.typevec.inject as I; I.last_positions(mask)`` both work.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import jax.numpy as jnp

from jsteer.hooks import FiLM, Hooks

Array = jnp.ndarray


def mask_positions(input_ids: Array, mask_id: int) -> Array:
    """[B, T] ids -> [B, T] float, 1 where the token is [MASK]."""
    return (input_ids == mask_id).astype(jnp.float32)


def last_positions(attention_mask: Array) -> Array:
    """[B, T] attention mask -> [B, T] float one-hot of each row's last real token
    (works for right padding; with left padding that is column T-1)."""
    attention_mask = attention_mask.astype(jnp.int32)
    t = attention_mask.shape[1]
    idx = jnp.arange(t)[None, :]
    last = jnp.max(jnp.where(attention_mask > 0, idx, -1), axis=1, keepdims=True)
    return (idx == last).astype(jnp.float32)


def one_hot_positions(pos: Array, length: int) -> Array:
    """[B] int positions -> [B, T] float one-hot."""
    return (jnp.arange(length)[None, :] == pos[:, None]).astype(jnp.float32)


def _lam_rows(lam, batch: int) -> Array:
    lam = jnp.asarray(lam, jnp.float32)
    if lam.ndim == 0:
        return jnp.broadcast_to(lam, (batch,))
    if lam.shape != (batch,):
        raise ValueError(f"lambda must be a scalar or [B]={batch} values, got shape {lam.shape}")
    return lam


def _te_rows(te: Array, batch: int) -> Array:
    te = jnp.asarray(te)
    if te.ndim == 1:
        return jnp.broadcast_to(te, (batch,) + te.shape)
    if te.ndim != 2 or te.shape[0] != batch:
        raise ValueError(f"te must be [D] or [B={batch}, D], got shape {te.shape}")
    return te


def offset(te: Array, lam, where: Array) -> Array:
    """Embedding offset [B, T, D] = lam_b * where[b, t] * te_b.

    te: [D] or [B, D]; lam: scalar or [B]; where: [B, T] (1/0 or weights)."""
    if where.ndim != 2:
        raise ValueError(f"where must be a [B, T] position mask, got shape {where.shape}")
    b = where.shape[0]
    te = _te_rows(te, b)
    lam = _lam_rows(lam, b)
    return jnp.einsum("bt,b,bd->btd", where.astype(te.dtype), lam.astype(te.dtype), te)


def inject(te: Array, lam, where: Array, hooks: Optional[Hooks] = None) -> Hooks:
    """Hooks adding lam * te at the positions marked in ``where`` [B, T] (composes with ``hooks``)."""
    off = offset(te, lam, where)
    if hooks is None:
        return Hooks(embed_offset=off)
    base = hooks.embed_offset
    return hooks.replace(embed_offset=off if base is None else base + off.astype(base.dtype))


def step_offset(te: Array, lam, batch: int) -> Array:
    """[B, D] offset for every generated token (decoders' "all tokens" mode)."""
    return _lam_rows(lam, batch)[:, None] * _te_rows(te, batch)


def generation_hooks(te: Array, lam, attention_mask: Array) -> Hooks:
    """TE on every prompt token and every generated token. attention_mask: [B, T] prompt mask."""
    b = attention_mask.shape[0]
    return Hooks(embed_offset=offset(te, lam, attention_mask.astype(jnp.float32)), step_offset=step_offset(te, lam, b))


def row_norm_unit(embedding: Array) -> Array:
    """Mean L2 norm of the input-embedding rows [V, D] -> scalar: the unit lambda is expressed
    in for input-side injection (lambda_abs = lambda_units * row_norm_unit)."""
    return jnp.mean(jnp.linalg.norm(jnp.asarray(embedding, jnp.float32), axis=-1))


def residual_hooks(te: Array, lam, where: Array, layer: int, hooks: Optional[Hooks] = None) -> Hooks:
    """Hooks adding lam * te to the residual stream after decoder layer ``layer`` (static int)
    at the positions marked in ``where`` [B, T] (``FiLM.beta_out``; composes with ``hooks``)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int (a decoder layer index), got {layer!r}")
    film = {layer: FiLM(beta_out=offset(te, lam, where))}
    if hooks is None:
        return Hooks(film=film)
    from jsteer.hooks import compose

    return compose(hooks, Hooks(film=film))


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`inject` (see the module docstring)."""

    def __call__(self, te: Array, lam, where: Array, hooks: Optional[Hooks] = None) -> Hooks:
        return inject(te, lam, where, hooks)


sys.modules[__name__].__class__ = _CallableModule
