"""LayerNorm through jsteer's CPU kernel (``cpu.layer_norm``, its reverse mode ``cpu.layer_norm_grad``),
differentiable in both modes (:mod:`jsteer.backbones.kernel_grad`), and :class:`LayerNorm`: flax's
LayerNorm (same params, same values) whose call can take it.

Shapes: x [..., D] (D a multiple of 16), scale and bias [D] -> [..., D], all fp32.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jsteer.backbones import cpu, kernel_grad

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Rule:
    eps: float

    def hand(self, res, x, scale, bias) -> Array:
        """The same function in jax.numpy (mean and variance in two passes, as the kernel)."""
        mean = x.mean(-1, keepdims=True)
        z = x - mean
        return z * jax.lax.rsqrt((z * z).mean(-1, keepdims=True) + self.eps) * scale + bias

    def backward(self, res, out, ct, want, x, scale, bias):
        def grads(res, ct, out, x, scale, bias):
            return cpu.layer_norm_grad(x, scale, ct, self.eps)

        return kernel_grad.backward(self, res, out, ct, (x, scale, bias), grads, 3)


def applies(x: Array) -> bool:
    """Whether :func:`layer_norm` takes the kernel: fp32, the last axis a multiple of 16, kernels available."""
    return x.dtype == jnp.float32 and x.ndim >= 2 and x.shape[-1] % 16 == 0 and x.size > 0 and cpu.available()


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm of x over its last axis by the CPU kernel (callers check :func:`applies`)."""
    rule = _Rule(float(eps))

    def kernel(res, x, scale, bias):
        return cpu.layer_norm(x, scale, bias, eps=rule.eps)

    return kernel_grad.differentiable(rule, kernel, (), (x.reshape(-1, x.shape[-1]), scale, bias)).reshape(x.shape)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm``; ``kernel=True`` (scale and bias, the last axis) computes it by
    jsteer's CPU kernel where :func:`applies` holds: the same function to rounding (two-pass variance)."""

    @nn.compact
    def __call__(self, x, *, mask=None, kernel: bool = False):
        if kernel and mask is None and self.use_scale and self.use_bias and self.reduction_axes == -1 and applies(x):
            d = x.shape[-1]
            scale = self.param("scale", self.scale_init, (d,), self.param_dtype)
            bias = self.param("bias", self.bias_init, (d,), self.param_dtype)
            return layer_norm(x, scale, bias, self.epsilon)
        return super().__call__(x, mask=mask)


__all__ = ["LayerNorm", "applies", "layer_norm"]
