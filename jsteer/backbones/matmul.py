"""Dense-layer contraction with a hand-written backward pass, for Flax's ``dot_general=`` slot.

``dense_dot_general`` computes what ``lax.dot_general`` computes for a Dense / DenseGeneral
layer (the last k axes of x against the first k axes of the kernel) as one 2-D matmul
[M, K] @ [K, N], and gives it an explicit VJP: dx = g @ W^T and dW = x^T @ g, both written as
contractions XLA:CPU sends to its fast GEMM path. Under plain autodiff XLA:CPU transposes the
cotangent in memory and runs the weight gradient as a doubly transposed dot that is ~4x slower
(MiniLM FFN, 4096 tokens: 137 ms -> 84 ms forward+backward). Values and gradients are the same
contractions, so results match ``lax.dot_general`` bit for bit in fp32.

Any other contraction pattern (batch dims, different axes) falls through to ``lax.dot_general``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jsteer.backbones import cpu

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x: Array, w: Array, precision, preferred_element_type) -> Array:
    """x [M,K] @ w [K,N] -> [M,N]."""
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=preferred_element_type)


def _matmul_fwd(x, w, precision, preferred_element_type):
    return _matmul(x, w, precision, preferred_element_type), (x, w)


def _matmul_bwd(precision, preferred_element_type, res, g):
    x, w = res
    dx = lax.dot_general(g, w, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=preferred_element_type)
    dw = lax.dot_general(x, g, (((0,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=preferred_element_type)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                      preferred_element_type=None) -> Array:
    """Drop-in for ``lax.dot_general`` in ``nn.Dense(dot_general=...)`` / ``nn.DenseGeneral``.

    lhs [..., K1..Kk], rhs [K1..Kk, N1..Nm] contracted over the K axes -> [..., N1..Nm].
    """
    (lc, rc), (lb, rb) = dimension_numbers
    k = len(lc)
    dense_form = (not lb and not rb and k > 0 and tuple(rc) == tuple(range(k))
                  and tuple(a % lhs.ndim for a in lc) == tuple(range(lhs.ndim - k, lhs.ndim)))
    if not dense_form:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
    lead, out = lhs.shape[:lhs.ndim - k], rhs.shape[k:]
    kdim = math.prod(rhs.shape[:k])
    y = _matmul(lhs.reshape(math.prod(lead), kdim), rhs.reshape(kdim, math.prod(out)), precision,
                preferred_element_type)
    return y.reshape(lead + out)


# nn.Dense / nn.DenseGeneral with the fast backward; same modules, same param names and layout.
Dense = functools.partial(nn.Dense, dot_general=dense_dot_general)
DenseGeneral = functools.partial(nn.DenseGeneral, dot_general=dense_dot_general)


# ----------------------------------------------------------------------------- decoding on CPU
# A decode step multiplies B rows by every weight. For few rows XLA:CPU's dot reads the weights
# at about half the memory bandwidth; jsteer.backbones.cpu.small_gemm reads a packed copy at
# close to full. decode.generate packs the weights once per param set (``pack_decoder_params``)
# into the "packed" collection; the layers below use it when it is there and the row count fits.


def _through_kernel(x: Array, layer_dtype, packed: Optional[Array], n: int) -> Optional[Array]:
    """x [..., K] @ (the [K, n] weight packed in ``packed``) -> [..., n] via ``cpu.small_gemm``, or
    None when the kernel does not apply: no packed weight, a layer or input that is not fp32, or a
    row count outside [cpu.MIN_ROWS, cpu.MAX_ROWS]."""
    rows = math.prod(x.shape[:-1])
    if (packed is None or layer_dtype not in (None, jnp.float32) or x.dtype != jnp.float32
            or not cpu.MIN_ROWS <= rows <= cpu.MAX_ROWS):
        return None
    return cpu.small_gemm(x.reshape(rows, x.shape[-1]), packed, n).reshape(x.shape[:-1] + (n,))


def _packed(module: nn.Module, name: str) -> Optional[Array]:
    return module.get_variable("packed", name) if module.has_variable("packed", name) else None


class PackedDense(nn.Dense):
    """``Dense`` that multiplies through ``cpu.small_gemm`` when the "packed" collection holds
    this layer's packed kernel and x has few rows (fp32); otherwise exactly ``Dense``."""

    dot_general: Any = dense_dot_general

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        y = _through_kernel(inputs, self.dtype, _packed(self, "kernel"), self.features)
        if y is None:
            return super().__call__(inputs)
        return y + self.get_variable("params", "bias") if self.use_bias else y


def attend(lm: nn.Module, embed: nn.Embed, h: Array) -> Array:
    """Tied output layer: ``embed.attend(h)`` [..., D] -> [..., V], through ``cpu.small_gemm``
    when ``lm``'s "packed" collection holds ``<embed name>_attend`` (E^T packed) and h has few rows."""
    y = _through_kernel(h, embed.dtype, _packed(lm, f"{embed.name}_attend"), embed.num_embeddings)
    return embed.attend(h) if y is None else y


def pack_decoder_params(params: dict, tied_embedding: Optional[str]) -> dict:
    """The "packed" collection for ``PackedDense`` / ``attend``: every 2-D ``kernel`` [K, N] in
    ``params`` packed for ``cpu.small_gemm`` at the same path, plus ``<tied_embedding>_attend``
    (the tied embedding's transpose, packed) when a name is given. Pure; call it under jit."""

    def walk(tree):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                sub = walk(v)
                if sub:
                    out[k] = sub
            elif k == "kernel" and getattr(v, "ndim", 0) == 2:
                out[k] = cpu.pack(v)
        return out

    packed = walk(params)
    if tied_embedding is not None:
        packed[f"{tied_embedding}_attend"] = cpu.pack(params[tied_embedding]["embedding"].T)
    return packed
