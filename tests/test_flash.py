"""The fused attention-with-dropout kernel (jsteer.backbones.flash), run in Pallas' interpreter on
this CPU: values and gradients equal the hand-written path's with the same dropout mask; it lowers
to Triton for CUDA; BERT training routes to it under ``fused_dropout()`` on a GPU backend."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones import attention as A
from jsteer.backbones import bert as jb
from jsteer.backbones import flash
from jsteer.backbones.dropout import Dropout, HashDropout

SEED = jnp.asarray([123, 4567], jnp.uint32)


def _inputs(b=2, t=128, n=4, kh=2, h=16, lengths=(128, 37), seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(b, t, kh, h)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(np.arange(t)[None, :] < np.asarray(lengths)[:, None])
    return q, k, v, mask


@pytest.mark.parametrize("kh,rate,t", [(4, 0.1, 128), (2, 0.3, 128), (4, 0.0, 16)])
def test_values_and_gradients_equal_the_hand_written_path(kh, rate, t):
    """MHA and grouped-query heads, a right- or left-padded row, two forward and four backward tiles
    (or a sequence shorter than one): the kernel's output and its custom VJP equal autodiff through the hand-written
    path dropping the same elements."""
    q, k, v, mask = _inputs(kh=kh, t=t, lengths=(t, t // 2 + 3))
    if kh == 2:  # the second row left-padded: its first tiles see no key at all
        mask = mask.at[1].set(mask[1, ::-1])
    w = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    fused = loss(lambda q, k, v: flash.flash_attention(q, k, v, mask, SEED, 0.25, rate, True))
    hand = loss(lambda q, k, v: flash.reference(q, k, v, mask, SEED, 0.25, rate))
    out, ref = (
        flash.flash_attention(q, k, v, mask, SEED, 0.25, rate, True),
        flash.reference(q, k, v, mask, SEED, 0.25, rate),
    )
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)
    for got, want in zip(jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(hand, (0, 1, 2))(q, k, v)):
        assert float(jnp.abs(want).max()) > 0.1
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    if rate:  # the mask matters: another seed (or none) gives other values
        other = flash.flash_attention(q, k, v, mask, SEED + 1, 0.25, rate, True)
        assert float(jnp.abs(other - out).max()) > 0.1
        assert float(jnp.abs(flash.reference(q, k, v, mask, SEED, 0.25, 0.0) - out).max()) > 0.1


def test_dropped_share_is_the_rate():
    """With v = 1 on one key per row, the output is that key's dropped probability: zero at the rate."""
    q, k, v, mask = _inputs(b=1, n=2, kh=2, lengths=(128,))
    q = jnp.zeros_like(q)  # uniform probabilities 1/128
    out = flash.flash_attention(q, k, jnp.ones_like(v), mask, SEED, 1.0, 0.25, True)
    kept = np.asarray(out[..., 0]) * 128 * 0.75  # kept keys per row / 128 * 128
    assert abs(kept.mean() / 128 - 0.75) < 0.01


def test_rejects_bad_shapes_and_rates():
    q, k, v, mask = _inputs()
    with pytest.raises(ValueError, match="key_mask must be"):
        flash.flash_attention(q, k, v, mask[:, :5], SEED, 0.25, 0.1, True)
    with pytest.raises(ValueError, match="unsupported"):
        flash.flash_attention(q[:, :96], k[:, :96], v[:, :96], mask[:, :96], SEED, 0.25, 0.1, True)
    with pytest.raises(ValueError, match="K dividing"):
        flash.flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), mask, SEED, 0.25, 0.1, True)
    with pytest.raises(ValueError, match="rate"):
        flash.flash_attention(q, k, v, mask, SEED, 0.25, 1.0, True)
    big = jax.ShapeDtypeStruct((256, 2048, 16, 64), jnp.bfloat16)  # 2**34 probabilities, shapes only
    with pytest.raises(ValueError, match="32-bit counter"):
        jax.eval_shape(lambda q: flash.flash_attention(q, q, q, jnp.ones((256, 2048), bool), SEED, 0.125, 0.1), big)


def test_lowers_to_triton_for_cuda_on_a_machine_without_one():
    """jax.export for CUDA runs the Triton lowering of all three kernels here (Triton compiles them
    on the GPU); nothing in the program is a CPU custom call."""
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
    args = (q, kv, kv, jax.ShapeDtypeStruct((2, 128), jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32))

    def step(q, k, v, m, s):
        f = lambda q, k, v: flash.flash_attention(q, k, v, m, s, 0.125, 0.1).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(f, (0, 1, 2))(q, k, v)

    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = jax.export.export(jax.jit(step), platforms=("cuda",), disabled_checks=[triton])(*args).mlir_module()
    names = sorted(set(re.findall(r'name = "(jsteer_flash_dropout_[a-z]+)"', text)))
    assert names == ["jsteer_flash_dropout_dkv", "jsteer_flash_dropout_dq", "jsteer_flash_dropout_fwd"]
    assert set(re.findall(r"stablehlo.custom_call @([\w$.]+)", text)) == {"__gpu$xla.gpu.triton"}


def test_dropout_layer_hash_is_the_layer_s_own_mask():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)), jnp.float32)
    layer, rngs = Dropout(0.2), {"dropout": jax.random.key(3)}
    called = layer.apply({}, x, False, rngs=rngs)
    spec = layer.apply({}, False, rngs=rngs, method=Dropout.hash)
    assert isinstance(spec, HashDropout) and np.array_equal(np.asarray(spec(x)), np.asarray(called))
    assert layer.apply({}, True, method=Dropout.hash) is None


def test_bert_training_routes_to_the_kernel(monkeypatch):
    """A bf16 BERT encoder in training on a 'GPU' backend: under fused_dropout() every layer's
    attention runs the kernel (interpreted here) and gives the hand-written path's hidden states
    within bf16 rounding, for the same dropout key (another key moves them far more); without it,
    or on CPU, the kernel is never called."""
    cfg = jb.BertConfig(
        vocab_size=50, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=96, attention_dropout=0.2
    )
    b, t = 2, 64
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 50, size=(b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < np.asarray([[t], [40]]), jnp.int32)
    module = jb.BertEncoder(cfg, dtype=jnp.bfloat16)
    params = module.init(jax.random.key(0), ids, mask)
    calls = []
    real = flash.flash_attention

    def interpreted(*a):
        calls.append(1)
        return real(*a[:7], True)

    monkeypatch.setattr(flash, "flash_attention", interpreted)

    def run(key, fused):
        rngs = {"dropout": jax.random.key(key)}
        with A.fused_dropout(fused):
            return module.apply(params, ids, mask, deterministic=False, rngs=rngs).hidden.astype(jnp.float32)

    cpu = run(5, True)
    assert not calls
    monkeypatch.setattr(A, "_backend", lambda: "gpu")
    hand, fused, other = run(5, False), run(5, True), run(6, True)
    assert len(calls) == 2 * cfg.num_layers  # two fused runs, each layer once
    real_rows = np.asarray(mask, bool)
    near = float(jnp.abs(fused - hand).max(-1)[real_rows].max())
    far = float(jnp.abs(other - hand).max(-1)[real_rows].max())
    assert float(jnp.abs(cpu - hand).max()) == 0.0 and near < 0.1 < far, (near, far)
