"""The decoder module itself (one GPT-2-shaped and one LLaMA-shaped config): attention bias, the
KV cache with prompt and step hooks, explicit positions, learned-position bounds, bf16, the last
position's logits, forward-mode autodiff and the CPU kernel's packing. Family parity against
transformers is in test_decoder_families.py."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer.backbones import decoder as jd
from jsteer.backbones import decoder_hf, families
from jsteer.backbones import decoder_params as jp
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.hooks import FiLM, Hooks, Steer

V, D, L, H, P = 97, 32, 2, 4, 64
B, T = 3, 9
PADS = (0, 3, 5)  # left padding per row
TOL = 1e-5


def _hf_model(tie: bool = True, **kw) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=P,
        n_embd=D,
        n_layer=L,
        n_head=H,
        bos_token_id=V - 1,
        eos_token_id=V - 1,
        tie_word_embeddings=tie,
        **kw,
    )
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg)
    # HF initialises with std 0.02 and LayerNorm 1/0: make every tensor O(0.3) so errors show up
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if ".ln_" in name and name.endswith("weight") else 0.0))
    return model.eval()


def _state(model) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _batch(seed: int = 1, t: int = T, pads=PADS):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V - 1, size=(len(pads), t)).astype(np.int32)
    mask = np.ones((len(pads), t), np.int32)
    for i, n in enumerate(pads):
        mask[i, :n] = 0
    return np.where(mask > 0, ids, 0).astype(np.int32), mask


def _positions(mask):
    return np.maximum(np.cumsum(mask, -1) - 1, 0)


def _hf_forward(model, ids, mask, inputs_embeds=None):
    kw = dict(
        attention_mask=torch.tensor(mask, dtype=torch.long),
        position_ids=torch.tensor(_positions(mask), dtype=torch.long),
        output_hidden_states=True,
    )
    with torch.no_grad():
        if inputs_embeds is not None:
            return model(inputs_embeds=torch.tensor(inputs_embeds), **kw)
        return model(torch.tensor(ids, dtype=torch.long), **kw)


def _maxdiff(a, b, mask=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if mask is not None:
        a, b = a[mask > 0], b[mask > 0]
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def setup():
    hf = _hf_model()
    cfg = families.config_from_hf(hf.config.to_dict())
    params = decoder_hf.params_from_hf(_state(hf), cfg)
    module = jd.Decoder(cfg)
    fwd = jax.jit(
        lambda p, i, m, h, hs: module.apply({"params": p}, i, m, hooks=h, output_hidden_states=hs), static_argnums=4
    )
    return hf, cfg, params, module, fwd


# ----------------------------------------------------------------------------- parity


def test_parity_untied_lm_head_and_variants():
    hf = _hf_model(tie=False, activation_function="gelu", scale_attn_by_inverse_layer_idx=True, n_inner=48)
    cfg = families.config_from_hf(hf.config.to_dict())
    assert not cfg.tie_word_embeddings and cfg.intermediate_size == 48 and cfg.activation == "gelu"
    params = decoder_hf.params_from_hf(_state(hf), cfg)
    np.testing.assert_array_equal(jp.output_embeddings(params, cfg), hf.lm_head.weight.detach().numpy())
    ids, mask = _batch(seed=2)
    out = jax.jit(jd.Decoder(cfg).apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    assert _maxdiff(out.logits, _hf_forward(hf, ids, mask).logits, mask) <= TOL


# ----------------------------------------------------------------------------- KV cache


def test_init_cache_shapes(setup):
    _, cfg, *_ = setup
    c = cfg.init_cache(2, 10, jnp.bfloat16)
    assert len(c.k) == L and len(c.v) == L
    assert c.k[0].shape == (2, H, D // H, 10) and c.k[0].dtype == jnp.bfloat16
    assert c.v[0].shape == (2, H, 10, D // H) and c.v[0].dtype == jnp.bfloat16
    assert c.mask.shape == (2, 10) and int(c.index) == 0 and c.pos.shape == (2,)


# ----------------------------------------------------------------------------- hooks


def test_attn_bias_equals_padding_mask(setup):
    """Hiding key j with attn_bias == dropping j from the attention mask (same positions)."""
    _, _, params, _, fwd = setup
    ids, _ = _batch(seed=7, pads=(0, 0, 0))
    ones = np.ones((B, T), np.int32)
    j = 4
    holed = ones.copy()
    holed[:, j] = 0
    bias = np.zeros((B, T, T), np.float32)
    bias[:, :, j] = -1e9
    pos = jnp.asarray(_positions(ones))
    a = fwd(params, ids, ones, Hooks(attn_bias=jnp.asarray(bias), position_ids=pos), False)
    b = fwd(params, ids, holed, Hooks(position_ids=pos), False)
    keep = np.ones((B, T), np.int32)
    keep[:, j] = 0  # row j itself has no visible self key in b
    assert _maxdiff(a.logits, b.logits, keep) <= TOL
    assert _maxdiff(a.logits, fwd(params, ids, ones, None, False).logits, keep) > 1e-2


def test_step_offset_and_prompt_hooks_under_cache(setup):
    """Prompt with embed_offset + attn_bias through the cache, then a step (step=True, step
    hooks as jsteer.decode passes them) with step_offset == one full forward whose
    embed_offset carries the step offset at the last position."""
    _, cfg, params, module, fwd = setup
    ids, mask = _batch(seed=9, t=T + 1)
    rng = np.random.default_rng(3)
    off = rng.normal(size=(B, T + 1, D)).astype(np.float32)
    step_off = rng.normal(size=(B, D)).astype(np.float32)
    off[:, -1] = step_off
    bias = np.zeros((B, T + 1, T + 1), np.float32)
    bias[:, 5:, 2] = -1e9  # later tokens may not see token 2
    full = fwd(params, ids, mask, Hooks(embed_offset=jnp.asarray(off), attn_bias=jnp.asarray(bias)), False)

    cache = cfg.init_cache(B, 12)
    hooks = Hooks(
        embed_offset=jnp.asarray(off[:, :T]), attn_bias=jnp.asarray(bias[:, :T, :T]), step_offset=jnp.asarray(step_off)
    )
    step_hooks = Hooks(step_offset=jnp.asarray(step_off))
    run = jax.jit(
        lambda p, i, m, h, c, s: module.apply({"params": p}, i, m, hooks=h, cache=c, step=s), static_argnums=5
    )
    pre = run(params, jnp.asarray(ids[:, :T]), jnp.asarray(mask[:, :T]), hooks, cache, False)
    nxt = run(params, jnp.asarray(ids[:, T:]), jnp.asarray(mask[:, T:]), step_hooks, pre.cache, True)
    assert _maxdiff(pre.logits, np.asarray(full.logits)[:, :T], mask[:, :T]) <= TOL
    # the step token sees token 2 in the cached run (the prompt's attn_bias is not a step hook)
    ref_bias = bias.copy()
    ref_bias[:, T, 2] = 0.0
    full2 = fwd(params, ids, mask, Hooks(embed_offset=jnp.asarray(off), attn_bias=jnp.asarray(ref_bias)), False)
    assert _maxdiff(nxt.logits[:, 0], np.asarray(full2.logits)[:, T]) <= TOL
    assert _maxdiff(nxt.logits[:, 0], np.asarray(full.logits)[:, T]) > 1e-3


def test_bad_attn_bias_shape(setup):
    _, _, params, module, _ = setup
    ids, mask = _batch()
    with pytest.raises(ValueError, match="attn_bias"):
        module.apply(
            {"params": params}, jnp.asarray(ids), jnp.asarray(mask), hooks=Hooks(attn_bias=jnp.zeros((B, T, T + 2)))
        )


def test_positions_past_n_positions_are_refused(setup):
    _, cfg, params, module, _ = setup
    too_long = jnp.zeros((1, cfg.max_position_embeddings + 1), jnp.int32)
    with pytest.raises(ValueError, match="learned positions"):
        module.apply({"params": params}, too_long)
    from jsteer.decode import generate

    prompt = jnp.ones((1, cfg.max_position_embeddings - 2), jnp.int32)
    generate(module, params, prompt, max_new_tokens=2)  # exactly fits
    with pytest.raises(ValueError, match="n_positions"):
        generate(module, params, prompt, max_new_tokens=3)


# ----------------------------------------------------------------------------- conversion


def test_params_from_hf_names_and_errors(setup):
    hf, cfg, params, module, _ = setup
    sd = _state(hf)
    # bare GPT2Model names (no `transformer.`), plus the causal-mask buffers of old checkpoints
    bare = {k[len("transformer.") :]: v for k, v in sd.items() if k.startswith("transformer.")}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, P, P), np.float32))
    bare["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    p2 = decoder_hf.params_from_hf(bare, cfg)
    jax.tree.map(np.testing.assert_array_equal, p2, params)
    # tree matches what module.init builds, and every leaf has logical axis names
    init = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert shapes(init) == shapes(params)
    assert jax.tree.structure(jp.logical_axes(params), is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(
        params
    )
    np.testing.assert_array_equal(jp.input_embeddings(params), sd["transformer.wte.weight"])

    missing = dict(sd)
    del missing["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.bias'"):
        decoder_hf.params_from_hf(missing, cfg)
    wrong = dict(sd)
    wrong["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].T
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight.*\(96, 32\).*\(32, 96\)"):
        decoder_hf.params_from_hf(wrong, cfg)
    extra = dict(sd)
    extra["transformer.h.0.crossattention.q_attn.weight"] = np.zeros((D, D), np.float32)
    with pytest.raises(ValueError, match="crossattention"):
        decoder_hf.params_from_hf(extra, cfg)
    with pytest.raises(ValueError, match="n_head"):
        families.config_from_hf({**hf.config.to_dict(), "n_head": 5})
    no_layers = {k: v for k, v in hf.config.to_dict().items() if k != "n_layer"}
    with pytest.raises(ValueError, match="n_layer"):
        families.config_from_hf(no_layers)


def test_bf16_activations_close(setup):
    _, cfg, params, _, fwd = setup
    ids, mask = _batch(seed=10)
    ref = fwd(params, ids, mask, None, False)
    out = jax.jit(jd.Decoder(cfg, dtype=jnp.bfloat16).apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    err = _maxdiff(out.logits, ref.logits, mask) / float(np.abs(np.asarray(ref.logits)).max())
    assert err < 0.05


def test_last_logits_only_and_dtype(setup):
    _, cfg, params, module, fwd = setup
    ids, mask = _batch(seed=11)
    steer = Steer(eps=jnp.array([0.7]), w=jnp.asarray(np.random.default_rng(4).normal(size=(1, D, D)), jnp.float32))
    hooks = Hooks(steer=steer)
    full = fwd(params, ids, mask, hooks, False)
    last = jax.jit(lambda p, i, m, h: module.apply({"params": p}, i, m, hooks=h, last_logits_only=True))(
        params, jnp.asarray(ids), jnp.asarray(mask), hooks
    )
    assert last.logits.shape == (B, 1, V)
    assert _maxdiff(last.logits, np.asarray(full.logits)[:, -1:]) <= TOL
    np.testing.assert_array_equal(np.asarray(last.hidden), np.asarray(full.hidden))
    assert module.dtype == jnp.float32


# ----------------------------------------------------------------------------- generation


def _soft_positions(mask, seed):
    """Increasing positions with gaps (K-BERT style) on real tokens, 0 on pads: [B, T]."""
    steps = np.random.default_rng(seed).integers(1, 4, size=mask.shape) * mask
    return np.maximum(np.cumsum(steps, -1) - 1, 0) * mask


def test_explicit_positions_under_cache_continue_after_the_largest(setup):
    """A prompt prefilled with explicit positions, then steps with default positions (as
    jsteer.decode runs it) == one full forward whose positions go on at max + 1, max + 2."""
    _, cfg, params, module, fwd = setup
    ids, mask = _batch(seed=12, t=T + 2)
    pos = _soft_positions(mask[:, :T], seed=13)
    top = pos.max(-1, keepdims=True)
    full_pos = np.concatenate([pos, top + 1, top + 2], axis=1).astype(np.int32)
    full = fwd(params, ids, mask, Hooks(position_ids=jnp.asarray(full_pos)), False)

    run = jax.jit(lambda p, i, m, h, c: module.apply({"params": p}, i, m, hooks=h, cache=c))
    out = run(
        params,
        jnp.asarray(ids[:, :T]),
        jnp.asarray(mask[:, :T]),
        Hooks(position_ids=jnp.asarray(pos, jnp.int32)),
        cfg.init_cache(B, T + 2),
    )
    np.testing.assert_array_equal(np.asarray(out.cache.pos), top[:, 0] + 1)
    logits = [np.asarray(out.logits)]
    cache = out.cache
    for i in (T, T + 1):
        out = run(params, jnp.asarray(ids[:, i : i + 1]), jnp.ones((B, 1), jnp.int32), None, cache)
        cache = out.cache
        logits.append(np.asarray(out.logits))
    assert _maxdiff(np.concatenate(logits, axis=1), full.logits, mask) <= TOL
    np.testing.assert_array_equal(np.asarray(cache.pos), top[:, 0] + 3)


def test_explicit_positions_are_checked_against_n_positions(setup):
    _, cfg, params, module, _ = setup
    from jsteer.decode import generate

    ids, mask = _batch(seed=14)
    pos = np.where(mask > 0, cfg.max_position_embeddings - 3, 0).astype(np.int32)  # decoding continues at P - 2
    pos[:, -1] = cfg.max_position_embeddings - 3
    generate(module, params, ids, mask, max_new_tokens=2, hooks=Hooks(position_ids=jnp.asarray(pos)))  # fits
    top = cfg.max_position_embeddings
    with pytest.raises(
        ValueError,
        match=rf"prompt positions up to {top - 3} \+ max_new_tokens 3 "
        rf"exceeds .*n_positions {top}",
    ):
        generate(module, params, ids, mask, max_new_tokens=3, hooks=Hooks(position_ids=jnp.asarray(pos)))
    pos[0, -1] = cfg.max_position_embeddings  # one past the table: would gather NaN
    msg = rf"hooks.position_ids must lie in \[0, {top}\).*got values from 0 to {top}"
    with pytest.raises(ValueError, match=msg):
        generate(module, params, ids, mask, max_new_tokens=1, hooks=Hooks(position_ids=jnp.asarray(pos)))
    with pytest.raises(ValueError, match=msg):
        module.apply(
            {"params": params}, jnp.asarray(ids), jnp.asarray(mask), hooks=Hooks(position_ids=jnp.asarray(pos))
        )


@pytest.mark.parametrize("key", [-1, L, 99, "1"])
def test_film_on_a_missing_layer_is_an_error(setup, key):
    _, _, params, module, fwd = setup
    ids, mask = _batch(seed=15)
    big = jnp.full((B, T, D), 5.0)
    with pytest.raises(ValueError, match=rf"hooks.film has key {key!r}: .*range\({L}\)"):
        fwd(params, ids, mask, Hooks(film={key: FiLM(gamma_out=big, beta_out=big)}), False)


def test_forward_mode_autodiff_through_the_decoder(setup):
    """jvp / jacfwd / hessian (interpretability users' tools) go through every layer."""
    _, cfg, params, module, _ = setup
    ids, mask = _batch(seed=16)
    emb = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, D)).astype(np.float32)) * 0.1

    def logit(offset):
        return (
            module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), hooks=Hooks(embed_offset=offset))
            .logits[:, -1, 3]
            .sum()
        )

    direction = jnp.asarray(np.random.default_rng(6).normal(size=emb.shape).astype(np.float32))
    # jitted: op-by-op dispatch of the unrolled layers took ~4x longer than compiling
    _, tangent = jax.jit(lambda e, d: jax.jvp(logit, (e,), (d,)))(emb, direction)
    grad = jax.jit(jax.grad(logit))(emb)
    np.testing.assert_allclose(float(tangent), float(jnp.vdot(grad, direction)), rtol=1e-4)
    assert abs(float(tangent)) > 1e-3
    jac = jax.jit(jax.jacfwd(lambda o: logit(emb.at[0, -1].set(o))))(emb[0, -1])
    np.testing.assert_allclose(np.asarray(jac), np.asarray(grad[0, -1]), rtol=1e-4, atol=1e-6)
    hess = jax.jit(jax.hessian(lambda o: logit(emb.at[0, -1, :4].set(o))))(emb[0, -1, :4])
    assert hess.shape == (4, 4) and np.allclose(hess, hess.T, atol=1e-4)


