"""LLaMA-family decoder: parity with HF torch (fp32), KV cache, hook semantics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer.backbones import llama
from jsteer.backbones.llama import LlamaConfig, LlamaForCausalLM, params_from_hf
from jsteer.hooks import FiLM, Hooks, Steer

V, T = 101, 9

CASES = {
    # name: (HF config class, model class, kwargs)
    "llama-mha-untied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "mistral-gqa-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=3)),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
}


def build(case: str):
    cfg_cls, model_cls, kw = CASES[case]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, cfg_cls)(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rope_theta=500.0, initializer_range=0.2, rms_norm_eps=1e-5,
        attn_implementation="eager", **kw)
    hf = getattr(transformers, model_cls)(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm scales and biases
        for name, w in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                w.copy_(1.0 + 0.3 * torch.randn_like(w) if name.endswith("norm.weight") else 0.3 * torch.randn_like(w))
    cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
    params = params_from_hf({k: v.numpy() for k, v in hf.state_dict().items()}, cfg)
    return hf, cfg, params


@pytest.fixture(scope="module")
def gqa_untied():
    """GQA, untied output embedding, default RoPE, HF's own init (norm scales 1)."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, initializer_range=0.2,
        tie_word_embeddings=False, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
    return hf, cfg, params_from_hf({k: v.numpy() for k, v in hf.state_dict().items()}, cfg)


