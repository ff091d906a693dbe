"""LM-Steer on a real (tiny, random) jsteer LLaMA: hooks vs head math, exactness at eps=0 / W=0,
training on a toy corpus, steered generation without recompiles, transfer to a rotated model,
artifacts and bad inputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer import decode
from jsteer.steer import artifact, head, highlight, toy, train, transfer


@pytest.fixture(scope="module")
def lm():
    return toy.lm(seed=0, norm_scale_noise=0.3)


@pytest.fixture(scope="module")
def trained(lm):
    """A steer trained 300 steps on the toy corpus with the paper's defaults (rank 16)."""
    texts, values = toy.corpus(200, seed=0)
    cache = train.cache_lm(lm, texts, values, batch_size=64)
    emb = np.asarray(lm.output_embeddings())
    cfg = train.TrainConfig(rank=16, steps=300, batch_size=16)
    params, hist = train.train(cache, emb, cfg)
    return params, hist, cache, cfg


def _ids(lm, words):
    return [lm.tokenizer.token_to_id(w) for w in words]


@pytest.fixture(scope="module")
def fwd(lm):
    """One jitted forward shared by every params tree of the same shapes (fewer compiles)."""
    return jax.jit(lambda p, ids, mask, hooks: lm.module.apply({"params": p}, ids, mask, hooks=hooks))


def test_hook_matches_head_apply_and_zero_steer_is_exact(lm, fwd):
    ids, mask = lm.tokenizer.batch_encode(["the movie was good", "we saw it"], left_pad=True)
    base = fwd(lm.params, ids, mask, None)
    p = head.init(jax.random.PRNGKey(3), lm.config.hidden_size, 2, rank=4, scale=2.0)
    eps = jnp.asarray([[0.3, -0.2], [0.1, 0.4]])
    steered = fwd(lm.params, ids, mask, head.to_hooks(p, eps))
    np.testing.assert_array_equal(steered.hidden, base.hidden)  # hidden is the unsteered final-norm output
    want = head.apply(p, base.hidden, lm.output_embeddings(), eps)
    np.testing.assert_allclose(steered.logits, want, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(steered.logits) - np.asarray(base.logits)).max() > 0.1
    zero = fwd(lm.params, ids, mask, head.to_hooks(p, jnp.zeros((2, 2))))
    np.testing.assert_array_equal(zero.logits, base.logits)
    w0 = fwd(lm.params, ids, mask, head.to_hooks({"p1": jnp.zeros_like(p["p1"]), "p2": p["p2"]}, eps))
    np.testing.assert_array_equal(w0.logits, base.logits)


def test_trained_steer_shifts_sentiment_word_probabilities(lm, trained):
    params, hist, cache, cfg = trained
    assert hist["loss"][-1] < hist["loss"][0] - 0.1, hist["loss"]
    pos, neg = _ids(lm, toy.POSITIVE), _ids(lm, toy.NEGATIVE)
    ids, mask = lm.tokenizer.batch_encode(["the movie was", "it is a", "we saw the film and it", "the"], left_pad=True)
    h = lm.forward(ids, mask).hidden[:, -1]
    emb = lm.output_embeddings()

    def mass(value):
        p = jax.nn.softmax(head.apply(params, h, emb, head.make_eps(value, cfg.eps0)), -1)
        return float(p[:, pos].sum(-1).mean()), float(p[:, neg].sum(-1).mean())

    (pp, pn), (mp, mn), (zp, zn) = mass(5.0), mass(-5.0), mass(0.0)
    assert pp > 2 * zp and mp < 0.5 * zp, (pp, zp, mp)
    assert mn > 2 * zn and pn < 0.5 * zn, (mn, zn, pn)
    # and on the training objective: each class is fitted better by its own sign
    e = np.asarray(emb)
    for cls in (1.0, -1.0):
        part = cache.subset(np.flatnonzero(cache.values[:, 0] == cls))
        own, other = (train.eval_nll(params, part, e, [v], cfg.eps0) for v in (cls, -cls))
        assert own < other - 0.05, (cls, own, other)


