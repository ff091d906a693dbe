"""jsteer.backbones.cpu.block_attention (many queries per call: forwards, prefills) against NumPy in
fp64 and the hand-written path, its derivatives through ``attention(cpu_kernel=True)``, and the
models that reach it: a decoder's and BERT's ``LM.forward`` and generate's prefill.

It runs on CPUs with AVX-512F or AVX2 + FMA (CI's and the dev VMs'); elsewhere the kernel is not used, and these
tests skip with that reason."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones import cpu
from jsteer.backbones.attention import attention, dot_product_attention

if not cpu._cpu_has_vector_isa():
    pytest.skip(f"{cpu.NO_VECTOR_ISA}: jsteer.backbones.cpu is not used here", allow_module_level=True)

NEG_INF = -1e30


def _numpy(q, k, v, visible, bias, scale, softcap):
    """fp64: q [B,T,K,G,H], k / v [B,S,K,H], visible / bias [B,T|1,S] -> [B,T,K,G,H]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("btkgh,bskh->btkgs", q, k) * scale
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias[:, :, None, None]
    scores = np.where(visible[:, :, None, None], scores, NEG_INF)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("btkgs,bskh->btkgh", w / w.sum(-1, keepdims=True), v)


def _visible(rng, b, t, s, kind):
    """[B, T|1, S] bool: causal (queries at the last t of s slots, the cache index s - t), a padded
    key mask, a sliding window, or holes; a row (and one whole batch row) that sees nothing."""
    keys, queries = np.arange(s)[None, None, :], np.arange(s - t, s)[None, :, None]
    lengths = rng.integers(1, s + 1, size=(b, 1, 1))
    if kind == "causal":
        vis = (keys <= queries) & (keys < np.maximum(lengths, s - t + 1))
    elif kind == "window":
        vis = (keys <= queries) & (queries - keys < 5)
    elif kind == "padding":
        vis = keys < lengths
    else:  # holes
        vis = rng.random((b, t, s)) < 0.6
    vis = np.array(np.broadcast_to(vis, (b, vis.shape[1], s)))
    vis[0, -1] = False
    if b > 1:
        vis[1] = False
    return vis


CASES = [  # layout, b, t, s, kv heads, queries per kv head, head size, visibility, bias, softcap
    ("split", 2, 5, 5, 2, 3, 16, "causal", False, None),
    ("split", 8, 128, 128, 3, 3, 64, "causal", False, None),  # SmolLM2's heads, the threaded path
    ("split", 1, 300, 300, 1, 2, 32, "window", True, None),  # few heads: query blocks shared out
    ("split", 2, 33, 33, 4, 1, 32, "holes", True, None),
    ("split", 3, 40, 60, 2, 2, 128, "causal", True, 5.0),  # soft-capping: the scalar tail
    ("split", 2, 1, 50, 2, 2, 48, "padding", False, None),  # one query without a cache
    ("cache", 3, 70, 150, 2, 1, 32, "causal", False, None),  # a prefill at cache index 80
    ("cache", 1, 9, 9, 1, 4, 16, "padding", True, 3.0),
    ("cache", 1, 1200, 1300, 1, 1, 16, "causal", False, None),  # scores past 256 KiB a block
    ("fused", 2, 17, 17, 3, 1, 32, "padding", True, None),  # BERT's [B,T,3,N,H] projection
    ("fused", 32, 128, 128, 12, 1, 32, "padding", False, None),  # MiniLM's
]


