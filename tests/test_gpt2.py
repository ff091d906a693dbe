"""GPT-2 backbone: parity with HF transformers (torch, fp32, eval), KV cache, hooks, conversion."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer.backbones import gpt2 as jg
from jsteer.hooks import FiLM, Hooks, Steer

V, D, L, H, P = 97, 32, 2, 4, 64
B, T = 3, 9
PADS = (0, 3, 5)  # left padding per row
TOL = 1e-5


def _hf_model(tie: bool = True, **kw) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=L, n_head=H,
                                  bos_token_id=V - 1, eos_token_id=V - 1, tie_word_embeddings=tie, **kw)
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
    kw = dict(attention_mask=torch.tensor(mask, dtype=torch.long),
              position_ids=torch.tensor(_positions(mask), dtype=torch.long), output_hidden_states=True)
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
    cfg = jg.GPT2Config.from_hf(hf.config.to_dict())
    params = jg.params_from_hf(_state(hf), cfg)
    module = jg.GPT2LMHeadModel(cfg)
    fwd = jax.jit(lambda p, i, m, h, hs: module.apply({"params": p}, i, m, hooks=h, output_hidden_states=hs),
                  static_argnums=4)
    return hf, cfg, params, module, fwd


# ----------------------------------------------------------------------------- parity


def test_parity_left_padded(setup):
    hf, cfg, params, module, fwd = setup
    ids, mask = _batch()
    ref = _hf_forward(hf, ids, mask)
    out = fwd(params, ids, mask, None, True)
    d_logits = _maxdiff(out.logits, ref.logits, mask)
    print(f"\nGPT-2 logits max|diff| on real tokens: {d_logits:.2e} (max |logit| {ref.logits.abs().max():.2f})")
    assert d_logits <= TOL
    # `hidden` is the ln_f output (HF's last hidden state)
    assert _maxdiff(out.hidden, ref.hidden_states[-1], mask) <= TOL
    # embeddings + block outputs; HF's last entry is after ln_f, ours is the raw block output
    assert len(out.hidden_states) == L + 1 == len(ref.hidden_states)
    for i in range(L):
        assert _maxdiff(out.hidden_states[i], ref.hidden_states[i], mask) <= TOL, i
    assert np.isfinite(np.asarray(out.logits)).all()  # pad rows stay NaN-free
    # unpadded batch without an attention mask
    full = ids[:1]
    with torch.no_grad():
        ref1 = hf(torch.tensor(full, dtype=torch.long)).logits
    out1 = jax.jit(lambda p, i: module.apply({"params": p}, i))(params, jnp.asarray(full))
    assert _maxdiff(out1.logits, ref1) <= TOL


def test_parity_untied_lm_head_and_variants():
    hf = _hf_model(tie=False, activation_function="gelu", scale_attn_by_inverse_layer_idx=True, n_inner=48)
    cfg = jg.GPT2Config.from_hf(hf.config.to_dict())
    assert not cfg.tie_word_embeddings and cfg.n_inner == 48 and cfg.activation_function == "gelu"
    params = jg.params_from_hf(_state(hf), cfg)
    np.testing.assert_array_equal(jg.output_embeddings(params, cfg), hf.lm_head.weight.detach().numpy())
    ids, mask = _batch(seed=2)
    out = jax.jit(jg.GPT2LMHeadModel(cfg).apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    assert _maxdiff(out.logits, _hf_forward(hf, ids, mask).logits, mask) <= TOL


# ----------------------------------------------------------------------------- KV cache


def test_cached_decoding_matches_full_forward(setup):
    _, cfg, params, module, fwd = setup
    ids, mask = _batch(seed=3, t=14)
    full = fwd(params, ids, mask, None, False)

    step = jax.jit(lambda p, i, m, c, s: module.apply({"params": p}, i, m, cache=c, step=s), static_argnums=4)
    cache = cfg.init_cache(B, 16)
    chunks = [(0, 7), (7, 10), (10, 11), (11, 12), (12, 13), (13, 14)]  # prefill, a 3-token chunk, 1-token steps
    logits = []
    for a, b in chunks:
        out = step(params, ids[:, a:b], mask[:, a:b], cache, b - a == 1)
        cache = out.cache
        logits.append(np.asarray(out.logits))
    logits = np.concatenate(logits, axis=1)
    d = _maxdiff(logits, full.logits, mask)
    print(f"\ncached vs full forward max|diff|: {d:.2e}")
    assert d <= TOL
    assert int(cache.index) == 14
    np.testing.assert_array_equal(np.asarray(cache.pos), mask.sum(-1))
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :14], mask)
    assert not np.asarray(cache.mask)[:, 14:].any()


def test_init_cache_shapes(setup):
    _, cfg, *_ = setup
    c = cfg.init_cache(2, 10, jnp.bfloat16)
    assert len(c.k) == L and len(c.v) == L
    assert c.k[0].shape == (2, H, D // H, 10) and c.k[0].dtype == jnp.bfloat16
    assert c.v[0].shape == (2, H, 10, D // H) and c.v[0].dtype == jnp.bfloat16
    assert c.mask.shape == (2, 10) and int(c.index) == 0 and c.pos.shape == (2,)


# ----------------------------------------------------------------------------- hooks


def test_identity_hooks_bit_identical(setup):
    _, cfg, params, module, fwd = setup
    ids, mask = _batch(seed=4)
    ref = fwd(params, ids, mask, None, True)
    zeros = jnp.zeros((B, T, D))
    identities = [
        Hooks(),
        Hooks(embed_offset=zeros, step_offset=jnp.zeros((B, D)), attn_bias=jnp.zeros((B, T, T)),
              position_ids=jnp.asarray(_positions(mask)),
              film={0: FiLM(zeros, zeros, zeros, zeros), 1: FiLM(gamma_in=zeros)},
              steer=Steer(eps=jnp.zeros((2,)), p1=jnp.ones((2, D, 3)), p2=jnp.ones((2, D, 3)))),
    ]
    for hooks in identities:
        out = fwd(params, ids, mask, hooks, True)
        np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(ref.logits))
        np.testing.assert_array_equal(np.asarray(out.hidden), np.asarray(ref.hidden))
        for a, b in zip(out.hidden_states, ref.hidden_states):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_embed_offset_matches_hf_inputs_embeds(setup):
    hf, _, params, _, fwd = setup
    ids, mask = _batch(seed=5)
    off = np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
    out = fwd(params, ids, mask, Hooks(embed_offset=jnp.asarray(off)), False)
    emb = hf.transformer.wte.weight.detach().numpy()[ids] + off  # before position embeddings
    ref = _hf_forward(hf, ids, mask, inputs_embeds=emb)
    assert _maxdiff(out.logits, ref.logits, mask) <= TOL
    assert _maxdiff(out.logits, fwd(params, ids, mask, None, False).logits, mask) > 1e-2


def test_film_matches_torch_forward_hooks(setup):
    hf, _, params, _, fwd = setup
    ids, mask = _batch(seed=6)
    rng = np.random.default_rng(1)
    g_in, b_in, g_out, b_out = (rng.normal(size=(B, T, D)).astype(np.float32) * 0.5 for _ in range(4))
    layer = 1
    block = hf.transformer.h[layer]
    handles = [
        block.ln_2.register_forward_hook(lambda m, i, o: o * (1 + torch.tensor(g_in)) + torch.tensor(b_in)),
        block.register_forward_hook(
            lambda m, i, o: (o[0] if isinstance(o, tuple) else o) * (1 + torch.tensor(g_out)) + torch.tensor(b_out)),
    ]
    try:
        ref = _hf_forward(hf, ids, mask)
    finally:
        for h in handles:
            h.remove()
    film = {layer: FiLM(*(jnp.asarray(a) for a in (g_in, b_in, g_out, b_out)))}
    out = fwd(params, ids, mask, Hooks(film=film), False)
    d = _maxdiff(out.logits, ref.logits, mask)
    assert d <= TOL
    assert _maxdiff(out.logits, fwd(params, ids, mask, None, False).logits, mask) > 1e-2


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


def test_steer_on_final_hidden_only(setup):
    _, cfg, params, _, fwd = setup
    ids, mask = _batch(seed=8)
    rng = np.random.default_rng(2)
    p1, p2 = (rng.normal(size=(2, D, 3)).astype(np.float32) for _ in range(2))
    eps = np.array([[0.5, -1.0], [2.0, 0.0], [0.0, 0.3]], np.float32)  # per-row [B, S]
    steer = Steer(eps=jnp.asarray(eps), p1=jnp.asarray(p1), p2=jnp.asarray(p2))
    base = fwd(params, ids, mask, None, False)
    out = fwd(params, ids, mask, Hooks(steer=steer), False)
    np.testing.assert_array_equal(np.asarray(out.hidden), np.asarray(base.hidden))  # hidden is unsteered
    h = np.asarray(base.hidden, np.float64)
    w = np.einsum("sdr,ser->sde", p1, p2)  # W_i = P1_i P2_i^T
    steered = h + np.einsum("bs,sde,bte->btd", eps, w, h)
    want = steered @ np.asarray(jg.output_embeddings(params, cfg), np.float64).T
    assert _maxdiff(out.logits, want) <= 1e-4


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
    hooks = Hooks(embed_offset=jnp.asarray(off[:, :T]), attn_bias=jnp.asarray(bias[:, :T, :T]),
                  step_offset=jnp.asarray(step_off))
    step_hooks = Hooks(step_offset=jnp.asarray(step_off))
    run = jax.jit(lambda p, i, m, h, c, s: module.apply({"params": p}, i, m, hooks=h, cache=c, step=s),
                  static_argnums=5)
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
        module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask),
                     hooks=Hooks(attn_bias=jnp.zeros((B, T, T + 2))))


def test_positions_past_n_positions_are_refused(setup):
    _, cfg, params, module, _ = setup
    too_long = jnp.zeros((1, cfg.n_positions + 1), jnp.int32)
    with pytest.raises(ValueError, match="n_positions"):
        module.apply({"params": params}, too_long)
    from jsteer.decode import generate
    prompt = jnp.ones((1, cfg.n_positions - 2), jnp.int32)
    generate(module, params, prompt, max_new_tokens=2)               # exactly fits
    with pytest.raises(ValueError, match="n_positions"):
        generate(module, params, prompt, max_new_tokens=3)


# ----------------------------------------------------------------------------- conversion


def test_params_from_hf_names_and_errors(setup):
    hf, cfg, params, module, _ = setup
    sd = _state(hf)
    # bare GPT2Model names (no `transformer.`), plus the causal-mask buffers of old checkpoints
    bare = {k[len("transformer."):]: v for k, v in sd.items() if k.startswith("transformer.")}
    bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, P, P), np.float32))
    bare["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    p2 = jg.params_from_hf(bare, cfg)
    jax.tree.map(np.testing.assert_array_equal, p2, params)
    # tree matches what module.init builds
    init = jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert shapes(init) == shapes(params)
    assert set(params) == {"wte", "wpe", "ln_f"} | {f"h_{i}" for i in range(L)}
    np.testing.assert_array_equal(jg.input_embeddings(params), sd["transformer.wte.weight"])
    np.testing.assert_array_equal(jg.input_embeddings({"params": params}), sd["transformer.wte.weight"])

    missing = dict(sd)
    del missing["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match=r"h\.1\.mlp\.c_fc\.bias"):
        jg.params_from_hf(missing, cfg)
    wrong = dict(sd)
    wrong["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].T
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight.*\(96, 32\).*\(32, 96\)"):
        jg.params_from_hf(wrong, cfg)
    extra = dict(sd)
    extra["transformer.h.0.crossattention.q_attn.weight"] = np.zeros((D, D), np.float32)
    with pytest.raises(ValueError, match="crossattention"):
        jg.params_from_hf(extra, cfg)


def test_config_roundtrip_and_errors(setup):
    hf, cfg, *_ = setup
    assert cfg.n_embd == D and cfg.n_layer == L and cfg.n_head == H and cfg.n_positions == P
    assert cfg.n_inner == 4 * D and cfg.eos_token_id == V - 1 and cfg.stop_ids == (V - 1,)
    multi = jg.GPT2Config.from_hf({**hf.config.to_dict(), "eos_token_id": [3, 5]})
    assert multi.stop_ids == (3, 5) and jg.GPT2Config.from_dict(multi.to_dict()) == multi
    assert jg.GPT2Config.from_dict(json.loads(json.dumps(multi.to_dict()))) == multi
    assert jg.GPT2Config.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown fields"):
        jg.GPT2Config.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="activation_function"):
        jg.GPT2Config.from_hf({**hf.config.to_dict(), "activation_function": "mish2"})
    with pytest.raises(ValueError, match="n_head"):
        jg.GPT2Config.from_hf({**hf.config.to_dict(), "n_head": 5})
    with pytest.raises(ValueError, match="model_type"):
        jg.GPT2Config.from_hf({**hf.config.to_dict(), "model_type": "llama"})
    cfg_no_layers = hf.config.to_dict()
    del cfg_no_layers["n_layer"]
    with pytest.raises(ValueError, match="n_layer"):
        jg.GPT2Config.from_hf(cfg_no_layers)


def test_bf16_activations_close(setup):
    _, cfg, params, _, fwd = setup
    ids, mask = _batch(seed=10)
    ref = fwd(params, ids, mask, None, False)
    out = jax.jit(jg.GPT2LMHeadModel(dataclasses.replace(cfg, dtype="bfloat16")).apply)(
        {"params": params}, jnp.asarray(ids), jnp.asarray(mask))
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
        params, jnp.asarray(ids), jnp.asarray(mask), hooks)
    assert last.logits.shape == (B, 1, V)
    assert _maxdiff(last.logits, np.asarray(full.logits)[:, -1:]) <= TOL
    np.testing.assert_array_equal(np.asarray(last.hidden), np.asarray(full.hidden))
    assert module.dtype == jnp.float32
    assert jg.GPT2LMHeadModel(dataclasses.replace(cfg, dtype="bfloat16")).dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- generation


def test_greedy_generate_matches_hf(setup):
    from jsteer.decode import generate

    hf, cfg, params, module, _ = setup
    n_new = 12
    ids, mask = _batch(seed=12, t=7, pads=(0, 3))  # 2 prompts, the second left-padded
    hf.generation_config.eos_token_id = None  # no early stop on either side
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                          max_new_tokens=n_new, do_sample=False, pad_token_id=0)
    ref = ref[:, ids.shape[1]:].numpy()
    out = generate(module, params, ids, mask, max_new_tokens=n_new)
    print(f"\nHF greedy: {ref.tolist()}\njsteer   : {np.asarray(out.tokens).tolist()}")
    assert ref.shape == (2, n_new)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    np.testing.assert_array_equal(np.asarray(out.lengths), [n_new, n_new])
    # generated continuations are not trivially constant
    assert len(set(ref.ravel().tolist())) > 3


# ----------------------------------------------------------------------------- explicit positions, FiLM keys


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
    out = run(params, jnp.asarray(ids[:, :T]), jnp.asarray(mask[:, :T]),
              Hooks(position_ids=jnp.asarray(pos, jnp.int32)), cfg.init_cache(B, T + 2))
    np.testing.assert_array_equal(np.asarray(out.cache.pos), top[:, 0] + 1)
    logits = [np.asarray(out.logits)]
    cache = out.cache
    for i in (T, T + 1):
        out = run(params, jnp.asarray(ids[:, i:i + 1]), jnp.ones((B, 1), jnp.int32), None, cache)
        cache = out.cache
        logits.append(np.asarray(out.logits))
    assert _maxdiff(np.concatenate(logits, axis=1), full.logits, mask) <= TOL
    np.testing.assert_array_equal(np.asarray(cache.pos), top[:, 0] + 3)


def test_explicit_positions_are_checked_against_n_positions(setup):
    _, cfg, params, module, _ = setup
    from jsteer.decode import generate

    ids, mask = _batch(seed=14)
    pos = np.where(mask > 0, cfg.n_positions - 3, 0).astype(np.int32)  # decoding continues at P - 2
    pos[:, -1] = cfg.n_positions - 3
    generate(module, params, ids, mask, max_new_tokens=2, hooks=Hooks(position_ids=jnp.asarray(pos)))  # fits
    with pytest.raises(ValueError, match=rf"prompt positions up to {cfg.n_positions - 3} \+ max_new_tokens 3 "
                                         rf"exceeds .*n_positions {cfg.n_positions}"):
        generate(module, params, ids, mask, max_new_tokens=3, hooks=Hooks(position_ids=jnp.asarray(pos)))
    pos[0, -1] = cfg.n_positions  # one past the table: would gather NaN
    msg = rf"hooks.position_ids must lie in \[0, {cfg.n_positions}\).*got values from 0 to {cfg.n_positions}"
    with pytest.raises(ValueError, match=msg):
        generate(module, params, ids, mask, max_new_tokens=1, hooks=Hooks(position_ids=jnp.asarray(pos)))
    with pytest.raises(ValueError, match=msg):
        module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask),
                     hooks=Hooks(position_ids=jnp.asarray(pos)))


@pytest.mark.parametrize("key", [-1, L, 99, "1"])
def test_film_on_a_missing_layer_is_an_error(setup, key):
    _, _, params, module, fwd = setup
    ids, mask = _batch(seed=15)
    big = jnp.full((B, T, D), 5.0)
    with pytest.raises(ValueError, match=rf"hooks.film has key {key!r}: .*range\({L}\)"):
        fwd(params, ids, mask, Hooks(film={key: FiLM(gamma_out=big, beta_out=big)}), False)
