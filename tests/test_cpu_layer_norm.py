"""jsteer.backbones.cpu.layer_norm and its reverse mode against flax's LayerNorm, and
:mod:`jsteer.backbones.kernel_norm` (jvp, grad, hessian, vmap; the LayerNorm module's params and
fallbacks). It runs on CPUs with AVX-512F or AVX2 + FMA (CI's and the dev VMs'); elsewhere the kernel is not used,
and these tests skip with that reason."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones import cpu, kernel_norm

if not cpu._cpu_has_vector_isa():
    pytest.skip(f"{cpu.NO_VECTOR_ISA}: jsteer.backbones.cpu is not used here", allow_module_level=True)


def _flax(x, scale, bias, eps):
    return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": scale, "bias": bias}}, x)


def _operands(shape, seed):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape) * 3.0 + 1.5, jnp.float32)
    return x, jnp.asarray(rng.standard_normal(d), jnp.float32), jnp.asarray(rng.standard_normal(d), jnp.float32)


@pytest.mark.parametrize(
    "shape,eps", [((5, 16), 1e-5), ((3, 70, 48), 1e-12), ((2, 129, 384), 1e-12), ((1000, 768), 1e-6)]
)
def test_layer_norm_and_its_gradients_match_flax(shape, eps):
    """Values, and dx / dscale / dbias under a random cotangent (the column sums over 64-row blocks,
    the last block partial), against flax's LayerNorm and autodiff."""
    assert cpu.available(), cpu.unavailable_reason()
    x, scale, bias = _operands(shape, shape[-1])
    want = _flax(x, scale, bias, eps)
    np.testing.assert_allclose(np.asarray(kernel_norm.layer_norm(x, scale, bias, eps)), np.asarray(want), atol=5e-6)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
    got = jax.vjp(functools.partial(kernel_norm.layer_norm, eps=eps), x, scale, bias)[1](ct)
    grads = jax.vjp(functools.partial(_flax, eps=eps), x, scale, bias)[1](ct)
    for name, a, e in zip(("dx", "dscale", "dbias"), got, grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-4, err_msg=name)


def test_grad_runs_the_kernels_and_other_modes_match_flax():
    x, scale, bias = _operands((2, 6, 32), 0)

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    on = functools.partial(kernel_norm.layer_norm, eps=1e-5)
    off = functools.partial(_flax, eps=1e-5)
    text = jax.jit(jax.grad(loss(on), argnums=(0, 1, 2))).lower(x, scale, bias).compile().as_text()
    assert cpu.NORM_TARGET in text and cpu.NORM_GRAD_TARGET in text
    for transform in (
        lambda f: jax.jvp(f, (x, scale, bias), (x, scale, bias))[1],
        lambda f: jax.hessian(loss(f))(x[:1, :2], scale, bias),
        lambda f: jax.vmap(jax.grad(loss(f)), (0, None, None))(x, scale, bias),
        lambda f: jax.grad(loss(f), argnums=(0, 1, 2))(x, scale, bias),
    ):
        for a, e in zip(jax.tree.leaves(transform(on)), jax.tree.leaves(transform(off))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-4)


def test_the_module_keeps_flax_params_and_falls_back_where_the_kernel_does_not_apply():
    x, _, _ = _operands((4, 32), 2)
    module = kernel_norm.LayerNorm(epsilon=1e-12)
    params = module.init(jax.random.PRNGKey(0), x, kernel=True)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, nn.LayerNorm().init(jax.random.PRNGKey(0), x))
    params = jax.tree.map(lambda p: p + 0.3, params)
    want = nn.LayerNorm(epsilon=1e-12).apply(params, x)
    on = jax.jit(lambda p, x: module.apply(p, x, kernel=True))
    assert cpu.NORM_TARGET in on.lower(params, x).as_text()
    np.testing.assert_allclose(np.asarray(on(params, x)), np.asarray(want), atol=5e-6)
    np.testing.assert_array_equal(np.asarray(module.apply(params, x)), np.asarray(want))  # kernel=False: flax's
    odd, _, _ = _operands((4, 24), 3)  # 24 columns: flax's path
    odd_params = kernel_norm.LayerNorm().init(jax.random.PRNGKey(0), odd)
    assert (
        cpu.NORM_TARGET
        not in jax.jit(lambda x: kernel_norm.LayerNorm().apply(odd_params, x, kernel=True)).lower(odd).as_text()
    )
    assert not kernel_norm.applies(x.astype(jnp.bfloat16))


def test_layer_norm_refuses_what_it_cannot_read():
    x = jnp.ones((4, 24), jnp.float32)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(cpu.layer_norm(x, jnp.ones(24), jnp.zeros(24), 1e-5))
