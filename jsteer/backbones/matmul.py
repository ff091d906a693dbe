"""Dense-layer contraction as one 2-D product, for Flax's ``dot_general=`` slot.

``dense_dot_general`` computes what ``lax.dot_general`` computes for a Dense / DenseGeneral layer
(the last k axes of x against the first k axes of the kernel) as one 2-D matmul [M, K] @ [K, N].
XLA:CPU runs the gradient of a dot over 3-D activations as a doubly transposed dot, ~1.6-2x slower
than the same gradient of the 2-D form (MiniLM FFN, 32 x 128 tokens, 384 -> 1536 fwd + bwd:
155.7 ms 3-D vs 107.8 ms 2-D; 1536 -> 384: 170.3 ms vs 119.2 ms; session 33). Plain autodiff of
the 2-D form is as fast as the hand-written backward it replaces (98.0 vs 98.2 ms, 91.9 vs 87.4 ms,
interleaved), and unlike a ``custom_vjp`` it supports forward-mode autodiff (jvp, jacfwd, hessian)
on every backend. Values are the same contraction as ``lax.dot_general``.

Any other contraction pattern (batch dims, different axes) falls through to ``lax.dot_general``.

``Linear`` is the layer both backbones build on: the same 2-D product, params laid out as
``nn.DenseGeneral``'s, and on CPU jsteer's packed-weight kernel when the call carries a "packed"
collection (generate's and ``LM.forward``'s).

``dot_fp32_out`` is the product for fp32 results of low-precision operands (the logits): fp32
accumulation and an fp32 output, while its derivatives run at the operands' precision. Plain
``preferred_element_type=float32`` would hand the backward fp32 cotangents against bf16 operands,
a mixed product GPUs run as an fp32 one (see its docstring).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jsteer.backbones import cpu

Array = jax.Array


def _matmul(x: Array, w: Array, precision, preferred_element_type) -> Array:
    """x [M,K] @ w [K,N] -> [M,N]."""
    return lax.dot_general(
        x, w, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type
    )


def dense_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None, preferred_element_type=None) -> Array:
    """Drop-in for ``lax.dot_general`` in ``nn.Dense(dot_general=...)`` / ``nn.DenseGeneral``.

    lhs [..., K1..Kk], rhs [K1..Kk, N1..Nm] contracted over the K axes -> [..., N1..Nm].
    """
    (lc, rc), (lb, rb) = dimension_numbers
    k = len(lc)
    dense_form = (
        not lb
        and not rb
        and k > 0
        and tuple(rc) == tuple(range(k))
        and tuple(a % lhs.ndim for a in lc) == tuple(range(lhs.ndim - k, lhs.ndim))
    )
    if not dense_form:
        return lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
        )
    lead, out = lhs.shape[: lhs.ndim - k], rhs.shape[k:]
    kdim = math.prod(rhs.shape[:k])
    y = _matmul(
        lhs.reshape(math.prod(lead), kdim), rhs.reshape(kdim, math.prod(out)), precision, preferred_element_type
    )
    return y.reshape(lead + out)


# nn.Dense / nn.DenseGeneral with the fast backward; same modules, same param names and layout.
Dense = functools.partial(nn.Dense, dot_general=dense_dot_general)
DenseGeneral = functools.partial(nn.DenseGeneral, dot_general=dense_dot_general)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def dot_fp32_out(lhs: Array, rhs: Array, dimension_numbers) -> Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` accumulated and returned in fp32.

    Tangents (and so, transposed, cotangents) are products at the operands' dtype, rounded there and
    handed on in fp32: with bf16 operands the backward's products are bf16 x bf16 like the forward's
    (HF's bf16 logits then ``.float()`` round their cotangents the same way) instead of fp32 x bf16,
    which XLA:GPU runs as an upcast fp32 product reading twice the bytes. fp32 operands: plain autodiff.
    """
    return lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32)


def _dot_fp32_out_jvp(dimension_numbers, primals, tangents):
    lhs, rhs = primals
    out = dot_fp32_out(lhs, rhs, dimension_numbers)
    parts = []
    if not isinstance(tangents[0], SymbolicZero):
        parts.append(lax.dot_general(tangents[0].astype(lhs.dtype), rhs, dimension_numbers))
    if not isinstance(tangents[1], SymbolicZero):
        parts.append(lax.dot_general(lhs, tangents[1].astype(rhs.dtype), dimension_numbers))
    tangent = functools.reduce(lambda a, b: a + b, (p.astype(jnp.float32) for p in parts))
    return out, tangent


dot_fp32_out.defjvp(_dot_fp32_out_jvp, symbolic_zeros=True)


