"""The logistic probe: a linear classifier on standardised features, trained full-batch.

    probe = fit_logistic(x, y, l2=1e-2, steps=300, lr=0.1)   # x [N, D], y [N] in {0, 1}
    p = probe.prob(x_new)                                     # [M] P(y = 1)
    w, b = probe.direction()                                  # raw-feature weights (a concept vector)

Features are standardised with their mean and standard deviation (+1e-6); the weights start at
zero and take ``steps`` full-batch Adam steps on the mean binary cross-entropy plus
``l2 * ||w||^2``. The whole fit is one ``lax.scan``: it jits, and vmaps over stacked feature
sets (one probe per layer, :func:`jsteer.typevec.analysis.layer_probes`). A probe is a pytree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

Array = jax.Array


class LogisticProbe(NamedTuple):
    """w [D] and b [] act on standardised features (x - mu) / sd; mu, sd [D]."""

    w: Array
    b: Array
    mu: Array
    sd: Array

    def logits(self, x: Array) -> Array:
        """x [..., D] -> [...] log-odds of class 1."""
        return ((x - self.mu) / self.sd) @ self.w + self.b

    def prob(self, x: Array) -> Array:
        """x [..., D] -> [...] P(class 1)."""
        return jax.nn.sigmoid(self.logits(x))

    def direction(self) -> tuple[Array, Array]:
        """(w [D], b []) on the raw features: ``x @ w + b`` equals :meth:`logits`."""
        w = self.w / self.sd
        return w, self.b - jnp.dot(self.mu, w)


@functools.partial(jax.jit, static_argnames=("steps",))
def fit_logistic(x: Array, y: Array, l2: float = 1e-2, steps: int = 300, lr: float = 0.1) -> LogisticProbe:
    """Logistic regression of ``y`` [N] (0 / 1) on ``x`` [N, D] -> :class:`LogisticProbe`."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xs = (x - mu) / sd

    def loss(p):
        z = xs @ p["w"] + p["b"]
        return jnp.mean(optax.sigmoid_binary_cross_entropy(z, y)) + l2 * jnp.sum(p["w"] ** 2)

    opt = optax.adam(lr)
    p = {"w": jnp.zeros(x.shape[1]), "b": jnp.zeros(())}

    def step(carry, _):
        p, s = carry
        upd, s = opt.update(jax.grad(loss)(p), s, p)
        return (optax.apply_updates(p, upd), s), None

    (p, _), _ = jax.lax.scan(step, (p, opt.init(p)), None, length=steps)
    return LogisticProbe(p["w"], p["b"], mu, sd)