def test_highlight_picks_the_sentiment_words(lm, trained):
    """Scores contrast the steer at +v against -v; the best span (<= 5 tokens) is the run of
    words of the steered class."""
    params, _, _, cfg = trained
    text = "the plot is bad awful and the music was good great happy and the end"
    ids = lm.tokenizer.encode(text)
    words = text.split()  # target j is word j (ids[0] is <s>)
    h = lm.forward(jnp.asarray([ids])).hidden[:, :-1]
    spans = {}
    for v in (3.0, -3.0):
        _, (s, e, _) = highlight.highlight(
            params,
            h,
            lm.output_embeddings(),
            jnp.asarray([ids[1:]]),
            head.make_eps(v, cfg.eps0),
            eps_base=head.make_eps(-v, cfg.eps0),
        )
        spans[v] = words[int(s[0]) : int(e[0])]
    assert 2 <= len(spans[3.0]) <= 5 and set(spans[3.0]) <= set(toy.POSITIVE), spans
    neg = set(spans[-3.0])
    assert neg & set(toy.NEGATIVE) and not neg & set(toy.POSITIVE) and len(spans[-3.0]) <= 5, spans


def test_steered_generation_changes_with_eps_without_recompiling(lm, trained):
    params, _, _, cfg = trained
    prompts = ["the movie was", "we saw the film and it"] * 4
    pos, neg = set(toy.POSITIVE), set(toy.NEGATIVE)

    def run(value):  # eps [B, S]: one compiled loop for every call below
        hooks = head.to_hooks(params, head.make_eps(np.full((len(prompts), 1), value), cfg.eps0))
        return lm.generate(prompts, max_new_tokens=12, temperature=1.0, seed=1, hooks=hooks)

    out_pos = run(5.0)
    n_compiled = decode.compiled_count()
    out_neg = run(-5.0)
    out_mid = run(0.5)
    assert decode.compiled_count() == n_compiled, "a new eps value recompiled the generate loop"
    # eps of another flavour (weak-typed from a Python product, or bf16) reuses the loop too
    eps = head.make_eps(np.full((len(prompts), 1), 2.0), cfg.eps0)
    weak = jnp.asarray(np.rint(np.asarray(eps) / cfg.eps0).astype(np.int32)) * cfg.eps0
    assert weak.weak_type and weak.dtype == jnp.float32
    for other in (weak, jnp.asarray(eps, jnp.bfloat16)):
        lm.generate(prompts, max_new_tokens=12, temperature=1.0, seed=1, hooks=head.to_hooks(params, other))
    assert decode.compiled_count() == n_compiled, "a weak-typed / bf16 eps recompiled the generate loop"

    def count(outs, vocab):
        return sum(w in vocab for o in outs for w in o.split())

    assert count(out_pos, pos) > count(out_pos, neg) and count(out_neg, neg) > count(out_neg, pos), (out_pos, out_neg)
    assert out_mid != out_pos
    # per-row eps: row b steered by its own value
    per_row = head.make_eps(np.where(np.arange(len(prompts)) % 2 == 0, 5.0, -5.0)[:, None], cfg.eps0)
    mixed = lm.generate(prompts, max_new_tokens=12, temperature=1.0, seed=1, hooks=head.to_hooks(params, per_row))
    assert count(mixed[0::2], pos) > count(mixed[0::2], neg) and count(mixed[1::2], neg) > count(mixed[1::2], pos)
    assert decode.compiled_count() == n_compiled
    with pytest.raises(ValueError, match=r"eps has shape \(3, 2\), expected \[8, 2\]"):
        lm.generate(prompts, max_new_tokens=12, hooks=head.to_hooks(params, jnp.zeros((3, 2))))


