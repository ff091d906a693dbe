"""Type vectors from a handful of example tokens (Saeed & Papotti, "You Are My Type!").

A type is given by N example tokens; their input-embedding rows X [N, D] define it.

* ``method="svd"``: the first right-singular vector v1 of the *uncentred* X.
  SVD fixes v1 only up to sign, so we fix it explicitly: v1 is oriented so that
  ``v1 . mean(X) <= 0`` and the type embedding is ``TE = -v1``; hence
  ``TE . mean(X) >= 0`` always: TE points towards the examples. The paper's code takes
  ``-vt[0]`` from ``numpy.linalg.svd``; LAPACK happens to return the orientation with
  ``vt[0] . mean(X) < 0`` for most types (15 of the 17 KG types on MiniLM embeddings in our
  check), so our TE equals the paper's wherever LAPACK's sign did, and is deterministic
  (pointing towards the examples) where it did not.
  TE has unit norm; the strength lambda is applied at injection time, always as
  ``+lambda * TE`` with lambda >= 0 (the paper's ``k * concept_vector``, k = 0..5).
  On SmolLM2-135M's City examples LAPACK's ``vt[0] . mean(X) < 0`` too, so TE is exactly the
  paper's ``-vt[0]``; it is nearly parallel to the examples' mean (cos 0.997) and to the mean
  of the whole vocabulary (cos 0.84): SmolLM2's input embeddings are strongly anisotropic.
  The paper does not drop or centre anything (``-vt[0]`` of the raw rows); ``center=``
  below is our optional variant, and the second singular direction is not used.
  Measured sign effect on SmolLM2 (50 City/place_of_death prompts; softmax mass on the
  City tokens, 0.014 without TE): added to the residual stream after layer 26, +TE raises it
  monotonically (0.150 at 0.35 residual-norm units) while -TE lowers it (0.008): +lambda*TE
  with this orientation is the direction "towards the type". Added to the *input* embedding
  of a decoder, both signs merely perturb the prediction (peaks 0.040 for +TE, 0.033 for
  -TE, at every prompt token; see :mod:`jsteer.typevec.inject` for why). Files:
  experiments/results/typevec/diag_*_smollm2.*
* ``method="mean"``: the mean example embedding (the paper's baseline; not normalised).

Both are pure and jittable: pass a padded id array with ``mask`` for a variable number of
examples (zero rows change neither the right-singular vectors nor the masked mean).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray

METHODS = ("svd", "mean")


def check_ids(token_ids, vocab_size: int, mask=None) -> None:
    """Raise ValueError for example ids outside [0, vocab_size) (masked-out ids are not checked).

    Only concrete ids are checked; traced ids (under ``jit`` / ``vmap``) pass through, see
    :func:`example_rows` for what happens to them there."""
    if isinstance(token_ids, jax.core.Tracer) or isinstance(mask, jax.core.Tracer):
        return
    ids = np.asarray(token_ids)
    if mask is not None:
        ids = ids[np.asarray(mask) != 0]
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"example token ids {sorted(set(bad.tolist()))[:10]} are outside the vocabulary [0, {vocab_size})"
        )


def example_rows(embedding: Array, token_ids: Array, mask: Optional[Array] = None) -> Array:
    """Gather example rows. embedding [V, D], token_ids [N] int, mask [N] -> X [N, D] (masked rows 0).

    Concrete ids outside [0, V) are a ValueError. Under ``jit`` the ids cannot be checked: an
    unmasked out-of-range id (negative ones included; they do not wrap around) gives a NaN row,
    hence a NaN type vector, never a silently wrong one. Masked-out ids may be anything."""
    if embedding.ndim != 2:
        raise ValueError(f"embedding must be [V, D], got shape {embedding.shape}")
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"token_ids must be a non-empty [N] vector of example token ids, got shape {token_ids.shape}")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != token_ids.shape:
            raise ValueError(f"mask shape {mask.shape} must match token_ids shape {token_ids.shape}")
    vocab = embedding.shape[0]
    check_ids(token_ids, vocab, mask)
    # jnp.take wraps negative ids and fills ids >= V with NaN: send negative ids to V as well
    safe = jnp.where(token_ids < 0, vocab, token_ids)
    x = jnp.take(embedding, safe, axis=0, mode="fill", fill_value=jnp.nan).astype(jnp.float32)
    if mask is not None:
        x = jnp.where(mask[:, None] != 0, x * mask.astype(x.dtype)[:, None], 0.0)
    return x


def orient(v: Array, reference: Array) -> Array:
    """Flip v [D] so that ``v . reference >= 0``; when the dot is 0 the largest-|.| entry of v
    is made positive (a deterministic tie-break)."""
    dot = jnp.vdot(v, reference)
    tie = v[jnp.argmax(jnp.abs(v))]
    s = jnp.where(dot != 0, jnp.sign(dot), jnp.where(tie != 0, jnp.sign(tie), 1.0))
    return v * s


def singular_vectors(x: Array) -> tuple[Array, Array]:
    """Raw SVD of X [N, D] -> (singular values [K], right-singular vectors [K, D]),
    K = min(N, D), with whatever sign LAPACK returns."""
    _, s, vt = jnp.linalg.svd(x, full_matrices=False)
    return s, vt


def make(
    embedding: Array,
    token_ids: Array,
    method: str = "svd",
    mask: Optional[Array] = None,
    center: Optional[Array] = None,
) -> Array:
    """Type embedding TE [D] from example tokens.

    embedding: [V, D] input-embedding matrix; token_ids: [N] example ids; mask: [N] (1 = use).
    ``svd``: TE = -v1 with v1 . mean(X) <= 0 (unit norm, see module docstring).
    ``mean``: TE = masked mean of the example rows.
    center: optional [D] vector subtracted from every example row first (e.g. the mean of the
      whole vocabulary, :func:`vocab_center`): in strongly anisotropic embedding spaces the
      uncentred v1 is mostly the direction shared by *all* tokens; centring keeps what is
      specific to the type. Not in the paper (whose default, ``None``, is kept here).
    Jittable (``method`` static). Concrete ids outside [0, V) raise ValueError; traced ones
    cannot be checked and give a NaN TE (see :func:`example_rows`).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    x = example_rows(embedding, token_ids, mask)
    if center is not None:
        x = x - jnp.asarray(center, x.dtype)[None, :]
        if mask is not None:
            x = jnp.where(jnp.asarray(mask)[:, None] != 0, x, 0.0)
    if mask is None:
        mean = jnp.mean(x, axis=0)
    else:
        mean = jnp.sum(x, axis=0) / jnp.maximum(jnp.sum(jnp.asarray(mask, x.dtype)), 1.0)
    if method == "mean":
        return mean
    _, vt = singular_vectors(x)
    v1 = -orient(vt[0], mean)  # v1 . mean <= 0 ...
    return -v1  # ... so TE = -v1 points towards the examples