def test_fused_attention_path_masks_like_the_hand_written_one(monkeypatch):
    """The GPU path (jax.nn.dot_product_attention) checked on CPU with its XLA implementation:
    GQA, padding and causal masks give the hand-written path's values on real query rows."""
    from jsteer.backbones import attention as A

    rng = np.random.default_rng(0)
    b, t, kh, g, h = 2, 6, 2, 3, 8
    q = jnp.asarray(rng.normal(size=(b, t, kh, g, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kh, h)), jnp.bfloat16) for _ in range(2))
    key_mask = np.ones((b, t), bool)
    key_mask[1, :2] = False
    visible = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & key_mask[:, None, :])[:, None, None]
    ref = A.dot_product_attention(q, k, v, scale=0.3, visible=visible)
    monkeypatch.setattr(A, "_backend", lambda: "gpu")
    monkeypatch.setattr(A, "_FUSED_IMPLEMENTATION", "xla")
    got = A.attention(q, k, v, scale=0.3, visible=visible)
    real = key_mask  # query rows that have a visible key
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(ref, np.float32)[real], atol=2e-2)
    assert np.isfinite(np.asarray(got, np.float32)).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 2, 5)])
def test_fused_attention_masks_right_padded_keys_by_lengths(monkeypatch, pads, causal):
    """A call over right-padded keys takes the lengths branch (cuDNN's PADDING_CAUSAL, or PADDING
    for an encoder's padding bias), any other mask the dense-mask branch (causal) or the
    hand-written path (the bias). All give the hand-written values on real rows, forward and
    gradient. The branch taken is spied on."""
    from jsteer.backbones import attention as A

    rng = np.random.default_rng(3)
    b, t, kh, g, h = len(pads), 7, 2, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, kh, g, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kh, h)), jnp.bfloat16) for _ in range(2))
    right = np.ones((b, t), np.int32)
    for i, n in enumerate(pads):
        right[i, t - n :] = 0
    monkeypatch.setattr(A, "_backend", lambda: "gpu")
    monkeypatch.setattr(A, "_FUSED_IMPLEMENTATION", "xla")
    taken = []
    fused = jax.nn.dot_product_attention

    def spy(*a, **kw):
        taken.append("lengths" if kw.get("key_value_seq_lengths") is not None else "mask")
        return fused(*a, **kw)

    monkeypatch.setattr(A.jax.nn, "dot_product_attention", spy)
    for key_mask, ok in ((right, True), (right[:, ::-1].copy(), not any(pads))):
        visible = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & (key_mask[:, None, :] > 0))[:, None, None]
        bias = None
        if not causal:
            visible, bias = None, jnp.where(jnp.asarray(key_mask) > 0, 0.0, -1e30)[:, None, None, None, :]
        rp = A.RightPadded.of(jnp.asarray(key_mask), causal=causal)
        assert bool(rp.ok) == ok
        np.testing.assert_array_equal(np.asarray(rp.lengths), np.maximum(key_mask.sum(-1), 1))

        def loss(q, path, visible=visible, bias=bias, rp=rp, key_mask=key_mask):
            if path == "hand":
                out = A.dot_product_attention(q, k, v, scale=0.3, visible=visible, bias=bias)
            else:
                out = A.attention(q, k, v, scale=0.3, visible=visible, bias=bias, right_padded=rp)
            real = jnp.asarray(key_mask > 0)[:, :, None, None, None]
            return jnp.sum(jnp.where(real, out.astype(jnp.float32), 0.0) ** 2), out

        (_, ref), gref = jax.value_and_grad(loss, has_aux=True)(q, "hand")
        taken.clear()
        (_, got), grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(q, "fused")
        assert set(taken) == ({"lengths", "mask"} if causal else {"lengths"})  # lax.cond traces both branches
        real = key_mask > 0
        np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(ref, np.float32)[real], atol=2e-2)
        np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(gref, np.float32), atol=6e-2, rtol=2e-2)
        assert np.isfinite(np.asarray(got, np.float32)).all()


