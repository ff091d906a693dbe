"""Hash-mask dropout: the Bernoulli keep mask and scaling of flax's Dropout, reproducible per key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.dropout import Dropout, hash_bits, keep_mask


def _apply(rate, x, key, deterministic=False):
    return Dropout(rate).apply({}, x, deterministic=deterministic, rngs={"dropout": key})


def test_keep_rate_scaling_and_identity():
    x = jnp.ones((64, 128, 96), jnp.float32)
    for rate in (0.1, 0.5, 0.9):
        y = np.asarray(_apply(rate, x, jax.random.key(0)))
        kept = y != 0
        n = kept.size
        # binomial: 6 standard deviations
        assert abs(kept.mean() - (1 - rate)) < 6 * np.sqrt(rate * (1 - rate) / n), rate
        np.testing.assert_allclose(y[kept], 1.0 / (1.0 - rate), rtol=1e-6)
    assert np.array_equal(np.asarray(_apply(0.3, x, jax.random.key(0), deterministic=True)), np.asarray(x))
    assert np.array_equal(np.asarray(_apply(0.0, x, jax.random.key(0))), np.asarray(x))
    assert not np.asarray(_apply(1.0, x, jax.random.key(0))).any()


def test_mask_depends_on_key_only_and_is_unbiased_per_position():
    shape = (32, 12, 64, 64)
    a = np.asarray(keep_mask(jax.random.key(1), shape, 0.1))
    assert np.array_equal(a, np.asarray(keep_mask(jax.random.key(1), shape, 0.1)))  # reproducible
    b = np.asarray(keep_mask(jax.random.key(2), shape, 0.1))
    assert (a != b).mean() == pytest.approx(2 * 0.1 * 0.9, abs=0.005)  # independent keys
    # no structure along any axis: keep rate per index of each axis stays near 0.9
    for axis in range(4):
        per = a.mean(axis=tuple(i for i in range(4) if i != axis))
        m = a.size // a.shape[axis]
        assert np.abs(per - 0.9).max() < 6 * np.sqrt(0.09 / m), axis
    # neighbouring elements are uncorrelated
    f = a.reshape(-1).astype(np.float64)
    assert abs(np.corrcoef(f[:-1], f[1:])[0, 1]) < 0.01
    assert abs(np.corrcoef(f[:-64], f[64:])[0, 1]) < 0.01


def test_bits_are_uniform_bytes():
    bits = np.asarray(hash_bits(jnp.asarray([7, 11], jnp.uint32), (1 << 20,)))
    for shift in (0, 8, 16, 24):
        counts = np.bincount((bits >> shift) & 0xFF, minlength=256)
        chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
        assert chi2 < 400, (shift, chi2)  # 255 dof: mean 255, sd ~22.6


def test_gradient_is_the_mask_scaled_and_jit_matches_eager():
    x = jax.random.normal(jax.random.key(3), (8, 16))
    key = jax.random.key(4)
    g = jax.grad(lambda x: _apply(0.25, x, key).sum())(x)
    y = np.asarray(_apply(0.25, x, key))
    np.testing.assert_allclose(np.asarray(g), (y != 0) / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: _apply(0.25, x, key))(x)), y)


def test_bad_rate():
    with pytest.raises(ValueError, match="rate"):
        keep_mask(jax.random.key(0), (4,), 1.5)