def _rotated(lm, rot):
    """The same function as ``lm`` with its residual stream rotated by ``rot`` (x -> R x):
    per-layer RMSNorm scales are folded into the reading projections first."""
    p = jax.tree_util.tree_map(np.asarray, lm.params)
    assert np.all(p["final_norm"]["scale"] == 1.0), "final norm must be identity for an exact rotation"
    out = {"embed": {"embedding": p["embed"]["embedding"] @ rot.T}, "final_norm": {"scale": p["final_norm"]["scale"]}}
    for name, layer in p.items():
        if not name.startswith("layers_"):
            continue
        att, mlp = dict(layer["attn"]), dict(layer["mlp"])
        g1, g2 = layer["attn_norm"]["scale"], layer["ffn_norm"]["scale"]
        for k in ("q", "k", "v"):  # kernels [D, heads, head_dim]: rotate the input axis
            att[k] = {"kernel": np.einsum("de,enh->dnh", rot, g1[:, None, None] * att[k]["kernel"])}
        att["o"] = {"kernel": att["o"]["kernel"] @ rot.T}
        for k in ("gate", "up"):
            mlp[k] = {"kernel": rot @ (g2[:, None] * mlp[k]["kernel"])}
        mlp["down"] = {"kernel": mlp["down"]["kernel"] @ rot.T}
        ones = np.ones_like(g1)
        out[name] = {"attn": att, "mlp": mlp, "attn_norm": {"scale": ones}, "ffn_norm": {"scale": ones}}
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), out)
    return lm.replace(params=params, provenance={"source": "rotated", "sha256": "0" * 64})


def test_transfer_to_rotated_model_reproduces_steered_logits(lm, trained, fwd):
    params, _, _, cfg = trained
    d = lm.config.hidden_size
    rot, _ = np.linalg.qr(np.random.default_rng(7).normal(size=(d, d)))
    lm_b = _rotated(lm, rot)
    ids, mask = lm.tokenizer.batch_encode(["the movie was good", "it is a sad end"], left_pad=True)
    base = fwd(lm.params, ids, mask, None).logits
    np.testing.assert_allclose(fwd(lm_b.params, ids, mask, None).logits, base, atol=1e-4)
    vocab = lm.tokenizer.backend.get_vocab()
    ia, ib = transfer.shared_anchors(vocab, lm_b.tokenizer.backend.get_vocab())
    hm = transfer.fit_map(np.asarray(lm.output_embeddings()), np.asarray(lm_b.output_embeddings()), ia, ib)
    np.testing.assert_allclose(hm, rot.T, atol=1e-3)
    moved = transfer.transfer(params, hm)
    eps = head.make_eps(np.full((2, 1), 5.0), cfg.eps0)
    want = fwd(lm.params, ids, mask, head.to_hooks(params, eps)).logits
    got = fwd(lm_b.params, ids, mask, head.to_hooks(moved, eps)).logits
    assert np.abs(np.asarray(want) - np.asarray(base)).max() > 0.5  # the steer matters
    np.testing.assert_allclose(got, want, atol=2e-3)
    # the untransferred steer on the rotated model does not
    assert np.abs(np.asarray(fwd(lm_b.params, ids, mask, head.to_hooks(params, eps)).logits) - want).max() > 0.1


def test_artifact_roundtrip_refuses_other_model(lm, trained, tmp_path):
    params, _, _, cfg = trained
    d, v = lm.config.hidden_size, lm.config.vocab_size
    artifact.save(
        str(tmp_path / "s"),
        params,
        base_model=lm.identity,
        hidden_size=d,
        vocab_size=v,
        eps0=cfg.eps0,
        steer_names=["sentiment"],
    )
    back, meta = artifact.load(str(tmp_path / "s"), model_identity=lm.identity)
    assert meta["steer_names"] == ["sentiment"] and meta["dummy"] is True and meta["kind"] == "lowrank"
    np.testing.assert_array_equal(back["p1"], params["p1"])
    other = toy.lm(seed=1)
    with pytest.raises(artifact.WrongModelError, match="jsteer steer transfer"):
        artifact.load(str(tmp_path / "s"), model_identity=other.identity)
    artifact.save(
        str(tmp_path / "t"),
        params,
        base_model=other.identity,
        hidden_size=d,
        vocab_size=v,
        transferred_from=lm.identity,
    )
    _, meta_t = artifact.load(str(tmp_path / "t"), model_identity=other.identity)
    assert meta_t["transferred_from"] == lm.identity
    with pytest.raises(ValueError, match="hidden size"):
        artifact.save(str(tmp_path / "u"), params, base_model="x", hidden_size=d + 1, vocab_size=v)


