"""Attention through jsteer's CPU kernels, differentiable in both modes.

:func:`kernel_attention` is :func:`jsteer.backbones.attention.attention`'s CPU route: the decode kernel
for one new token per row over the KV cache, the block kernel (``cpu.block_attention``) for every
other call, with probability dropout drawn in the kernel from the same
:class:`~jsteer.backbones.dropout.HashDropout` mask as the hand-written path's.

Derivatives (:mod:`jsteer.backbones.kernel_grad`): forward mode as the hand-written path's tangent,
reverse mode by ``cpu.block_attention_grad``, a kernel that recomputes the scores and writes dq, dk
and dv (a fused projection's gradient in place). XLA:CPU ran the hand-written path's transpose as
six batched products at 45-90 GFLOP/s plus passes over the [B, N, T, S] tensors. A bias that needs
its cotangent, soft-capping and the cache layout take the hand-written transpose.

Shapes: q [B,T,K,G,H], k / v [B,S,K,H] (or the cache's [B,K,H,S] / [B,K,S,H]), or the fused
projection qkv [B,T,3,K,H]; visible / bias broadcastable to [B,K,G,T,S]; out [B,T,K,G,H].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jsteer.backbones import cpu, kernel_grad
from jsteer.backbones.base import NEG_INF

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a block call is, besides its arrays (hashable: a primitive parameter)."""

    b: int
    s: int
    fused: bool
    cache_layout: bool
    softcap: Optional[float]
    padding: bool  # the bias is the key padding alone: the kernel reads it as visibility
    has_bias: bool
    rate: Optional[float]  # attention-probability dropout

    @property
    def primals(self) -> int:  # the differentiable inputs: q, k, v (or qkv), bias
        return (1 if self.fused else 3) + self.has_bias

    def hand(self, res, *primals) -> Array:
        """The hand-written path on the same inputs (res: visible [B,T|1,S], dropout seed, scale)."""
        from jsteer.backbones.attention import dot_product_attention
        from jsteer.backbones.dropout import HashDropout

        q, k, v, bias = _split(self, primals)
        vis, seed, scale = res
        return dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            visible=vis[:, None, None],
            bias=bias,
            dropout=None if self.rate is None else HashDropout(seed, self.rate),
            cache_layout=self.cache_layout,
            softcap=self.softcap,
        )

    def backward(self, res, out, ct, want, *primals) -> Optional[tuple]:
        if self.cache_layout or self.softcap is not None or (self.has_bias and want[-1]):
            return None  # the kernel has no soft-capping, cache layout or bias cotangent
        n = self.primals - self.has_bias
        cts = kernel_grad.backward(self, res, out, ct, primals, functools.partial(_grads, spec=self), n)
        return (*cts, *((None,) if self.has_bias else ()))


def _split(spec: _Spec, primals) -> tuple:
    """-> q, k, v, bias (None)."""
    n = 1 if spec.fused else 3
    qkv = primals[0]
    operands = (qkv[:, :, 0, :, None], qkv[:, :, 1], qkv[:, :, 2]) if spec.fused else tuple(primals[:3])
    return (*operands, primals[n] if spec.has_bias else None)


def _dropout(spec: _Spec, seed: Array):
    return None if spec.rate is None else (seed, spec.rate)


def _kernel_operands(spec: _Spec, primals) -> tuple:
    """-> q, k, v (a fused projection: qkv, None, None) and the bias the kernels add (None: none, or the
    padding, read as visibility)."""
    q, k, v, bias = _split(spec, primals)
    add = None if bias is None or spec.padding else _per_query(bias, spec.b, spec.s)
    return (primals[0], None, None, add) if spec.fused else (q, k, v, add)


def _kernel(spec: _Spec, res, *primals) -> Array:
    q, k, v, add = _kernel_operands(spec, primals)
    vis, seed, scale = res
    return cpu.block_attention(
        q, k, v, vis, add, scale, spec.softcap, spec.cache_layout, spec.fused, dropout=_dropout(spec, seed)
    )


def _grads(res, ct: Array, out: Array, *primals, spec: _Spec) -> tuple:
    """The operands' cotangents by the backward kernel."""
    q, k, v, add = _kernel_operands(spec, primals)
    vis, seed, scale = res
    g = cpu.block_attention_grad(q, k, v, vis, add, scale, ct, out, spec.fused, _dropout(spec, seed))
    return (g,) if spec.fused else g


def _per_query(m: Array, b: int, s: int) -> Optional[Array]:
    """A mask/bias broadcastable to [B,K,G,T,S] that varies only over B, T and S, as [B,T|1,S]; else None."""
    m = m.reshape((1,) * (5 - m.ndim) + m.shape)
    if m.shape[1:3] != (1, 1):
        return None
    return jnp.broadcast_to(m[:, 0, 0], (b,) + m.shape[3:4] + (s,))


def _per_slot(m: Array, b: int, s: int) -> Optional[Array]:
    """A mask/bias broadcastable to [B,K,G,1,S] that varies only over B and S, as [B,S]; else None."""
    m = m.reshape((1,) * (5 - m.ndim) + m.shape)
    if m.shape[1:4] != (1, 1, 1):
        return None
    return jnp.broadcast_to(m[:, 0, 0, 0], (b, s))


def kernel_attention(q, k, v, scale, visible, bias, cache_layout, softcap, qkv, padding, dropout) -> Optional[Array]:
    """``attention.attention`` through jsteer's CPU kernels (fp32 inputs, kernels available), or None
    where they do not apply (then the caller takes the hand-written path). ``padding``: the bias is
    the key padding alone (0 or NEG_INF), handed to the block kernel as visibility. ``qkv``: the
    fused projection q, k and v were sliced from (read in place), or None. ``dropout``: None or a
    HashDropout (block calls only)."""
    b, t, kh, g, h = q.shape
    s = v.shape[2 if cache_layout else 1]
    if cache_layout and t == 1:
        vis = jnp.ones((b, s), bool) if visible is None else _per_slot(visible, b, s)
        add = None if bias is None else _per_slot(bias, b, s)
        if dropout is not None or vis is None or (bias is not None and add is None):
            return None
        return cpu.decode_attention(q[:, 0], k, v, vis, add, scale, softcap).reshape(b, 1, kh, g, h)
    vis = jnp.ones((b, 1, s), bool) if visible is None else _per_query(visible, b, s)
    bias_q = None if bias is None else _per_query(bias, b, s)
    if h % 16 or vis is None or (bias is not None and bias_q is None) or b * kh * g * t * s >= 2**32:
        return None
    if padding and bias_q is not None:  # the kernel then skips padded keys and adds nothing
        vis = vis & (bias_q > NEG_INF)
    fused = qkv is not None and not cache_layout
    rate = None if dropout is None else dropout.rate
    spec = _Spec(b, s, fused, cache_layout, softcap, padding, bias is not None, rate)
    seed = jnp.zeros((2,), jnp.uint32) if dropout is None else dropout.seed
    res = (vis, seed, jnp.asarray(scale, jnp.float32))
    primals = ((qkv,) if fused else (q, k, v)) + (() if bias is None else (bias,))

    return kernel_grad.differentiable(spec, functools.partial(_kernel, spec), res, primals)