def left_padded(batch=3, t=T, seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(3, V, (batch, t))
    mask = np.ones((batch, t), np.int64)
    for b in range(batch):
        mask[b, : (b * 3) % (t - 1)] = 0  # rows with 0, 3, 6 pads
    ids[mask == 0] = 0
    return ids, mask


def hf_logits(hf, ids, mask, **kw):
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        return hf(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                  **kw).logits.numpy()


def run(cfg, params, ids, mask=None, **kw):
    return LlamaForCausalLM(cfg).apply({"params": params}, jnp.asarray(ids),
                                       None if mask is None else jnp.asarray(mask), **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf_left_padded(case):
    hf, cfg, params = build(case)
    ids, mask = left_padded()
    ref = hf_logits(hf, ids, mask)
    out = run(cfg, params, ids, mask)
    real = mask.astype(bool)
    assert out.logits.shape == (3, T, V) and out.hidden.shape == (3, T, 32)
    err = np.abs(np.asarray(out.logits) - ref)[real].max()
    assert err <= 1e-5, f"{case}: max |logit diff| {err}"
    assert np.isfinite(np.asarray(out.logits)).all(), "pad positions must not produce NaN/inf"
    with torch.no_grad():
        pos = np.clip(mask.cumsum(-1) - 1, 0, None)
        h_ref = hf.model(torch.tensor(ids), attention_mask=torch.tensor(mask),
                         position_ids=torch.tensor(pos)).last_hidden_state.numpy()
    assert np.abs(np.asarray(out.hidden) - h_ref)[real].max() <= 1e-5


def test_config_roundtrip_and_errors():
    _, cfg, _ = build("llama-gqa-tied-llama3rope")
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.num_kv_heads == 2 and cfg.tie_word_embeddings
    assert LlamaConfig.from_hf(cfg.to_dict()) == cfg
    hf_again = transformers.LlamaConfig(**cfg.to_dict())  # the dict is a valid HF config
    assert LlamaConfig.from_hf(hf_again.to_dict()) == cfg
    for m in ("mistral-gqa-window", "qwen2-bias-tied"):
        c = build(m)[1]
        assert LlamaConfig.from_hf(c.to_dict()) == c
    d = cfg.to_dict()
    with pytest.raises(ValueError, match="model_type 'gpt_neox'"):
        LlamaConfig.from_hf({**d, "model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf({**d, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(cfg, num_kv_heads=3)


def test_params_from_hf_errors(gqa_untied):
    hf, cfg, _ = gqa_untied
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        params_from_hf(missing, cfg)
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    with pytest.raises(ValueError, match=r"k_proj.*\(32, 32\).*\(16, 32\)"):
        params_from_hf(bad, cfg)
    with pytest.raises(ValueError, match="unexpected"):
        params_from_hf(sd, dataclasses.replace(cfg, num_layers=1))
    # helpers: untied output embedding is lm_head.weight, input is embed_tokens.weight
    p = params_from_hf(sd, cfg)
    np.testing.assert_array_equal(np.asarray(llama.output_embeddings(p, cfg)), sd["lm_head.weight"])
    np.testing.assert_array_equal(np.asarray(llama.input_embeddings(p)), sd["model.embed_tokens.weight"])


def test_cached_decoding_matches_full_forward(gqa_untied):
    _, cfg, params = gqa_untied
    ids, mask = left_padded()
    full = np.asarray(run(cfg, params, ids, mask).logits)
    cache = cfg.init_cache(3, T + 2)  # spare slots must stay invisible
    model = LlamaForCausalLM(cfg)
    step = jax.jit(lambda p, i, m, c: model.apply({"params": p}, i, m, cache=c))
    got = []
    for lo, hi in [(0, 5), (5, 7), (7, 8), (8, 9)]:  # prefill, a 2-token chunk, then single tokens
        out = step(params, ids[:, lo:hi], mask[:, lo:hi], cache)
        cache = out.cache
        got.append(np.asarray(out.logits))
    got = np.concatenate(got, axis=1)
    real = mask.astype(bool)
    assert np.abs(got - full)[real].max() <= 1e-5
    assert int(cache.index) == T and cache.pos.tolist() == mask.sum(-1).tolist()
    assert np.isfinite(got).all()
    # explicit positions: the next position is one past the largest real one
    pos = np.array([[0, 1, 2, 3, 9, 9, 9, 9, 9]] * 3) * mask
    out = model.apply(
        {"params": params}, ids, mask, cache=cfg.init_cache(3, T), hooks=Hooks(position_ids=jnp.asarray(pos)))
    assert out.cache.pos.tolist() == [10, 10, 10]


def test_identity_hooks_and_hook_plumbing(gqa_untied):
    hf, cfg, params = gqa_untied
    ids, mask = left_padded()
    base = run(cfg, params, ids, mask, output_hidden_states=True)
    same = run(cfg, params, ids, mask, hooks=Hooks(), output_hidden_states=True)
    np.testing.assert_array_equal(np.asarray(base.logits), np.asarray(same.logits))
    assert len(base.hidden_states) == cfg.num_layers + 1

    z = jnp.zeros((3, T, 32))
    zero = Hooks(embed_offset=z, film={0: FiLM(z, z, z, z)}, attn_bias=jnp.zeros((3, T, T)),
                 steer=Steer(eps=jnp.zeros(1), w=jnp.ones((1, 32, 32))))
    np.testing.assert_allclose(np.asarray(run(cfg, params, ids, mask, hooks=zero).logits),
                               np.asarray(base.logits), rtol=0, atol=1e-6)

    last = run(cfg, params, ids, mask, last_logits_only=True)
    np.testing.assert_allclose(np.asarray(last.logits[:, 0]), np.asarray(base.logits[:, -1]), atol=1e-6)

    # step=True adds step_offset to every token instead of embed_offset
    off = jnp.asarray(np.random.RandomState(1).randn(3, 32), jnp.float32)
    a = run(cfg, params, ids, mask, step=True, hooks=Hooks(step_offset=off, embed_offset=z + 5.0))
    b = run(cfg, params, ids, mask, hooks=Hooks(embed_offset=jnp.broadcast_to(off[:, None], (3, T, 32))))
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), atol=1e-6)


def test_film_embed_offset_and_positions_match_hf_with_torch_hooks(gqa_untied):
    """FiLM 'in' = post-attention RMSNorm output, 'out' = layer output; embed_offset after the
    lookup; position_ids override. Reproduced in HF with forward hooks / inputs_embeds."""
    hf, cfg, params = gqa_untied
    ids, mask = left_padded()
    rs = np.random.RandomState(2)
    g_in, b_in, g_out, b_out, emb = (0.5 * rs.randn(3, T, 32).astype(np.float32) for _ in range(5))
    pos = rs.randint(0, 40, (3, T))
    hooks = Hooks(embed_offset=jnp.asarray(emb), position_ids=jnp.asarray(pos),
                  film={1: FiLM(jnp.asarray(g_in), jnp.asarray(b_in), jnp.asarray(g_out), jnp.asarray(b_out))})
    ours = np.asarray(run(cfg, params, ids, mask, hooks=hooks).logits)

    layer = hf.model.layers[1]
    h1 = layer.post_attention_layernorm.register_forward_hook(
        lambda m, i, o: o * (1 + torch.tensor(g_in)) + torch.tensor(b_in))
    h2 = layer.register_forward_hook(lambda m, i, o: o * (1 + torch.tensor(g_out)) + torch.tensor(b_out))
    try:
        with torch.no_grad():
            x = hf.model.embed_tokens(torch.tensor(ids)) + torch.tensor(emb)
            ref = hf(inputs_embeds=x, attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits.numpy()
    finally:
        h1.remove()
        h2.remove()
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= 1e-5
    assert np.abs(ours - np.asarray(run(cfg, params, ids, mask).logits))[real].max() > 1e-2  # hooks did act


def test_attn_bias_hides_keys_like_the_padding_mask(gqa_untied):
    hf, cfg, params = gqa_untied
    ids = np.random.RandomState(3).randint(3, V, (2, T))
    hidden_key = 4
    bias = np.zeros((2, T, T), np.float32)
    bias[:, :, hidden_key] = -1e9
    pos = jnp.asarray(np.tile(np.arange(T), (2, 1)))
    ours = np.asarray(run(cfg, params, ids, hooks=Hooks(attn_bias=jnp.asarray(bias), position_ids=pos)).logits)
    mask = np.ones((2, T), np.int64)
    mask[:, hidden_key] = 0
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.asarray(pos))).logits.numpy()
    keep = np.arange(T) != hidden_key
    assert np.abs(ours - ref)[:, keep].max() <= 1e-5


def test_steer_matches_numpy(gqa_untied):
    _, cfg, params = gqa_untied
    ids, mask = left_padded()
    rs = np.random.RandomState(4)
    p1, p2 = (0.3 * rs.randn(2, 32, 3).astype(np.float32) for _ in range(2))
    eps = np.array([[0.5, -1.0], [2.0, 0.0], [0.0, 0.3]], np.float32)  # per row
    steer = Steer(eps=jnp.asarray(eps), p1=jnp.asarray(p1), p2=jnp.asarray(p2))
    base = run(cfg, params, ids, mask)
    out = run(cfg, params, ids, mask, hooks=Hooks(steer=steer))
    np.testing.assert_array_equal(np.asarray(out.hidden), np.asarray(base.hidden))  # hidden stays unsteered
    c = np.asarray(base.hidden, np.float64)
    w = np.einsum("sdr,ser->sde", p1, p2)  # W_i = P1_i P2_i^T
    c_steered = c + np.einsum("bs,sde,bte->btd", eps, w, c)
    e = np.asarray(llama.output_embeddings(params, cfg), np.float64)
    expected = c_steered @ e.T
    np.testing.assert_allclose(np.asarray(out.logits), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(expected - c @ e.T).max() > 1e-2


@pytest.mark.parametrize("key", [-1, 2, 99, "1"])
def test_film_on_a_missing_layer_is_an_error(gqa_untied, key):
    _, cfg, params = gqa_untied
    ids, mask = left_padded()
    big = jnp.full((3, T, 32), 5.0)
    with pytest.raises(ValueError, match=rf"hooks.film has key {key!r}: .*range\({cfg.num_layers}\)"):
        run(cfg, params, ids, mask, hooks=Hooks(film={key: FiLM(gamma_out=big, beta_out=big)}))