def vocab_center(embedding: Array) -> Array:
    """Mean input-embedding row [D] (the reference for ``make(..., center=...)``)."""
    return jnp.mean(jnp.asarray(embedding, jnp.float32), axis=0)


def make_all(
    embedding: Array,
    token_ids: Array,
    mask: Optional[Array] = None,
    method: str = "svd",
    center: Optional[Array] = None,
) -> Array:
    """Several types at once: token_ids [K, N], mask [K, N], center [D] -> TEs [K, D] (vmapped :func:`make`)."""
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 2 or 0 in token_ids.shape:
        raise ValueError(f"token_ids must be a non-empty [K, N] array for make_all, got shape {token_ids.shape}")
    if mask is None:
        mask = jnp.ones(token_ids.shape, jnp.float32)
    mask = jnp.asarray(mask)
    if mask.shape != token_ids.shape:
        raise ValueError(f"mask shape {mask.shape} must match token_ids shape {token_ids.shape}")
    check_ids(token_ids, embedding.shape[0], mask)  # inside vmap the ids are traced
    return jax.vmap(lambda t, m: make(embedding, t, method, m, center))(token_ids, mask)


def project_out(te_a: Array, te_b: Array) -> Array:
    """E_a minus its projection on E_b: E_a - (E_a.E_b / |E_b|^2) E_b (the paper's E_city^optim).

    For unit vectors this is the paper's ``city -= cos(city, year) * year``. Not renormalised.
    """
    denom = jnp.vdot(te_b, te_b)
    return te_a - (jnp.vdot(te_a, te_b) / jnp.where(denom > 0, denom, 1.0)) * te_b


def combine(tes: Sequence[Array] | Array, coefs: Sequence[float] | Array) -> Array:
    """Linear combination sum_k c_k TE_k (sums with +1, differences with -1). tes [K, D] -> [D]."""
    if len(tes) == 0:
        raise ValueError("combine needs at least one type vector (got none)")
    tes = jnp.stack([jnp.asarray(t) for t in tes]) if isinstance(tes, (list, tuple)) else jnp.asarray(tes)
    coefs = jnp.asarray(coefs, tes.dtype)
    if coefs.shape != tes.shape[:1]:
        raise ValueError(f"need one coefficient per type vector: {coefs.shape} vs {tes.shape[:1]}")
    return jnp.einsum("k,kd->d", coefs, tes)


def normalize(v: Array, eps: float = 1e-12) -> Array:
    """v / |v| (v [..., D])."""
    return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), eps)