def test_bad_training_inputs_give_clear_errors(lm, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl.*empty"):
        train.load_labeled(str(empty))
    one_class = tmp_path / "pos.jsonl"
    one_class.write_text("\n".join(json.dumps({"sentence": "good film", "label": "4"}) for _ in range(3)))
    with pytest.raises(ValueError, match="both positive and negative"):
        train.load_labeled(str(one_class), "sst5")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"sentence": "x", "label": "4"}) + "\n{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        train.load_labeled(str(bad), "sst5")
    with pytest.raises(ValueError, match="no training texts"):
        train.cache_hidden(lambda i, m: None, [], np.zeros(0))
    with pytest.raises(ValueError, match="text 1 has 1 token"):
        train.cache_hidden(lambda i, m: None, [[2, 5], [2]], np.ones(2))
    with pytest.raises(ValueError, match="none of the 1 training texts"):
        train.cache_lm(lm, [""], np.ones(1))
    import types

    gpt2_like = types.SimpleNamespace(config=types.SimpleNamespace(position_table_size=64), tokenizer=lm.tokenizer)
    with pytest.raises(ValueError, match=r"max_len 128 \(--max-len\) exceeds the model's 64 learned positions"):
        train.cache_lm(gpt2_like, ["good film"], np.ones(1))  # before any text is encoded or run


def test_sst5_and_jigsaw_label_mapping(shared_data):
    texts, values = train.load_labeled(str(shared_data / "sst5" / "dev.jsonl"))
    raw = [json.loads(x) for x in open(shared_data / "sst5" / "dev.jsonl")]
    kept = [r for r in raw if r["label"] != "2"]
    assert len(texts) == len(kept)
    assert all((v > 0) == (r["label"] in ("3", "4")) for v, r in zip(values, kept))
    texts, values = train.load_labeled(str(shared_data / "jigsaw_toxic_subset" / "test.csv"), limit=100)
    assert len(texts) == 100 and (values > 0).sum() == 50


def test_trainer_matches_a_plain_adam_loop(lm):
    """Steer training runs on jsteer.train.Trainer only; it is the paper's plain Adam: a
    minimal optax loop over the same batches (what the removed "optax" engine ran) gives the
    same losses and params to fp32 tolerance. ``engine="optax"`` is still accepted (same path)."""
    import optax

    texts, values = toy.corpus(40, seed=2)
    cache = train.cache_lm(lm, texts, values, batch_size=64)
    emb = np.asarray(lm.output_embeddings())
    cfg = train.TrainConfig(rank=4, steps=8, batch_size=8, log_every=1)
    got, hist = train.train(cache, emb, cfg)

    params = train.init_params(cfg, emb.shape[1], emb.shape[0])
    opt = optax.adam(cfg.lr)
    state = opt.init(params)
    loss_fn = train.cached_loss_fn(cfg)
    rng = np.random.default_rng(cfg.seed)
    budget = train.default_budget(cache, cfg.batch_size)
    losses = []
    for _ in range(cfg.steps):
        batch = train.sample_batch(cache, rng, cfg.batch_size, budget)
        loss, grads = jax.value_and_grad(lambda p, b: loss_fn({"steer": p, "embedding": jnp.asarray(emb)}, b)[0])(
            params, batch
        )
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    np.testing.assert_allclose(hist["loss"], losses, rtol=1e-5)
    assert hist["step"] == list(range(cfg.steps))
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(params[k]), rtol=1e-4, atol=1e-6)
    init = train.init_params(train.TrainConfig(rank=4), emb.shape[1], emb.shape[0])
    assert np.abs(np.asarray(got["p1"]) - np.asarray(init["p1"])).max() > 0.05  # it trained
    again, _ = train.train(cache, emb, train.TrainConfig(rank=4, steps=8, batch_size=8, log_every=1, engine="optax"))
    for k in got:
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(got[k]))
    with pytest.raises(ValueError, match="unknown training engine"):
        train.train(cache, emb, train.TrainConfig(rank=4, steps=1, engine="torch"))


