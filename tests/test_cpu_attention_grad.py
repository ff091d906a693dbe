"""Training through jsteer's CPU attention kernel: ``cpu.block_attention`` with probability dropout and
``cpu.block_attention_grad`` (its reverse mode) against the hand-written path with the same
HashDropout mask, and :mod:`jsteer.backbones.kernel_attention`'s derivatives (grad by the kernel,
jvp / hessian / vmap as the hand-written path's) through ``attention`` and a BERT train step.

It runs on CPUs with AVX-512F or AVX2 + FMA (CI's and the dev VMs'); elsewhere the kernel is not used, and these
tests skip with that reason."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_attention import _visible
from test_export import export_text

from jsteer.backbones import cpu
from jsteer.backbones.attention import RightPadded, attention, dot_product_attention
from jsteer.backbones.dropout import HashDropout

if not cpu._cpu_has_vector_isa():
    pytest.skip(f"{cpu.NO_VECTOR_ISA}: jsteer.backbones.cpu is not used here", allow_module_level=True)

SEED = np.array([0x12345678, 0x9ABCDEF0], np.uint32)

CASES = [  # layout, b, t, kv heads, queries per kv head, head size, visibility, dropout rate
    ("split", 2, 20, 2, 1, 16, "padding", None),
    ("split", 2, 37, 2, 3, 32, "causal", 0.1),  # grouped queries: dk, dv summed over 3 heads
    ("split", 1, 130, 3, 2, 64, "window", 0.3),  # three query blocks of 64
    ("split", 2, 33, 4, 1, 32, "holes", 0.2),
    ("fused", 3, 70, 2, 1, 32, "padding", 0.1),  # BERT's projection: its gradient in place
    ("fused", 4, 128, 12, 1, 32, "padding", 0.1),  # MiniLM's heads
]


def _operands(layout, b, t, kh, g, h, rng):
    if layout == "fused":
        qkv = jnp.asarray(rng.standard_normal((b, t, 3, kh, h)), jnp.float32)
        return qkv, (qkv[:, :, 0, :, None], qkv[:, :, 1], qkv[:, :, 2])
    q = jnp.asarray(rng.standard_normal((b, t, kh, g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    return None, (q, k, v)


@pytest.mark.parametrize("layout,b,t,kh,g,h,kind,rate", CASES)
def test_kernel_forward_and_backward_match_the_hand_written_path(layout, b, t, kh, g, h, kind, rate):
    """Values with dropout, and dq, dk, dv (or the fused projection's gradient) under a random
    cotangent, against jax.vjp of dot_product_attention with the same mask; rows that see nothing
    (uniform weights: dv only) included."""
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(t * 10 + h)
    qkv, (q, k, v) = _operands(layout, b, t, kh, g, h, rng)
    vis = jnp.asarray(_visible(rng, b, t, t, kind))
    scale = 0.7 * h**-0.5
    drop = None if rate is None else HashDropout(jnp.asarray(SEED), rate)

    def hand(q, k, v):
        return dot_product_attention(q, k, v, scale=scale, visible=vis[:, None, None], dropout=drop)

    want, vjp = jax.vjp(hand, q, k, v)
    dropout = None if rate is None else (jnp.asarray(SEED), rate)
    fused = layout == "fused"
    args = (qkv, None, None) if fused else (q, k, v)
    got = cpu.block_attention(*args, vis, None, scale, None, fused=fused, dropout=dropout)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    dout = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    grads = cpu.block_attention_grad(*args, vis, None, scale, dout, got, fused, dropout)
    if fused:
        grads = (grads[:, :, 0, :, None], grads[:, :, 1], grads[:, :, 2])
    for name, a, e in zip("qkv", grads, vjp(dout)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_a_different_seed_or_rate_drops_other_weights():
    """The kernel's mask is the seed's: changing either seed word or the rate changes the output
    (so the comparisons above could fail on a wrong element index)."""
    rng = np.random.default_rng(0)
    _, (q, k, v) = _operands("split", 1, 16, 1, 1, 16, rng)
    vis = jnp.ones((1, 1, 16), bool)
    outs = [
        np.asarray(cpu.block_attention(q, k, v, vis, None, 0.25, None, dropout=(jnp.asarray(s, jnp.uint32), r)))
        for s, r in (
            (SEED, 0.5),
            (SEED ^ np.array([1, 0], np.uint32), 0.5),
            (SEED ^ np.array([0, 1], np.uint32), 0.5),
            (SEED, 0.3),
        )
    ]
    for other in outs[1:]:
        assert np.abs(other - outs[0]).max() > 1e-3


def _attend(x, bias, drop, fused, rp, kernel=True):
    """Attention of a fused projection x [B,T,3,K,H]: ``attention`` (the kernels), or with ``kernel``
    False the hand-written path alone."""
    q, k, v = x[:, :, 0, :, None], x[:, :, 1], x[:, :, 2]
    if not kernel:
        return dot_product_attention(q, k, v, scale=0.25, bias=bias, dropout=drop)
    return attention(q, k, v, scale=0.25, bias=bias, dropout=drop, right_padded=rp, qkv=x if fused else None)


@pytest.mark.parametrize("fused", [False, True])
def test_attention_with_dropout_trains_through_the_kernels(fused):
    """attention() with a HashDropout on CPU: the block kernel forward, the backward kernel in a
    jitted grad (a padding bias needs no cotangent), the hand-written path's values and gradients."""
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(3)
    b, t, kh, h = 2, 24, 2, 16
    qkv = jnp.asarray(rng.standard_normal((b, t, 3, kh, h)), jnp.float32)
    mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 5]]))
    bias = jnp.where(mask, 0.0, -1e30)[:, None, None, None, :]
    drop = HashDropout(jnp.asarray(SEED), 0.1)
    rp = RightPadded.of(mask, causal=False)

    def loss(x):
        return jnp.sum(jnp.sin(_attend(x, bias, drop, fused, rp)))

    def hand(x):
        return jnp.sum(jnp.sin(_attend(x, bias, drop, fused, rp, kernel=False)))

    grad = jax.jit(jax.value_and_grad(loss))
    text = grad.lower(qkv).compile().as_text()
    assert cpu.BLOCK_TARGET in text and cpu.BLOCK_GRAD_TARGET in text
    want = jax.value_and_grad(hand)(qkv)
    for a, e in zip(grad(qkv), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)
    # under jax.checkpoint the forward is traced again: the kernels' masks and seeds (concrete here,
    # as a closed-over batch's are) once leaked from the first trace ("Encountered an unexpected tracer")
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss))).lower(qkv).compile()
    assert cpu.BLOCK_GRAD_TARGET in remat.as_text()
    for a, e in zip(remat(qkv), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)