def test_decoder_hands_right_padding_to_the_fused_path(setup, monkeypatch):
    """A bf16 decoder forward without a cache passes RightPadded to attention (with a cache, a
    sliding window or hooks.attn_bias, it does not), and on the 'GPU' path (XLA implementation here) gives
    the CPU path's logits on real tokens, for right- and left-padded batches."""
    from jsteer.backbones import attention as A

    _, cfg, params, _, _ = setup
    lcfg = families.config_from_hf(
        transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=48,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=2,
            max_position_embeddings=P,
        ).to_dict()
    )
    module = jd.Decoder(lcfg, dtype=jnp.bfloat16)
    ids, left = _batch(seed=4)
    p = module.init(jax.random.key(0), jnp.asarray(ids), jnp.asarray(left))["params"]
    p = jax.tree.map(lambda x: x * 10, p)  # O(1) logits, so a wrong mask shows
    seen = []
    real_attention = A.attention

    def spy(*a, right_padded=None, **kw):
        seen.append(right_padded is not None)
        return real_attention(*a, right_padded=right_padded, **kw)

    monkeypatch.setattr(jd, "attention", spy)

    def logits(mod, mask, **kw):  # a fresh jit per call: each traces under the patches of its moment
        return jax.jit(lambda p, i, m: mod.apply({"params": p}, i, m, **kw).logits)(p, jnp.asarray(ids), mask)

    for mask in (left, left[:, ::-1].copy()):
        cpu = logits(module, jnp.asarray(mask))
        with monkeypatch.context() as m:
            m.setattr(A, "_backend", lambda: "gpu")
            m.setattr(A, "_FUSED_IMPLEMENTATION", "xla")
            gpu = logits(module, jnp.asarray(mask))
        assert _maxdiff(cpu, gpu, mask) <= 0.02 * float(jnp.abs(cpu).max())
    assert seen and all(seen)
    seen.clear()
    jax.eval_shape(
        lambda p: module.apply({"params": p}, jnp.asarray(ids), jnp.asarray(left), cache=lcfg.init_cache(B, T + 2)), p
    )
    sw = jd.Decoder(dataclasses.replace(lcfg, sliding_window=4), dtype=jnp.bfloat16)
    jax.eval_shape(lambda p: sw.apply({"params": p}, jnp.asarray(ids), jnp.asarray(left)), p)
    bias = Hooks(attn_bias=jnp.zeros((B, T, T)))
    jax.eval_shape(lambda p: module.apply({"params": p}, jnp.asarray(ids), jnp.asarray(left), hooks=bias), p)
    assert len(seen) == 3 * L and not any(seen)