def test_sigterm_ends_steer_training_instead_of_returning_a_cut_steer(lm, monkeypatch):
    """The engine's preemption exit (143) after the current step: a sweep never records a cut run."""
    import os
    import signal

    texts, values = toy.corpus(20, seed=1)
    cache = train.cache_lm(lm, texts, values, batch_size=16)
    real, calls = train.sample_batch, []

    def batch_then_sigterm(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # SIGTERM while the second batch is drawn
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    monkeypatch.setattr(train, "sample_batch", batch_then_sigterm)
    with pytest.raises(SystemExit) as stop:
        train.train(cache, np.asarray(lm.output_embeddings()), train.TrainConfig(rank=4, steps=6, batch_size=4))
    assert stop.value.code == 143 and len(calls) < 6


@pytest.mark.parametrize("kind", ["blacklist", "offset"])
def test_baselines_decode_through_the_steer_hook(lm, fwd, kind):
    """A baseline in ``Hooks(steer=...)`` gives the logits of ``head.apply`` (the training math),
    leaves the hidden states alone, and is exact at eps = 0."""
    ids, mask = lm.tokenizer.batch_encode(["the movie was good", "we saw it"], left_pad=True)
    base = fwd(lm.params, ids, mask, None)
    key = jax.random.PRNGKey(5)
    p = (
        head.init_blacklist(key, lm.config.vocab_size, 2, scale=1.0)
        if kind == "blacklist"
        else head.init_offset(key, lm.config.hidden_size, 2, scale=1.0)
    )
    eps = jnp.asarray([[0.8, -0.5], [-1.0, 0.3]])
    steered = fwd(lm.params, ids, mask, head.to_hooks(p, eps))
    np.testing.assert_array_equal(steered.hidden, base.hidden)
    want = head.apply(p, base.hidden, lm.output_embeddings(), eps)
    np.testing.assert_allclose(steered.logits, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(steered.logits) - np.asarray(base.logits)).max() > 0.1
    zero = fwd(lm.params, ids, mask, head.to_hooks(p, jnp.zeros((2, 2))))
    np.testing.assert_allclose(zero.logits, base.logits, rtol=0, atol=1e-6)


def test_steer_and_baselines_compose_in_one_hook(lm, fwd):
    """compose(steer, blacklist, offset) = each effect in its place: W and v on the final hidden
    state, b on the logits (NumPy re-derivation), in one forward."""
    from jsteer.hooks import compose

    ids, mask = lm.tokenizer.batch_encode(["the movie was good", "we saw it"], left_pad=True)
    D, V = lm.config.hidden_size, lm.config.vocab_size
    st = head.init(jax.random.PRNGKey(1), D, 1, rank=4, scale=1.0)
    bl = head.init_blacklist(jax.random.PRNGKey(2), V, 2, scale=1.0)
    off = head.init_offset(jax.random.PRNGKey(3), D, 1, scale=1.0)
    e_st, e_bl, e_off = jnp.asarray([0.4]), jnp.asarray([[0.7, -0.2], [0.1, 0.5]]), jnp.asarray([-0.9])
    hooks = compose(head.to_hooks(st, e_st, cheapest=False), head.to_hooks(bl, e_bl), head.to_hooks(off, e_off))
    assert hooks.steer.eps.shape == (2, 4)
    out = fwd(lm.params, ids, mask, hooks)
    c = np.asarray(fwd(lm.params, ids, mask, None).hidden, np.float64)
    w = np.asarray(st["p1"][0], np.float64) @ np.asarray(st["p2"][0], np.float64).T
    c2 = c + 0.4 * c @ w.T - 0.9 * np.asarray(off["vec"][0], np.float64)
    want = c2 @ np.asarray(lm.output_embeddings(), np.float64).T
    want += (np.asarray(e_bl, np.float64) @ np.asarray(bl["offset"], np.float64))[:, None, :]
    np.testing.assert_allclose(out.logits, want, rtol=1e-4, atol=1e-4)