def test_forward_mode_hessian_vmap_and_a_learned_bias_take_the_hand_written_derivatives():
    """jvp, a hessian (jacfwd of the kernel's grad), vmap of grad (per-example gradients) and the
    gradient of a bias that is a parameter (the kernel gives none: the hand-written transpose)."""
    rng = np.random.default_rng(4)
    b, t, kh, h = 2, 6, 1, 16
    qkv = jnp.asarray(rng.standard_normal((b, t, 3, kh, h)), jnp.float32)
    drop = HashDropout(jnp.asarray(SEED), 0.2)

    def f(x, bias=None, on=True):
        return jnp.sum(jnp.sin(_attend(x, bias, drop, True, None, kernel=on)))

    tangent = jnp.asarray(rng.standard_normal(qkv.shape), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((b, 1, 1, t, t)), jnp.float32)
    on, off = functools.partial(f, on=True), functools.partial(f, on=False)
    for transform in (
        lambda g: jax.jvp(g, (qkv,), (tangent,))[1],
        lambda g: jax.hessian(g)(qkv[:1]),
        lambda g: jax.vmap(jax.grad(lambda x: g(x[None])))(qkv),
        lambda g: jax.grad(g, argnums=(0, 1))(qkv, bias),
    ):
        for a, e in zip(jax.tree.leaves(transform(on)), jax.tree.leaves(transform(off))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=5e-5, atol=5e-5)


def test_bert_train_step_runs_the_kernels_on_cpu_and_exports_without_them():
    """A BERT token-classification step with dropout (fp32): its CPU program has the attention and
    LayerNorm kernels and their backwards; the same step exported for GPUs and TPUs has none
    (lax.platform_dependent)."""
    from jsteer.backbones import bert_heads
    from jsteer.backbones.bert import BertConfig

    c = BertConfig(
        vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=16
    )
    module = bert_heads.BertForTokenClassification(c, num_labels=3)
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    params = module.init(jax.random.PRNGKey(0), ids, attention_mask=mask)["params"]

    def step(p, key):
        def loss(p):
            out = module.apply({"params": p}, ids, attention_mask=mask, deterministic=False, rngs={"dropout": key})
            return jnp.mean(out.logits**2)

        return jax.grad(loss)(p)

    key = jax.random.PRNGKey(1)
    text = jax.jit(step).lower(params, key).compile().as_text()
    targets = (cpu.BLOCK_TARGET, cpu.BLOCK_GRAD_TARGET, cpu.NORM_TARGET, cpu.NORM_GRAD_TARGET)
    assert all(target in text for target in targets)
    export_text(step, params, key)


def test_a_decoders_gradient_runs_the_attention_kernels_and_matches_the_hand_written_path(monkeypatch):
    """A decoder has no dropout: under reverse-mode differentiation (a train step) its attention
    still takes the kernel and its backward, with the hand-written path's loss and gradient (that
    path forced for the reference); a forward outside differentiation keeps XLA's ops unless
    packed; the step exported for GPUs and TPUs has none of the kernels."""
    from test_export import CFG

    from jsteer.backbones import attention as attention_module
    from jsteer.backbones.decoder import Decoder

    assert cpu.available(), cpu.unavailable_reason()
    module = Decoder(CFG)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
    mask = jnp.asarray(np.arange(24) < np.array([[24], [17]]), jnp.int32)
    params = module.init(jax.random.PRNGKey(0), ids)["params"]

    def loss(p):
        logits = module.apply({"params": p}, ids, attention_mask=mask).logits
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -(jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0] * mask[:, 1:]).sum() / mask.sum()

    step = jax.value_and_grad(loss)
    text = jax.jit(step).lower(params).compile().as_text()
    assert cpu.BLOCK_TARGET in text and cpu.BLOCK_GRAD_TARGET in text
    assert cpu.BLOCK_TARGET not in jax.jit(loss).lower(params).compile().as_text()
    got_loss, got = jax.jit(step)(params)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "_in_reverse_mode", lambda: False)
        hand = jax.jit(jax.value_and_grad(lambda p: loss(p)))  # a new function: traced anew
        hand_text = hand.lower(params).compile().as_text()
        want_loss, want = hand(params)
    assert cpu.BLOCK_TARGET not in hand_text  # so the comparison below compares two paths
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6 * float(np.abs(w).max()) + 1e-9)
    export_text(step, params)