@pytest.mark.parametrize("layout,b,t,s,kh,g,h,kind,with_bias,softcap", CASES)
def test_block_attention_matches_numpy_and_the_hand_written_path(layout, b, t, s, kh, g, h, kind, with_bias, softcap):
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(b * 1000 + t + h)
    q = rng.standard_normal((b, t, kh, g, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, kh, h)).astype(np.float32) for _ in range(2))
    vis = _visible(rng, b, t, s, kind)
    bias = rng.standard_normal((b, vis.shape[1], s)).astype(np.float32) if with_bias else None
    scale = 0.7 * h**-0.5
    if layout == "fused":
        qkv = np.stack([q[:, :, :, 0], k, v], axis=2)
        got = cpu.block_attention(qkv, None, None, vis, bias, scale, softcap, fused=True)
    elif layout == "cache":
        got = cpu.block_attention(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), vis, bias, scale, softcap, True)
    else:
        got = cpu.block_attention(q, k, v, vis, bias, scale, softcap)
    assert got.shape == (b, t, kh, g, h) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _numpy(q, k, v, vis, bias, scale, softcap), atol=3e-6)
    hand = dot_product_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        scale=scale,
        visible=jnp.asarray(vis)[:, None, None],
        bias=None if bias is None else jnp.asarray(bias)[:, None, None],
        softcap=softcap,
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(hand), atol=3e-6)


def test_block_attention_rejects_what_it_cannot_read():
    q, kv = jnp.ones((2, 4, 2, 1, 16)), jnp.ones((2, 6, 2, 16))
    with pytest.raises(ValueError, match="needs k"):
        cpu.block_attention(q, kv[:, :5], kv, jnp.ones((2, 1, 6), bool), None, 1.0, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.block_attention(q[..., :8], kv[..., :8], kv[..., :8], jnp.ones((2, 1, 6), bool), None, 1.0, None)
    with pytest.raises(ValueError, match=r"visible \(2, 3, 6\)"):
        cpu.block_attention(q, kv, kv, jnp.ones((2, 3, 6), bool), None, 1.0, None)
    with pytest.raises(ValueError, match="bias"):
        cpu.block_attention(q, kv, kv, jnp.ones((2, 1, 6), bool), jnp.ones((1, 1, 6)), 1.0, None)
    with pytest.raises(ValueError, match=r"\[B,T,3,K,H\]"):
        cpu.block_attention(
            jnp.ones((2, 4, 2, 2, 16)), None, None, jnp.ones((2, 1, 4), bool), None, 1.0, None, fused=True
        )


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("padding_only", [True, False])
def test_attention_through_the_kernel_differentiates_like_the_hand_written_path(fused, padding_only):
    """attention(cpu_kernel=True): the kernel's values, the hand-written path's derivatives (grad,
    jvp) for q, k, v and the bias, in one jitted call; a padding-only bias (BERT's) as visibility."""
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(7)
    b, t, kh, h = 2, 24, 2, 16
    qkv = jnp.asarray(rng.standard_normal((b, t, 3, kh, h)), jnp.float32)
    mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t - 5]]))
    bias = jnp.where(mask, 0.0, NEG_INF)[:, None, None, None, :]  # [B,1,1,1,S]
    if not padding_only:
        bias = bias + jnp.asarray(rng.standard_normal((b, 1, 1, t, t)), jnp.float32)

    def run(qkv, bias, on):
        out = attention(
            qkv[:, :, 0, :, None],
            qkv[:, :, 1],
            qkv[:, :, 2],
            scale=0.25,
            bias=bias,
            right_padded=object() if padding_only else None,  # only its presence is read on this path
            cpu_kernel=on,
            qkv=qkv if fused else None,
        )
        return jnp.sum(jnp.sin(out))

    on = jax.jit(jax.value_and_grad(lambda x, c: run(x, c, True), argnums=(0, 1)))
    off = jax.value_and_grad(lambda x, c: run(x, c, False), argnums=(0, 1))
    assert cpu.BLOCK_TARGET in on.lower(qkv, bias).as_text()
    for a, e in zip(jax.tree.leaves(on(qkv, bias)), jax.tree.leaves(off(qkv, bias))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)
    dq = jnp.ones_like(qkv)
    got = jax.jvp(lambda x: run(x, bias, True), (qkv,), (dq,))
    want = jax.jvp(lambda x: run(x, bias, False), (qkv,), (dq,))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _tiny_decoder():
    from jsteer.backbones.decoder import Decoder
    from jsteer.backbones.decoder_config import DecoderConfig

    c = DecoderConfig.llama(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Decoder(c)


def test_decoder_forward_and_prefill_attend_through_the_kernel():
    """With the "packed" collection a decoder's forward (right-padded rows) and generate's prefill
    (left-padded rows, into the cache) run block_attention and compute RoPE's cos / sin once;
    logits and tokens as without it."""
    from jsteer import decode

    module = _tiny_decoder()
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(3, 97, (3, 40)), jnp.int32)
    mask = jnp.asarray(np.arange(40)[None] < np.array([[40], [31], [40]]), jnp.int32)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), ids, mask)["params"]
    params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 2 else a, params)  # peaked logits: no near-ties
    packed = {"params": params, "packed": module.decode_pack(params)}
    fwd = jax.jit(lambda variables: module.apply(variables, ids, mask).logits)
    assert cpu.BLOCK_TARGET in fwd.lower(packed).as_text()
    # RoPE's cos computed once (materialized), not fused into each layer's q and k rotations
    assert fwd.lower(packed).compile().as_text().count(" cosine(") == 1
    assert fwd.lower({"params": params}).compile().as_text().count(" cosine(") == 4  # what the check tells apart
    np.testing.assert_allclose(np.asarray(fwd(packed)), np.asarray(fwd({"params": params})), rtol=1e-5, atol=1e-4)
    left = jnp.asarray(np.arange(40)[None] >= np.array([[0], [9], [3]]), jnp.int32)
    runs = [decode.generate(module, params, ids, left, max_new_tokens=8, cpu_kernels=on) for on in (True, False)]
    np.testing.assert_array_equal(np.asarray(runs[0].tokens), np.asarray(runs[1].tokens))