def test_forward_mode_on_gpu_takes_the_portable_attention(monkeypatch):
    """cuDNN attention is a custom VJP, which forward-mode autodiff cannot pass. A bf16 decoder on
    the GPU path (cuDNN's implementation traced on CPU, its version checks patched; lowered for
    cuda by jax.export) takes cuDNN under grad and the portable path under jvp / hessian; a jvp
    around a call jitted before takes it inside jsteer.forward_mode(), and fails to lower without."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn_fa
    from jax import export

    import jsteer
    from jsteer.backbones import attention as A

    cfg = DecoderConfig.llama(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2
    )
    module = jd.Decoder(cfg, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(19).integers(0, V, (2, 16)), jnp.int32)  # cuDNN: T % 16 == 0 here
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), module.init(jax.random.key(0), ids)["params"])
    offset = jnp.zeros((2, 16, 32), jnp.bfloat16)
    monkeypatch.setattr(A, "_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn_fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn_fa, "check_compute_capability", lambda capability: True)

    def logit(o, apply=module.apply):
        return apply({"params": p}, ids, hooks=Hooks(embed_offset=o)).logits[:, -1, 3].sum()

    def kernels(fn, *args):  # cuDNN attention calls in fn's program
        return str(jax.make_jaxpr(fn)(*args)).count("dot_product_attention_fwd")

    assert kernels(logit, offset) > 0 and kernels(jax.grad(logit), offset) > 0
    jvp = lambda o: jax.jvp(logit, (o,), (jnp.ones_like(o),))  # noqa: E731
    assert kernels(jvp, offset) == 0
    assert kernels(jax.hessian(lambda x: logit(offset.at[0, -1, :2].set(x))), offset[0, -1, :2]) == 0
    export.export(jax.jit(jvp), platforms=["cuda"])(offset)

    jitted = jax.jit(module.apply)  # traced (with cuDNN) before the jvp reaches it
    assert kernels(lambda o: logit(o, jitted), offset) > 0
    jvp_jitted = lambda o: jax.jvp(lambda o: logit(o, jitted), (o,), (jnp.ones_like(o),))  # noqa: E731
    with pytest.raises(TypeError, match="forward-mode"):
        export.export(jax.jit(jvp_jitted), platforms=["cuda"])(offset)
    with jsteer.forward_mode():
        assert kernels(jvp_jitted, offset) == 0
        export.export(jax.jit(jvp_jitted), platforms=["cuda"])(offset)


def test_scanned_layer_stack_equals_unrolled(setup):
    """scan_layers=True: one nn.scan over stacked params gives the unrolled stack's logits,
    captures, FiLM, interventions, KV-cache decoding and greedy tokens."""
    from jsteer import interventions as iv
    from jsteer.decode import generate

    _, cfg, params, module, _ = setup
    scfg = dataclasses.replace(cfg, scan_layers=True)
    sparams = jp.stack_layers(params, cfg.num_layers)
    assert jax.tree.leaves(sparams["layers"])[0].shape[0] == L
    jax.tree.map(np.testing.assert_array_equal, jp.unstack_layers(sparams), params)
    axes = jp.logical_axes(sparams)
    assert axes["layers"]["attn"]["q"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    ids, mask = _batch(seed=17)
    rng = np.random.default_rng(7)
    hooks = Hooks(
        interventions={
            "resid_post.1": iv.Add(jnp.asarray(rng.normal(size=D), jnp.float32), 2.0),
            "attn_out.0": iv.Scale(1.2),
        },
        film={0: FiLM(beta_out=jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32))},
    )
    capture = ("resid_post.0", "ffn_in.1", "final", "resid_pre.1", "ffn_hidden.1")
    a = module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), hooks=hooks, capture=capture)
    b = jd.Decoder(scfg).apply({"params": sparams}, jnp.asarray(ids), jnp.asarray(mask), hooks=hooks, capture=capture)
    assert _maxdiff(a.logits, b.logits, mask) <= TOL
    for k in capture:
        assert _maxdiff(a.captured[k], b.captured[k], mask) <= TOL, k
    # layer 1's input is layer 0's output; the FFN hidden is F wide
    np.testing.assert_array_equal(np.asarray(a.captured["resid_pre.1"]), np.asarray(a.captured["resid_post.0"]))
    assert a.captured["ffn_hidden.1"].shape == (B, T, cfg.intermediate_size)
    gen_hooks = Hooks(interventions=hooks.interventions)
    ta = generate(module, params, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=8, hooks=gen_hooks)
    tb = generate(jd.Decoder(scfg), sparams, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=8, hooks=gen_hooks)
    np.testing.assert_array_equal(np.asarray(ta.tokens), np.asarray(tb.tokens))
    assert scfg.init_cache(2, 5).k.shape == (L, 2, H, D // H, 5)
    with pytest.raises(ValueError, match="capture"):
        jd.Decoder(scfg).apply({"params": sparams}, jnp.asarray(ids), jnp.asarray(mask), output_hidden_states=True)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_policies_keep_gradients_and_cut_memory(scan):
    cfg = DecoderConfig.llama(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        scan_layers=scan,
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 64)))
    params = jax.jit(jd.Decoder(cfg).init)(jax.random.PRNGKey(0), ids)["params"]

    def grad_fn(remat):
        module = jd.Decoder(dataclasses.replace(cfg, remat=remat))
        return jax.jit(jax.grad(lambda p: jax.nn.log_softmax(module.apply({"params": p}, ids).logits).mean()))

    ref = grad_fn("none")(params)
    temp = {}
    for remat in ("none", "dots", "full"):
        fn = grad_fn(remat).lower(params).compile()  # one compile gives the values and the memory
        for a, b in zip(jax.tree.leaves(fn(params)), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
        temp[remat] = fn.memory_analysis().temp_size_in_bytes
    if scan:  # what the backward keeps shrinks with the policy (XLA:CPU: 37 -> 13 -> 7 MB at 6 layers)
        assert temp["full"] < temp["dots"] < temp["none"], temp
    with pytest.raises(ValueError, match="remat"):
        dataclasses.replace(cfg, remat="some")


def _dots(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _dots(sub)


def test_bf16_end_to_end_accumulates_in_fp32(setup):
    """bf16 params and activations: every matrix product, forward and backward, takes bf16
    operands (an fp32 x bf16 product runs as an fp32 one on GPUs) and accumulates in fp32 (here:
    XLA:CPU computes each as an fp32 dot); norms and the softmax run in fp32; logits come back fp32."""
    _, cfg, params, _, _ = setup
    module = jd.Decoder(cfg, dtype=jnp.bfloat16)
    pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ids, mask = _batch(seed=18)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def loss(p):
        return jax.nn.log_softmax(module.apply({"params": p}, ids, mask).logits)[..., 0].mean()

    forward = list(_dots(jax.make_jaxpr(loss)(pb).jaxpr))
    assert len(forward) >= 7 * L  # q, k, v, o, gate/up, down per layer, attention's two products, the logits
    fp32_results = [e for e in forward if e.params["preferred_element_type"] == jnp.float32]
    assert len(fp32_results) == 2 * L + 1  # the scores, the weighted values, the logits
    backward = list(_dots(jax.make_jaxpr(jax.grad(loss))(pb).jaxpr))
    assert len(backward) >= 3 * len(forward)
    for eqn in forward + backward:
        assert {str(v.aval.dtype) for v in eqn.invars} == {"bfloat16"}, eqn
    hlo = jax.jit(jax.grad(loss)).lower(pb).compile().as_text()
    products = re.findall(r"= (\w+)\[[\d,]*\]\{[\d,]*\} dot\(", hlo)
    assert len(products) >= len(backward) and set(products) == {"f32"}, set(products)
    out = module.apply({"params": pb}, ids, mask)
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
