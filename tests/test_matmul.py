"""dense_dot_general: same values and gradients as lax.dot_general (a 2-D product), forward-mode too;
dot_fp32_out: fp32 results of bf16 operands whose derivatives are bf16 products."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.matmul import Dense, DenseGeneral, add_bias, dense_dot_general, dot_fp32_out


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


NT = (((2,), (1,)), ((), ()))  # h [B,T,D] against a table [V,D] -> [B,T,V]


def _products(fn, *args):
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "dot_general"]


def test_dot_fp32_out_values_and_bf16_backward():
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.bfloat16)
    table = jnp.asarray(rng.normal(size=(40, 16)), jnp.bfloat16)
    plain = jax.lax.dot_general(h, table, NT, preferred_element_type=jnp.float32)
    got = dot_fp32_out(h, table, NT)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))

    g = jnp.asarray(rng.normal(size=plain.shape), jnp.float32)  # an fp32 cotangent, as a loss hands it
    dh, dt = jax.grad(lambda h, t: jnp.sum(dot_fp32_out(h, t, NT) * g), (0, 1))(h, table)
    assert dh.dtype == dt.dtype == jnp.bfloat16
    # what they are: the cotangent rounded to bf16, then bf16 products (re-derived in fp64)
    g16 = np.asarray(g.astype(jnp.bfloat16), np.float64)
    want_dh = np.einsum("btv,vd->btd", g16, np.asarray(table, np.float64))
    want_dt = np.einsum("btv,btd->vd", g16, np.asarray(h, np.float64))
    np.testing.assert_allclose(np.asarray(dh, np.float64), want_dh, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dt, np.float64), want_dt, rtol=1e-2, atol=1e-2)
    backward = _products(jax.grad(lambda h, t: jnp.sum(dot_fp32_out(h, t, NT) * g), (0, 1)), h, table)
    assert len(backward) == 2 and all({str(v.aval.dtype) for v in e.invars} == {"bfloat16"} for e in backward)
    # plain fp32 output hands the backward fp32 x bf16 products, which GPUs run in fp32
    mixed = _products(
        jax.grad(lambda h, t: jnp.sum(jax.lax.dot_general(h, t, NT, preferred_element_type=jnp.float32) * g), (0, 1)),
        h,
        table,
    )
    assert any({str(v.aval.dtype) for v in e.invars} == {"float32", "bfloat16"} for e in mixed)


def test_dot_fp32_out_in_fp32_is_plain_autodiff_forward_mode_too():
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(10, 8)), jnp.float32)
    f = lambda h, t: jnp.sum(jnp.sin(dot_fp32_out(h, t, NT)))  # noqa: E731
    ref = lambda h, t: jnp.sum(jnp.sin(jax.lax.dot_general(h, t, NT)))  # noqa: E731
    for a, b in zip(jax.grad(f, (0, 1))(h, table), jax.grad(ref, (0, 1))(h, table)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    v = jnp.asarray(rng.normal(size=h.shape), jnp.float32)
    _, t = jax.jvp(lambda h: f(h, table), (h,), (v,))
    np.testing.assert_allclose(float(t), float(jnp.vdot(jax.grad(f)(h, table), v)), rtol=1e-5)
    hess = jax.hessian(lambda x: f(h.at[0, 0, :3].set(x), table))(h[0, 0, :3])
    hess_ref = jax.hessian(lambda x: ref(h.at[0, 0, :3].set(x), table))(h[0, 0, :3])
    np.testing.assert_allclose(np.asarray(hess), np.asarray(hess_ref), rtol=1e-5, atol=1e-6)
    # a frozen table (grad for h only) costs one backward product, not a product of zeros too
    assert len(_products(jax.grad(f), h, table)) == 1


def test_add_bias_differentiates_as_a_sum_and_its_bias_gradient_is_a_dot():
    """add_bias(y, b) == y + b with the same grad, jvp and hessian, and the bias cotangent is computed
    by a dot (ones^T dy), not by a reduce_sum over rows (XLA:CPU's slow column reduction)."""
    rng = np.random.default_rng(0)
    y, b, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((64, 24), (24,), (64, 24)))

    def loss(add):
        return lambda y, b: jnp.sum(jnp.sin(add(y, b)) * w)

    ours, plain = loss(add_bias), loss(lambda y, b: y + b)
    np.testing.assert_array_equal(np.asarray(add_bias(y, b)), np.asarray(y + b))
    for a, e in zip(jax.grad(ours, argnums=(0, 1))(y, b), jax.grad(plain, argnums=(0, 1))(y, b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)
    tangents = (jnp.ones_like(y), jnp.ones_like(b))
    np.testing.assert_allclose(
        np.asarray(jax.jvp(ours, (y, b), tangents)[1]), np.asarray(jax.jvp(plain, (y, b), tangents)[1]), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(jax.hessian(ours, argnums=1)(y, b)), np.asarray(jax.hessian(plain, argnums=1)(y, b)), atol=1e-4
    )
    grad_b = str(jax.make_jaxpr(jax.grad(ours, argnums=1))(y, b))
    rows = "reduce_sum[axes=(0,)"  # the column sum a broadcast transposes to (the loss sums over (0, 1))
    assert "dot_general" in grad_b and rows not in grad_b, grad_b
    assert rows in str(jax.make_jaxpr(jax.grad(plain, argnums=1))(y, b))  # what the check tells apart
    # no tangent for one operand: no ones product for the bias, no zeros for y
    assert "dot_general" not in str(jax.make_jaxpr(jax.grad(ours, argnums=0))(y, b))