def test_bert_forward_runs_the_packed_products_and_the_kernel(tmp_path):
    """MiniLM's LM.forward on CPU: packed products, block_attention and layer_norm by default (the same hidden
    states as XLA's ops to fp32 rounding), with hooks.attn_bias too; cpu_kernels=False keeps XLA's."""
    import jsteer
    from jsteer import lm as lm_module
    from jsteer.hooks import Hooks

    lm = jsteer.load("minilm")
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1000, 30000, (4, 48)), jnp.int32)
    mask = jnp.asarray(np.arange(48)[None] < np.array([[48], [30], [48], [7]]), jnp.int32)
    assert "encoder" in lm.module.decode_pack(lm.params)
    seen = []
    real = lm_module._forward

    def spy(module, params, packed, *rest):
        seen.append(packed is not None)
        return real(module, params, packed, *rest)

    hooks = Hooks(attn_bias=jnp.asarray(rng.standard_normal((4, 48, 48)), jnp.float32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_module, "_forward", spy)
        for kw in ({}, {"hooks": hooks}):
            fast = lm.forward(ids, mask, **kw).hidden
            plain = lm.forward(ids, mask, cpu_kernels=False, **kw).hidden
            np.testing.assert_allclose(np.asarray(fast), np.asarray(plain), rtol=1e-4, atol=1e-4)
    assert seen == [True, False, True, False]
    text = jax.jit(lambda v: lm.module.apply(v, ids, mask).hidden).lower(
        {"params": lm.params, "packed": lm.module.decode_pack(lm.params)}
    )
    assert all(target in text.as_text() for target in (cpu.BLOCK_TARGET, cpu.NORM_TARGET))
    # 4 x 48 rows: past cpu.kernel_rows() (AVX2) the products are XLA's
    assert (cpu.TARGET in text.as_text()) == (cpu.kernel_rows() is None or ids.size <= cpu.kernel_rows())


def test_materialize_is_an_identity_xla_cannot_fuse_through():
    x = jnp.arange(12.0).reshape(3, 4)
    f = jax.jit(lambda x: cpu.materialize(jnp.cos(x)) * 2.0)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jnp.cos(x) * 2.0))
    assert cpu.MATERIALIZE_TARGET in f.lower(x).as_text()
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: f(x).sum())(x)), np.asarray(-2.0 * jnp.sin(x)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.vmap(cpu.materialize)(x)), np.asarray(x))
