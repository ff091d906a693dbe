"""LM-Steer head math, baselines, highlighting and interpretation on random arrays
(NumPy re-derivations); model-level checks live in test_steer_model.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.steer import head, highlight, interpret, transfer

B, T, D, V, S, R = 2, 5, 8, 13, 3, 4


def _rand(seed, *shape, scale=1.0):
    return (scale * np.random.default_rng(seed).normal(size=shape)).astype(np.float32)


def _np_logits(hidden, emb, eps, w):
    """Reference: logits[b,t,v] = e_v^T (I + sum_s eps_bs W_s) c_bt, loops in float64."""
    hidden, emb, w = (np.asarray(x, np.float64) for x in (hidden, emb, w))
    eps = np.asarray(eps, np.float64)
    out = np.zeros(hidden.shape[:2] + (emb.shape[0],))
    for b in range(hidden.shape[0]):
        e = eps[b] if eps.ndim == 2 else eps
        m = np.eye(hidden.shape[-1]) + sum(e[s] * w[s] for s in range(w.shape[0]))
        for t in range(hidden.shape[1]):
            out[b, t] = emb @ (m @ hidden[b, t])
    return out


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("rank", [R, None])
def test_apply_matches_numpy(per_row, rank):
    p = head.init(jax.random.PRNGKey(0), D, S, rank=rank, scale=0.3)
    h, emb = _rand(1, B, T, D), _rand(2, V, D)
    eps = _rand(3, B, S) if per_row else _rand(3, S)
    w = np.einsum("sdr,ser->sde", p["p1"], p["p2"]) if rank else np.asarray(p["w"])
    got = head.apply(p, jnp.asarray(h), jnp.asarray(emb), jnp.asarray(eps))
    ref = _np_logits(h, emb, eps, w)
    assert np.abs(ref).max() > 1.0  # the steer changes things visibly
    assert np.abs(ref - _np_logits(h, emb, eps * 0, w)).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(head.full_matrix(p)), w, rtol=1e-5, atol=1e-6)


def test_apply_under_jit_and_vmap_and_eps_is_traced():
    p = head.init(jax.random.PRNGKey(0), D, S, rank=R, scale=0.3)
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    f = jax.jit(head.apply)
    a = f(p, h, emb, jnp.asarray([1.0, 0.0, 0.0]))
    b = f(p, h, emb, jnp.asarray([0.0, -2.0, 1.0]))
    assert f._cache_size() == 1  # a new eps value reuses the compiled function
    assert not np.allclose(a, b)
    per_example = jax.vmap(lambda x: head.apply(p, x, emb, jnp.asarray([1.0, 0.0, 0.0])))(h)
    np.testing.assert_allclose(per_example, a, rtol=1e-5, atol=1e-5)


def test_zero_eps_and_zero_w_equal_base_exactly():
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    base = jnp.einsum("...d,vd->...v", h, emb)
    p = head.init(jax.random.PRNGKey(0), D, S, rank=R, scale=0.5)
    assert np.array_equal(head.apply(p, h, emb, jnp.zeros(S)), base)
    assert np.array_equal(head.apply(p, h, emb, jnp.zeros((B, S))), base)
    zero_w = {"w": jnp.zeros((S, D, D))}
    assert np.array_equal(head.apply(zero_w, h, emb, jnp.asarray([3.0, -1.0, 7.0])), base)
    zero_p = {"p1": jnp.zeros((S, D, R)), "p2": p["p2"]}
    assert np.array_equal(head.apply(zero_p, h, emb, jnp.asarray([3.0, -1.0, 7.0])), base)


def test_eps_is_linear_and_steers_compose_by_adding():
    """eps scales the logit change linearly; two steers at once = the sum of their changes."""
    p = head.init(jax.random.PRNGKey(4), D, 2, rank=R, scale=0.5)
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    base = head.apply(p, h, emb, jnp.zeros(2))
    d1 = head.apply(p, h, emb, jnp.asarray([1.0, 0.0])) - base
    d2 = head.apply(p, h, emb, jnp.asarray([0.0, 1.0])) - base
    np.testing.assert_allclose(head.apply(p, h, emb, jnp.asarray([-2.5, 0.0])) - base, -2.5 * d1, atol=1e-4)
    np.testing.assert_allclose(head.apply(p, h, emb, jnp.asarray([1.0, 1.0])) - base, d1 + d2, atol=1e-4)


def test_baselines_match_numpy():
    h, emb = _rand(1, B, T, D), _rand(2, V, D)
    eps = _rand(3, B, 2)
    bl = head.init_blacklist(jax.random.PRNGKey(0), V, 2, scale=1.0)
    off = head.init_offset(jax.random.PRNGKey(1), D, 2, scale=1.0)
    base = np.einsum("btd,vd->btv", h, emb)
    ref_bl = base + np.einsum("bs,sv->bv", eps, np.asarray(bl["offset"]))[:, None]
    ref_off = np.einsum("btd,vd->btv", h + np.einsum("bs,sd->bd", eps, np.asarray(off["vec"]))[:, None], emb)
    np.testing.assert_allclose(head.apply(bl, jnp.asarray(h), jnp.asarray(emb), jnp.asarray(eps)), ref_bl, atol=1e-4)
    np.testing.assert_allclose(head.apply(off, jnp.asarray(h), jnp.asarray(emb), jnp.asarray(eps)), ref_off, atol=1e-4)
    # both baselines are logit offsets; the context offset one lies in E's column space
    np.testing.assert_allclose(
        head.logit_bias(off, jnp.asarray(emb), jnp.asarray(eps))[:, None] + base, ref_off, atol=1e-4
    )


def test_apply_on_bf16_inputs_computes_in_float32():
    """A bf16 model's hidden states and embeddings give float32 logits computed from them upcast
    (as the backbones' logits are float32): bf16 log-prob differences would be multiples of 1/64."""
    h, emb = jnp.asarray(_rand(1, B, T, D), jnp.bfloat16), jnp.asarray(_rand(2, V, D), jnp.bfloat16)
    eps = jnp.asarray(_rand(3, B, S))
    for p in (
        head.init(jax.random.PRNGKey(0), D, S, rank=R, scale=1.0),
        head.init_blacklist(jax.random.PRNGKey(1), V, S, scale=1.0),
    ):
        out = head.apply(p, h, emb, eps)
        assert out.dtype == jnp.float32
        want = head.apply(p, h.astype(jnp.float32), emb.astype(jnp.float32), eps)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    p = head.init(jax.random.PRNGKey(0), D, S, rank=R)
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    with pytest.raises(ValueError, match=r"eps has shape \(2,\), expected \[3\]"):
        head.apply(p, h, emb, jnp.zeros(2))
    with pytest.raises(ValueError, match=r"eps has shape \(3, 3\), expected \[3\] or \[2, 3\]"):
        head.apply(p, h, emb, jnp.zeros((3, S)))
    with pytest.raises(ValueError, match="hidden size 8, but the model's hidden size is 6"):
        head.apply(p, h[..., :6], emb[:, :6], jnp.zeros(S))
    with pytest.raises(ValueError, match=r"embedding must be \[V, 8\]"):
        head.apply(p, h, emb[:, :5], jnp.zeros(S))
    with pytest.raises(ValueError, match="not a steer params tree"):
        head.apply({"q": jnp.zeros(3)}, h, emb, jnp.zeros(S))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        head.init(jax.random.PRNGKey(0), D, 1, rank=0)


def test_make_eps_appends_dummy_steer():
    np.testing.assert_allclose(head.make_eps(5.0, 1e-3), [5e-3, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(head.make_eps([[1, -1], [2, 0]], 0.5), [[0.5, -0.5, 0.5], [1, 0, 0.5]])
    # callable from jitted code with traced values
    np.testing.assert_allclose(
        jax.jit(head.make_eps)(jnp.asarray([[1.0, -1], [2, 0]]), 0.5), [[0.5, -0.5, 0.5], [1, 0, 0.5]]
    )
    np.testing.assert_allclose(head.make_eps([2.0], 0.1, dummy=False), [0.2], rtol=1e-6)


# ----------------------------------------------------------------------------- transfer (head level)


def test_transfer_to_rotated_space_reproduces_logits():
    """B's embeddings and contexts are A's rotated by R: the transferred steer gives A's logits."""
    rng = np.random.default_rng(0)
    rot, _ = np.linalg.qr(rng.normal(size=(D, D)))
    emb_a, h_a = _rand(2, V + 20, D), _rand(1, B, T, D)
    emb_b, h_b = emb_a @ rot.T, h_a @ rot.T
    for rank in (R, None):
        p = head.init(jax.random.PRNGKey(1), D, S, rank=rank, scale=0.4)
        hm = transfer.fit_map(emb_a, emb_b, np.arange(V + 20), np.arange(V + 20))
        np.testing.assert_allclose(hm, rot.T, atol=1e-4)  # H = R^T
        q = transfer.transfer(p, hm)
        eps = jnp.asarray([1.5, -0.7, 2.0])
        want = head.apply(p, jnp.asarray(h_a), jnp.asarray(emb_a), eps)
        got = head.apply(q, jnp.asarray(h_b, jnp.float32), jnp.asarray(emb_b, jnp.float32), eps)
        np.testing.assert_allclose(got, want, atol=2e-4)
        # the wrong side (H W H^T) does not reproduce them
        wrong = {"w": jnp.einsum("ab,sbc,dc->sad", hm, head.full_matrix(p), hm)}
        bad = head.apply(wrong, jnp.asarray(h_b, jnp.float32), jnp.asarray(emb_b, jnp.float32), eps)
        assert np.abs(bad - want).max() > 1e-2


def test_transfer_between_different_sizes_and_anchor_errors():
    emb_a, emb_b = _rand(1, 40, D), _rand(2, 40, 6)
    hm = transfer.fit_map(emb_a, emb_b, np.arange(40), np.arange(40))
    assert hm.shape == (D, 6)
    q = transfer.transfer(head.init(jax.random.PRNGKey(0), D, S, rank=R), hm)
    assert q["p1"].shape == (S, 6, R)
    with pytest.raises(ValueError, match="cannot determine a map"):
        transfer.fit_map(emb_a, emb_b, np.arange(3), np.arange(3))
    with pytest.raises(ValueError, match="share no token"):
        transfer.shared_anchors({"a": 0}, {"b": 0})
    a, b = transfer.shared_anchors({"x": 0, "y": 1, "z": 2}, {"z": 5, "x": 9})
    assert a.tolist() == [0, 2] and b.tolist() == [9, 5]
    # word-initial pieces match across tokenizer kinds: byte-level 'Ġthe' (GPT-2, SmolLM2) = SentencePiece '▁the'
    byte_level = {"the": 3, "\u0120the": 4, "\u0120movie": 5, "ing": 6, "\u0120London": 7}
    sentencepiece = {"<s>": 0, "\u2581the": 10, "the": 11, "\u2581movie": 12, "ing": 13, "\u2581Paris": 14}
    a, b = transfer.shared_anchors(byte_level, sentencepiece)
    assert list(zip(a.tolist(), b.tolist())) == [(3, 11), (4, 10), (5, 12), (6, 13)]
    a, b = transfer.shared_anchors(byte_level, sentencepiece, skip=[4])
    assert 4 not in a.tolist() and (5, 12) in zip(a.tolist(), b.tolist())


# ----------------------------------------------------------------------------- highlighting


def _brute_best(scores, max_len):
    best = (-np.inf, 0, 0)
    for i in range(len(scores)):
        for j in range(i + 1, min(len(scores), i + max_len) + 1):
            if scores[i:j].sum() > best[0] + 1e-9:
                best = (scores[i:j].sum(), i, j)
    return best


def test_best_span_matches_brute_force():
    rng = np.random.default_rng(0)
    f = jax.jit(highlight.best_span, static_argnames="max_len")
    for _trial in range(8):
        sc = rng.normal(size=17).astype(np.float32)
        for L in (1, 3, 5):
            s, e, tot = f(jnp.asarray(sc), None, max_len=L)
            ref = _brute_best(sc, L)
            assert abs(float(tot) - ref[0]) < 1e-4 and int(e) - int(s) <= L
            np.testing.assert_allclose(sc[int(s) : int(e)].sum(), ref[0], atol=1e-4)


def test_best_span_respects_mask_and_batches():
    sc = jnp.asarray([[0.0, 5.0, 5.0, 0.0, 1.0], [1.0, 1.0, -3.0, 2.0, 0.5]])
    mask = jnp.asarray([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    s, e, tot = highlight.best_span(sc, mask, max_len=5)
    assert (int(s[0]), int(e[0])) == (1, 2) and float(tot[0]) == 5.0
    assert (int(s[1]), int(e[1])) == (3, 5)


def test_highlight_finds_planted_span():
    """A steer that raises the logits of 3 planted words: highlighting picks exactly their span."""
    rng = np.random.default_rng(1)
    vocab, d, t = 40, 48, 20
    emb = 3.0 * np.linalg.qr(rng.normal(size=(d, vocab)))[0].T.astype(np.float32)  # orthogonal rows
    hidden = rng.normal(size=(1, t, d)).astype(np.float32)
    hidden[..., 0] = 1.0  # a constant feature, read by the steer below
    planted = [7, 8, 9]
    targets = rng.integers(10, vocab, size=(1, t))
    targets[0, 11:14] = planted
    u = emb[planted].mean(0)
    z = np.zeros(d, np.float32)
    z[0] = 1.0
    params = {"w": jnp.asarray(np.outer(u, z)[None])}  # W c = u (c . z) = u
    scores, (s, e, tot) = highlight.highlight(
        params, jnp.asarray(hidden), jnp.asarray(emb), jnp.asarray(targets), jnp.asarray([0.5])
    )
    assert (int(s[0]), int(e[0])) == (11, 14), np.asarray(scores).round(2)
    assert float(scores[0, 11:14].min()) > 0 > float(jnp.median(scores[0]))


# ----------------------------------------------------------------------------- interpretation


def test_explain_recovers_planted_direction():
    rng = np.random.default_rng(2)
    d, vocab = 12, 40
    emb = rng.normal(size=(vocab, d)).astype(np.float32)
    u = emb[5] / np.linalg.norm(emb[5])
    v = rng.normal(size=d)
    v /= np.linalg.norm(v)
    w = 10.0 * np.outer(u, v) + 0.01 * rng.normal(size=(d, d))
    params = {"w": jnp.asarray(w[None], jnp.float32)}
    out = interpret.explain(params, emb, n_dirs=2, top=3, mean_hidden=v, decode=lambda i: f"t{i}")
    assert out[0]["top"][0][0] == "t5"
    assert out[0]["singular_value"] > 9 > out[1]["singular_value"]
    # flipping the typical context flips which end is "top"
    flipped = interpret.explain(params, emb, n_dirs=1, top=3, mean_hidden=-v, decode=lambda i: f"t{i}")
    assert flipped[0]["bottom"][0][0] == "t5"
    assert interpret.promoted_tokens(params, emb, v, np.asarray([1.0]), top=1)[0] == 5
    with pytest.raises(ValueError, match="out of range"):
        interpret.explain(params, emb, steer=3)


def test_stack_composes_steers():
    a = head.init(jax.random.PRNGKey(0), D, 2, rank=R, scale=0.5)
    b = head.init(jax.random.PRNGKey(1), D, 2, rank=R, scale=0.5)
    c = head.init(jax.random.PRNGKey(2), D, 1, rank=None, scale=0.5)
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    ab = head.stack([a, b])
    assert set(ab) == {"p1", "p2"} and ab["p1"].shape == (4, D, R)
    abc = head.stack([a, b, c])
    assert set(abc) == {"w"} and abc["w"].shape == (5, D, D)
    ea, eb, ec = jnp.asarray([1.0, 0.5]), jnp.asarray([-2.0, 0.3]), jnp.asarray([0.7])
    base = jnp.einsum("btd,vd->btv", h, emb)
    want = sum(head.apply(p, h, emb, e) - base for p, e in ((a, ea), (b, eb), (c, ec))) + base
    got = head.apply(abc, h, emb, jnp.concatenate([ea, eb, ec]))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="different hidden sizes"):
        head.stack([a, head.init(jax.random.PRNGKey(3), D + 2, 1, rank=R)])


def test_for_inference_expands_high_rank_only():
    hi = head.init(jax.random.PRNGKey(0), D, S, rank=D, scale=0.5)
    lo = head.init(jax.random.PRNGKey(0), D, S, rank=2, scale=0.5)
    assert set(head.for_inference(hi)) == {"w"} and set(head.for_inference(lo)) == {"p1", "p2"}
    h, emb = jnp.asarray(_rand(1, B, T, D)), jnp.asarray(_rand(2, V, D))
    eps = jnp.asarray(_rand(3, B, S))
    np.testing.assert_allclose(
        head.apply(head.for_inference(hi), h, emb, eps), head.apply(hi, h, emb, eps), rtol=1e-4, atol=1e-4
    )


def test_to_hooks_picks_the_cheaper_form_for_decoding():
    hi = head.init(jax.random.PRNGKey(0), D, S, rank=D, scale=0.5)
    lo = head.init(jax.random.PRNGKey(0), D, S, rank=2, scale=0.5)
    eps = jnp.asarray(_rand(3, B, S))
    auto_hi, auto_lo = head.to_hooks(hi, eps).steer, head.to_hooks(lo, eps).steer
    assert auto_hi.w is not None and auto_hi.p1 is None  # 2 D R >= D^2: expanded once
    assert auto_lo.p1 is not None and auto_lo.w is None  # low rank stays low rank
    forced = head.to_hooks(hi, eps, cheapest=False).steer
    assert forced.p1 is not None and forced.w is None
    np.testing.assert_allclose(
        np.asarray(auto_hi.w),
        np.einsum("sdr,ser->sde", np.asarray(hi["p1"]), np.asarray(hi["p2"])),
        rtol=1e-5,
        atol=1e-6,
    )


def test_hidden_cache_concat_inverts_subset():
    """Caching texts in parts and concatenating equals caching them at once (rows, owners, values)."""
    from jsteer.steer import train

    rng = np.random.default_rng(0)
    encs = [list(rng.integers(1, 50, size=n)) for n in (3, 7, 2, 5, 4)]
    vals = np.stack([np.array([1, -1, 0, 1, -1]), np.arange(5)], 1).astype(np.float32)

    def hidden_fn(ids, mask):
        return jnp.stack([ids, ids * 2], -1).astype(jnp.float32)  # [b, T, 2]

    full = train.cache_hidden(hidden_fn, encs, vals, batch_size=2)
    parts = [full.subset(np.array([0, 1])), full.subset(np.array([2])), full.subset(np.array([3, 4]))]
    cat = train.HiddenCache.concat(parts)
    for f in ("hidden", "targets", "seq", "values", "offsets"):
        np.testing.assert_array_equal(getattr(cat, f), getattr(full, f), err_msg=f)
    with pytest.raises(ValueError, match="steer-value columns 1 != 2"):
        train.HiddenCache.concat([full, train.cache_hidden(hidden_fn, encs, vals[:, 0])])
    with pytest.raises(ValueError, match="no caches"):
        train.HiddenCache.concat([])


def test_train_config_validates_kind_and_init_params_builds_each_kind():
    from jsteer.steer import train

    with pytest.raises(ValueError, match="unknown steer kind 'lowrank': use steer, blacklist or offset"):
        train.TrainConfig(kind="lowrank")
    for kind, want in (("steer", "lowrank"), ("blacklist", "blacklist"), ("offset", "offset")):
        params = train.init_params(train.TrainConfig(kind=kind, rank=R), D, V, num_user_steers=2)
        assert head.kind(params) == want
        assert head.num_steers(params) == 3  # 2 user steers + the dummy


def test_experiment_hidden_caches_are_keyed_by_model_and_texts(tmp_path, monkeypatch, capsys):
    """jsteer.steer.data.cached_hidden (the experiments' caches) reuses a cache only when the model,
    texts, values and max_len that made it are this run's; otherwise it says so and rebuilds it (keyed)."""
    import types

    from jsteer.steer import data as C
    from jsteer.steer import train

    built = []

    def fake_cache_lm(lm, texts, values, max_len, batch_size, progress):
        built.append((lm.identity, list(texts), max_len))
        n = len(texts)
        return train.HiddenCache(
            hidden=np.full((n, 2), len(built), np.float32),
            targets=np.zeros(n, np.int32),
            seq=np.arange(n, dtype=np.int32),
            values=np.asarray(values, np.float32)[:, None],
            offsets=np.arange(n + 1),
        )

    monkeypatch.setattr(train, "cache_lm", fake_cache_lm)
    lm_a, lm_b = types.SimpleNamespace(identity="sha256:aaa"), types.SimpleNamespace(identity="sha256:bbb")
    path = tmp_path / "cache.npz"

    def data(texts, values):
        return lambda: (texts, np.asarray(values, np.float32))

    first = C.cached_hidden(lm_a, path, data(["good film", "bad film"], [1, -1]), max_len=8)
    assert len(built) == 1 and path.exists()
    again = C.cached_hidden(lm_a, path, data(["good film", "bad film"], [1, -1]), max_len=8)
    assert len(built) == 1  # same model, texts, values and max_len: reused
    np.testing.assert_array_equal(again.hidden, first.hidden)
    # The file carries its key, checked by HiddenCache.load as for `jsteer steer train --cache`.
    with pytest.raises(ValueError, match=r"do not match this run \(model: cached 'sha256:aaa', now 'sha256:bbb'\)"):
        train.HiddenCache.load(str(path), key=C.hidden_cache_key(lm_b, ["good film", "bad film"], [1, -1], 8))

    capsys.readouterr()
    for n, (lm, texts, values, max_len) in enumerate(
        [
            (lm_b, ["good film", "bad film"], [1, -1], 8),  # another model
            (lm_b, ["good film", "awful film"], [1, -1], 8),  # other texts
            (lm_b, ["good film", "awful film"], [-1, 1], 8),  # other steer values
            (lm_b, ["good film", "awful film"], [-1, 1], 4),
        ],
        2,
    ):  # another cut
        cache = C.cached_hidden(lm, path, data(texts, values), max_len=max_len)
        assert len(built) == n and built[-1] == (lm.identity, texts, max_len)
        assert cache.hidden[0, 0] == n
        assert "rebuilding cache.npz, made by another run" in capsys.readouterr().out
    assert C.cached_hidden(lm_b, path, data(["good film", "awful film"], [-1, 1]), max_len=4).hidden[0, 0] == 5
    assert len(built) == 5
    # A cache saved without a key (before the experiments keyed theirs) is rebuilt too.
    train.HiddenCache.load(str(path)).save(str(path))
    C.cached_hidden(lm_b, path, data(["good film", "awful film"], [-1, 1]), max_len=4)
    assert len(built) == 6
