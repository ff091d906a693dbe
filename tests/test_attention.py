"""dot_product_attention against a NumPy re-derivation (MHA, grouped-query, bias, masks, dropout)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.attention import dot_product_attention


def reference(q, k, v, scale, bias=None, visible=None, keep=None, rate=0.0):
    """q [B,T,K,G,H], k/v [B,S,K,H] -> [B,T,K,G,H]; softmax with explicit probabilities."""
    scores = np.einsum("btkgh,bskh->bkgts", q, k) * scale
    if bias is not None:
        scores = scores + bias
    if visible is not None:
        scores = np.where(visible, scores, -1e30)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    if keep is not None:
        probs = np.where(keep, probs / (1.0 - rate), 0.0)
    return np.einsum("bkgts,bskh->btkgh", probs, v)


def random_qkv(rng, b, t, s, kh, g, h):
    """q [B,T,K,G,H], k and v [B,S,K,H], standard normal float32."""
    return tuple(
        rng.normal(size=shape).astype(np.float32) for shape in ((b, t, kh, g, h), (b, s, kh, h), (b, s, kh, h))
    )


@pytest.mark.parametrize("kh,g", [(4, 1), (2, 3)])
def test_matches_numpy_softmax_attention(kh, g):
    rng = np.random.default_rng(0)
    b, t, s, h = 2, 5, 7, 8
    q, k, v = random_qkv(rng, b, t, s, kh, g, h)
    bias = rng.normal(size=(b, 1, 1, t, s)).astype(np.float32)
    visible = rng.random((b, 1, 1, t, s)) > 0.3
    per_group = rng.normal(size=(1, kh, g, 1, s)).astype(np.float32)  # broadcast over queries only
    visible[0, 0, 0, 2] = False  # a row with no visible key: uniform weights, not NaN
    out = np.asarray(jax.jit(lambda *a: dot_product_attention(*a, scale=h**-0.5, bias=bias, visible=visible))(q, k, v))
    want = reference(q, k, v, h**-0.5, bias, visible)
    out2 = np.asarray(dot_product_attention(q, k, v, scale=h**-0.5, bias=per_group, visible=visible))
    np.testing.assert_allclose(out2, reference(q, k, v, h**-0.5, per_group, visible), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 2], np.broadcast_to(v[0].mean(0)[:, None], (kh, g, h)), atol=2e-5)


def test_dropout_on_unnormalised_weights_equals_dropout_on_probabilities():
    rng = np.random.default_rng(1)
    b, t, s, kh, h, rate = 2, 4, 4, 2, 8, 0.25
    q = rng.normal(size=(b, t, kh, 1, h)).astype(np.float32)
    k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    keep = rng.random((b, kh, t, s)) > rate  # the weights reach dropout as [B,K,G*T,S]
    drop = lambda w: jnp.where(keep, w / (1.0 - rate), 0.0)
    out = np.asarray(dot_product_attention(q, k, v, scale=0.3, dropout=drop))
    want = reference(q, k, v, 0.3, keep=keep[:, :, None], rate=rate)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_gradients_match_jax_reference():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 3, 2, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32)

    def naive(q, k, v):
        p = jax.nn.softmax(jnp.einsum("btkgh,bskh->bkgts", q, k) * 0.5, axis=-1)
        return jnp.einsum("bkgts,bskh->btkgh", p, v)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(lambda *a: dot_product_attention(*a, scale=0.5)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(naive), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_shapes():
    q = jnp.zeros((1, 3, 2, 1, 4))
    with pytest.raises(ValueError, match="attention"):
        dot_product_attention(q, jnp.zeros((1, 5, 3, 4)), jnp.zeros((1, 5, 3, 4)), scale=1.0)


@pytest.mark.parametrize("kh,g", [(3, 1), (1, 3)])
def test_cache_layout_is_the_same_attention(kh, g):
    """k [B,K,H,S] / v [B,K,S,H] (the KV cache's layout) give the attention of k, v [B,S,K,H]."""
    rng = np.random.default_rng(4)
    b, t, s, h = 2, 1, 9, 8
    q, k, v = random_qkv(rng, b, t, s, kh, g, h)
    visible = rng.random((b, 1, 1, t, s)) > 0.3
    out = np.asarray(
        dot_product_attention(
            q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), scale=0.3, visible=visible, cache_layout=True
        )
    )
    np.testing.assert_allclose(out, reference(q, k, v, 0.3, visible=visible), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(
        out, np.asarray(dot_product_attention(q, k, v, scale=0.3, visible=visible)), atol=1e-6, rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"k \[B,%d,%d,S\], v \[B,%d,S,%d\]" % (kh, h, kh, h)):
        dot_product_attention(q, k, v.transpose(0, 2, 1, 3), scale=0.3, cache_layout=True)


def test_kv_cache_write_places_new_slots_only():
    from jsteer.backbones.base import KVCache

    rng = np.random.default_rng(5)
    b, s, kh, h, t, index = 2, 7, 3, 4, 2, 3
    cache = KVCache.init(1, b, s, kh, h)
    assert cache.k[0].shape == (b, kh, h, s) and cache.v[0].shape == (b, kh, s, h)
    new_k = rng.normal(size=(b, t, kh, h)).astype(np.float32)
    new_v = rng.normal(size=(b, t, kh, h)).astype(np.float32)
    k, v = KVCache.write(cache.k[0], cache.v[0], new_k, new_v, jnp.int32(index))
    want_k, want_v = np.zeros((b, s, kh, h), np.float32), np.zeros((b, s, kh, h), np.float32)
    want_k[:, index : index + t], want_v[:, index : index + t] = new_k, new_v
    np.testing.assert_array_equal(np.asarray(k), want_k.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(np.asarray(v), want_v.transpose(0, 2, 1, 3))