def bias_tangent(db: Array, rows: int, dtype) -> Array:
    """The tangent [rows, N] of adding db [N] to every row, as a product with a column of ones, so
    that the bias gradient (its transpose) is the dot ones^T dy: XLA:CPU runs the column sum a plain
    broadcast transposes to as a tree of reduce-windows at a tenth of the read bandwidth (MiniLM's
    FFN bias, 4096 x 1536: ~16 ms a layer), the dot at about the bandwidth."""
    ones = jnp.ones((rows, 1), db.dtype)
    return lax.dot_general(ones, db.reshape(1, -1), (((1,), (0,)), ((), ()))).astype(dtype)


@jax.custom_jvp
def add_bias(y: Array, b: Array) -> Array:
    """y [M, N] + b [N]; its bias tangent by :func:`bias_tangent`."""
    return y + b


def _add_bias_jvp(primals, tangents):
    y, b = primals
    dy, db = tangents
    out = add_bias(y, b)
    parts = [] if isinstance(dy, SymbolicZero) else [dy.astype(out.dtype)]
    if not isinstance(db, SymbolicZero):
        parts.append(bias_tangent(db, y.shape[0], out.dtype))
    return out, functools.reduce(lambda a, c: a + c, parts) if parts else jnp.zeros_like(out)


add_bias.defjvp(_add_bias_jvp, symbolic_zeros=True)


class Linear(nn.Module):
    """y = x W (+ b) with W stored [*in_shape, *features] (``nn.DenseGeneral``'s layout): the last
    ``in_axes`` dims of x are contracted as one 2-D product (the fast form on every backend, and
    forward-mode differentiable). On CPU it multiplies through ``cpu.packed_matmul`` when the
    "packed" collection holds this kernel (the layer's kernel as [in, out], ``cpu.pack`` ed)."""

    features: Tuple[int, ...]
    in_axes: int = 1
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    fp32_out: bool = False  # fp32 results (the logits) through dot_fp32_out
    kernel_init: Callable = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape = x.shape[x.ndim - self.in_axes :]
        lead = x.shape[: x.ndim - self.in_axes]
        kernel = self.param("kernel", self.kernel_init, in_shape + tuple(self.features), self.param_dtype)
        k, n = math.prod(in_shape), math.prod(self.features)
        x2 = x.reshape(-1, k).astype(self.dtype)
        packed = self.get_variable("packed", "kernel") if self.has_variable("packed", "kernel") else None
        bias = None
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, tuple(self.features), self.param_dtype)
            bias = bias.reshape(n).astype(self.dtype)
        if packed is not None and self.dtype == jnp.float32:  # x2 is in self.dtype
            w = kernel.reshape(k, n)
            y = cpu.packed_matmul(x2, w, packed) if bias is None else cpu.packed_affine(x2, w, packed, bias)
            return y.reshape(lead + tuple(self.features))
        if self.fp32_out:
            y = dot_fp32_out(x2, kernel.reshape(k, n).astype(self.dtype), (((1,), (0,)), ((), ())))
        else:
            # products in the layer's dtype: bf16 ones accumulate in fp32 on every backend (cuBLAS
            # compute type, TPU MXU, XLA:CPU's upcast), and their backward stays bf16 x bf16
            y = lax.dot_general(x2, kernel.reshape(k, n).astype(self.dtype), (((1,), (0,)), ((), ())))
        if bias is not None:
            y = add_bias(y, bias)
        return y.reshape(lead + tuple(self.features))


def pack_kernels(params: dict, in_axes: Callable[[Tuple[str, ...]], int], skip: Tuple[str, ...] = ()) -> dict:
    """The "packed" collection of a params tree: every ``kernel`` of 2+ dims packed for
    ``cpu.small_gemm`` as its 2-D [in, out] form (``in_axes(path)`` leading dims are the input),
    at the same path; a subtree named "layers" (a scanned stack) packed per layer, stacked.
    Top-level keys in ``skip`` are left out. Pure; call it under jit."""

    def pack(path, v):
        n_in = in_axes(path) + (path[0] == "layers")
        lead = 1 if path[0] == "layers" else 0
        flat = v.reshape(v.shape[:lead] + (math.prod(v.shape[lead:n_in]), -1))
        return jax.vmap(cpu.pack)(flat) if lead else cpu.pack(flat)

    def walk(tree, path):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                sub = walk(v, path + (k,))
                if sub:
                    out[k] = sub
            elif k == "kernel" and getattr(v, "ndim", 0) >= 2:
                out[k] = pack(path + (k,), v)
        return out

    return walk({k: v for k, v in params.items() if k not in skip}, ())
