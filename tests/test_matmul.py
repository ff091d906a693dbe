"""dense_dot_general: same values and gradients as lax.dot_general (a 2-D product), forward-mode too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.matmul import Dense, DenseGeneral, dense_dot_general


@pytest.mark.parametrize(
    "make",
    [
        lambda dg: nn.Dense(5, dot_general=dg),
        lambda dg: nn.DenseGeneral((3, 2), dot_general=dg),  # kernel [D, 3, 2]
        lambda dg: nn.DenseGeneral(4, axis=(-2, -1), dot_general=dg),  # kernel [N, H, 4]
    ],
)
def test_values_and_gradients_match_plain_dot_general(make):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 6)), jnp.float32)
    fast, plain = make(dense_dot_general), make(jax.lax.dot_general)
    params = plain.init(jax.random.PRNGKey(0), x)

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x)) * jnp.arange(1.0, 1.0 + module.apply(p, x).shape[-1]))

    np.testing.assert_array_equal(np.asarray(fast.apply(params, x)), np.asarray(plain.apply(params, x)))
    got = jax.jit(jax.grad(loss(fast), argnums=(0, 1)))(params, x)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_gradients_keep_input_dtypes():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 3), jnp.bfloat16)
    f = lambda x, w: dense_dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32).sum()
    dx, dw = jax.grad(f, argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dw, np.float32), 4.0)


def test_other_contractions_fall_through():
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 3, 4), (2, 4, 5)))
    dims = (((2,), (1,)), ((0,), (0,)))  # batched
    np.testing.assert_array_equal(
        np.asarray(dense_dot_general(a, b, dims)), np.asarray(jax.lax.dot_general(a, b, dims))
    )


def test_partials_are_flax_modules_with_the_usual_param_names():
    p = Dense(3).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))["params"]
    assert set(p) == {"kernel", "bias"} and p["kernel"].shape == (4, 3)
    p = DenseGeneral((2, 3)).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))["params"]
    assert p["kernel"].shape == (4, 2, 3)


def test_forward_mode_autodiff():
    """jvp / jacfwd through the 2-D form (a custom_vjp would refuse them)."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 4)), jnp.float32)
    layer = DenseGeneral((2, 3))
    p = layer.init(jax.random.PRNGKey(0), x)
    f = lambda x: jnp.tanh(layer.apply(p, x)).sum()  # noqa: E731
    v = jnp.ones_like(x)
    _, t = jax.jvp(f, (x,), (v,))
    np.testing.assert_allclose(float(t), float(jnp.vdot(jax.grad(f)(x), v)), rtol=1e-5)
    assert jax.jacfwd(f)(x).shape == x.shape
