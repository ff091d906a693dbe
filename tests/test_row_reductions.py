"""Row maxima / minima folded over 16-lane slices (jsteer.backbones.base.row_max, row_min,
logsumexp): the same values as XLA's reduce, bit for bit, and the fold really in the programs."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer import sampling
from jsteer.backbones.attention import dot_product_attention
from jsteer.backbones.base import logsumexp, row_max, row_min

# below 32 lanes and off the 16-lane grid: the plain reduce; 48..1024: one tree of slices; above
# 1024: a reduce over a [.., n / c, c] view first (c = 1024, 256 for Llama-3's 128256, 128 for Qwen's 151936)
WIDTHS = [1, 8, 16, 24, 32, 48, 128, 1000, 1024, 1040, 2048, 49152, 128256, 151936]


def _rows(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype(np.float32) * 4
    x[1, :] = -np.inf
    x[2, n // 3] = np.inf
    x[3, (n - 1) // 2] = np.nan
    x[4, :] = 1.5
    return x


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_row_max_and_min_are_the_plain_reduce_bit_for_bit(n, dtype):
    x = _rows(n) if dtype != np.int32 else np.random.default_rng(n).integers(-(10**6), 10**6, (5, n), np.int32)
    x = jnp.asarray(x, dtype)
    for fold, plain in ((row_max, jnp.max), (row_min, jnp.min)):
        got = np.asarray(jax.jit(fold)(x))
        want = np.asarray(jax.jit(lambda x, plain=plain: plain(x, axis=-1, keepdims=True))(x))
        assert got.shape == (5, 1) and got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))  # NaN == NaN here


def _reduced_widths(fn, *args) -> list:
    """The operand width of every max / min reduction over a last axis in fn's program."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("reduce_max", "reduce_min", "argmax"):
                shape = eqn.invars[0].aval.shape
                if len(shape) - 1 in eqn.params["axes"]:
                    yield shape[-1]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_programs_reduce_at_most_16_lanes_on_cpu():
    # XLA:CPU reduces a minor axis with max 7x slower than the fold (MiniLM's scores 3.7 -> 0.5 ms):
    # the attention softmax, greedy decoding and the LM losses must not go back to the plain reduce
    assert jax.default_backend() == "cpu"
    q = jnp.ones((2, 128, 4, 1, 16))
    kv = jnp.ones((2, 128, 4, 16))
    logits = jnp.ones((3, 49152))
    for name, fn, args in (
        ("attention", lambda q, k, v: dot_product_attention(q, k, v, scale=0.25), (q, kv, kv)),
        ("argmax_tokens", sampling.argmax_tokens, (logits,)),
        ("logsumexp", logsumexp, (logits,)),
    ):
        widths = _reduced_widths(fn, *args)
        assert widths and max(widths) <= 16, (name, widths)
    assert _reduced_widths(lambda x: x.max(-1), logits) == [49152]  # the check sees a plain reduce


@pytest.mark.parametrize("n", [24, 128, 49152])
def test_logsumexp_is_jax_logsumexp_with_its_gradients(n):
    x = jnp.asarray(_rows(n)[[0, 1, 2, 4]])  # no NaN row: its gradient is NaN either way
    want = jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1))(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(logsumexp)(x)), np.asarray(want))
    y = x.at[1:3].set(0.0)  # finite rows for the derivatives
    w = jnp.arange(4.0)
    g_want = jax.grad(lambda y: (jax.nn.logsumexp(y, axis=-1) * w).sum())(y)
    g_got = jax.grad(lambda y: (logsumexp(y) * w).sum())(y)
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-6, atol=1e-9)
    t = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape).astype(np.float32))
    jv = jax.jvp(logsumexp, (y,), (t,))[1]
    jv_want = jax.jvp(lambda y: jax.nn.logsumexp(y, axis=-1), (y,), (t,))[1]
    np.testing.assert_allclose(np.asarray(jv), np.asarray(jv_want), rtol=1e-5, atol=1e-6)
