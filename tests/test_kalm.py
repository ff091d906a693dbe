"""KALM: the typed mixture is a distribution, matches a NumPy re-derivation, reduces to the
plain head with one type, type-as-input is causal and starts as the plain KALM; decoding with
type priors; the recipe data readers; and a tiny LM that types held-out words from context."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.decoder import Decoder
from jsteer.kalm import data as kdata
from jsteer.kalm import decode
from jsteer.kalm import train as ktrain
from jsteer.kalm.head import (
    KalmConfig,
    KalmHead,
    TypedVocab,
    token_log_prob,
    type_posterior,
    typed_token_log_probs,
    word_log_probs,
)
from jsteer.kalm.model import KalmLM, next_token_log_probs

V, D = 12, 8
TYPES = [[3, 4, 5], [5, 6], [9]]  # word 5 is in two types


def perturb(tree, key, scale=0.5):
    """``tree`` + N(0, scale) noise, drawn on the host (seeded by ``key``): a jax.random.normal per
    leaf compiles one random program per shape, ~0.4 s each on XLA:CPU."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype), tree)


def head_out(types=TYPES, general=None, seed=0, share=True):
    vocab = TypedVocab.build(V, types, general)
    head = KalmHead(KalmConfig(num_types=len(types), type_dim=4, share_word_embedding=share), vocab.num_pairs, D)
    h = jax.random.normal(jax.random.PRNGKey(seed), (2, 3, D))
    logits = jax.random.normal(jax.random.PRNGKey(seed + 1), (2, 3, V)) * 2
    p = perturb(head.init(jax.random.PRNGKey(2), h, logits, vocab)["params"], jax.random.PRNGKey(3))
    out = head.apply({"params": p}, h, logits, vocab)
    return vocab, out, jax.tree.map(np.asarray, p), np.asarray(h), np.asarray(logits)


def test_typed_vocab_build_and_errors():
    assert np.asarray(TypedVocab.build(V, TYPES, disjoint=True).general).tolist() == [
        w not in (3, 4, 5, 6, 9) for w in range(V)
    ]
    vocab = TypedVocab.build(V, TYPES)
    assert list(zip(vocab.pair_type.tolist(), vocab.pair_word.tolist())) == [
        (0, 3),
        (0, 4),
        (0, 5),
        (1, 5),
        (1, 6),
        (2, 9),
    ]
    assert vocab.pair_index[5].tolist() == [2, 3, -1] and vocab.pair_index[7].tolist() == [-1, -1, -1]
    assert vocab.words_of(2) == [5, 6]
    assert vocab.types_of(5) == [1, 2] and vocab.types_of(9) == [3] and vocab.types_of(0) == []
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TypedVocab.build(V, [[3, 12]])
    with pytest.raises(ValueError, match="empty vocabulary"):
        TypedVocab.build(V, [[3], []])


@pytest.mark.parametrize("share", [True, False])
def test_mixture_is_a_distribution_and_matches_numpy(share):
    general = np.ones(V, bool)
    general[[0, 9]] = False  # word 9 exists only as an entity of type 3
    vocab, out, p, h, logits = head_out(general=general, share=share)
    full = np.asarray(word_log_probs(out, vocab), np.float64)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, atol=1e-5)

    # NumPy: P(y|c) = sum_j P(j|c) P(y|j,c), P(y|j,c) = 0 outside V_j
    def softmax(x, m):
        z = np.where(m, x, -np.inf)
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    ptype = softmax(np.einsum("btd,de,ke->btk", h, p["type_proj"]["kernel"], p["type_embed"]), np.ones(4, bool))
    want = ptype[..., :1] * softmax(logits, general)
    for j, words in enumerate(TYPES):
        u = [int(np.asarray(vocab.pair_index)[w, j]) for w in words]  # rows of W^(j)
        z = np.einsum("btd,ud->btu", h, p["typed_out"][u]) + p["typed_bias"][u]
        if share:  # W^(j)_y = E_y + offset: h . E_y is the general logit of y
            z = z + logits[..., words]
        pj = np.zeros((2, 3, V))
        pj[..., words] = softmax(z, np.ones(len(u), bool))
        want += ptype[..., j + 1 : j + 2] * pj
    np.testing.assert_allclose(np.exp(full), want, atol=1e-6)
    # a word outside a type's vocabulary has probability exactly 0 under that type
    every = jnp.broadcast_to(jnp.arange(V), (6, V)).reshape(2, 3, V)  # every word as a target
    per_type = np.exp(np.asarray(jax.vmap(lambda t: typed_token_log_probs(out, vocab, t), -1, -2)(every)))
    for j, words in enumerate(TYPES):
        outside = [w for w in range(V) if w not in words]
        assert np.all(per_type[:, :, outside, j + 1] == 0.0)
        np.testing.assert_allclose(per_type[:, :, words, j + 1].sum(-1), 1.0, atol=1e-6)
    assert np.all(np.exp(np.asarray(out.general_logp))[..., [0, 9]] == 0.0)
    # the cheap per-target path agrees with the full mixture
    targets = jnp.asarray([[3, 5, 7], [9, 1, 6]])
    got = np.asarray(token_log_prob(out, vocab, targets))
    np.testing.assert_allclose(got, np.take_along_axis(full, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-5)
    post = np.exp(np.asarray(type_posterior(out, vocab, targets)))
    np.testing.assert_allclose(post.sum(-1), 1.0, atol=1e-6)
    assert post[0, 1, 3] == 0.0 and post[0, 1, 1] > 0 and post[0, 1, 2] > 0  # word 5: types 1, 2 (+ general)
    assert post[1, 0, 0] == 0.0 and post[1, 0, 3] == pytest.approx(1.0)  # word 9: only type 3


def _np_logsumexp(x, axis=-1):
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf for an impossible word
        return np.squeeze(top, axis) + np.log(np.sum(np.exp(x - top), axis=axis))


def _np_log_softmax(x, mask):
    z = np.where(mask, x, -np.inf)
    return z - _np_logsumexp(z)[..., None]


@pytest.mark.parametrize("share", [True, False])
def test_word_log_probs_with_extreme_logits_match_numpy_log_space(share):
    """Logits 250 nats apart: every word's log P(y | c) matches a float64 log-space NumPy
    re-derivation (a word ~100 nats below the best one does not underflow to -1e30)."""
    general = np.ones(V, bool)
    general[0] = False  # word 0: in no vocabulary at all
    vocab = TypedVocab.build(V, TYPES, general)
    head = KalmHead(KalmConfig(num_types=len(TYPES), type_dim=4, share_word_embedding=share), vocab.num_pairs, D)
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, D))
    logits = jax.random.normal(jax.random.PRNGKey(1), (2, 3, V)).at[..., 7].set(150.0).at[..., 3].set(-100.0)
    logits = logits.at[..., 6].set(-60.0)
    p = perturb(head.init(jax.random.PRNGKey(2), h, logits, vocab)["params"], jax.random.PRNGKey(3))
    if not share:  # untied rows do not see the general logits: push word 3 down in type 1 too
        p["typed_bias"] = p["typed_bias"].at[int(vocab.pair_index[3, 0])].add(-100.0)
    out = head.apply({"params": p}, h, logits, vocab)
    got = np.asarray(word_log_probs(out, vocab), np.float64)

    p, h, lg = jax.tree.map(lambda x: np.asarray(x, np.float64), (p, h, logits))
    ltype = _np_log_softmax(np.einsum("btd,de,ke->btk", h, p["type_proj"]["kernel"], p["type_embed"]), True)
    terms = [ltype[..., 0:1] + _np_log_softmax(lg, general)]  # each [B, T, V], -inf where impossible
    for j, words in enumerate(TYPES):
        u = [int(np.asarray(vocab.pair_index)[w, j]) for w in words]
        z = np.einsum("btd,ud->btu", h, p["typed_out"][u]) + p["typed_bias"][u] + (lg[..., words] if share else 0)
        lj = np.full((2, 3, V), -np.inf)
        lj[..., words] = _np_log_softmax(z, True)
        terms.append(ltype[..., j + 1 : j + 2] + lj)
    want = _np_logsumexp(np.stack(terms), axis=0)

    assert np.all(got[..., 0] == np.float32(-1e30)) and np.all(np.isneginf(want[..., 0]))
    assert want[..., 3].max() < -95  # far below the best word (word 7, log P ~ 0)
    np.testing.assert_allclose(got[..., 1:], want[..., 1:], rtol=1e-6, atol=1e-4)
    targets = jnp.asarray([[3, 6, 7], [9, 5, 3]])
    np.testing.assert_allclose(
        np.asarray(token_log_prob(out, vocab, targets)),
        np.take_along_axis(got, np.asarray(targets)[..., None], -1)[..., 0],
        atol=1e-4,
    )


def test_shared_typed_rows_start_at_the_word_embedding():
    """share_word_embedding with zero offsets: P(y | type j, c) is the general softmax renormalised
    over V_j; the untied head has no such tie."""
    vocab = TypedVocab.build(V, TYPES)
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, D))
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (2, 3, V)) * 3, np.float64)
    for share in (True, False):
        head = KalmHead(KalmConfig(num_types=3, type_dim=4, share_word_embedding=share), vocab.num_pairs, D)
        p = head.init(jax.random.PRNGKey(2), h, logits, vocab)["params"]
        assert np.all(np.asarray(p["typed_out"]) == 0) == share
        typed = np.exp(np.asarray(head.apply({"params": p}, h, logits, vocab).typed_logp, np.float64))
        for j, words in enumerate(TYPES[:2]):  # (type 3 has one word: probability 1 either way)
            u = [int(np.asarray(vocab.pair_index)[w, j]) for w in words]
            want = np.exp(logits[..., words]) / np.exp(logits[..., words]).sum(-1, keepdims=True)
            assert np.allclose(typed[..., u], want, atol=1e-6) == share


def test_one_type_is_the_plain_head():
    cfg = ktrain.tiny_llama(V, hidden=16, layers=1, heads=2)
    vocab = TypedVocab.build(V, [])
    kalm = KalmLM(cfg, KalmConfig(num_types=0), num_pairs=0)
    ids = jnp.asarray([[2, 5, 7, 3, 9, 2], [2, 4, 4, 1, 0, 0]])
    mask = (ids > 0).astype(jnp.int32).at[:, 0].set(1)
    p = perturb(ktrain.init_params(kalm, jax.random.PRNGKey(0), vocab), jax.random.PRNGKey(1), 0.1)
    got = next_token_log_probs(kalm, p, ids, mask, vocab)
    plain = next_token_log_probs(Decoder(cfg), p["backbone"], ids, mask, vocab)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=1e-5)
    out = kalm.apply({"params": p}, ids, mask, vocab)
    assert np.all(np.asarray(out.type_logp) == 0.0)  # P(general) = 1
    # NumPy: the mixture is the log-softmax of the backbone's logits
    logits = np.asarray(Decoder(cfg).apply({"params": p["backbone"]}, ids, mask).logits, np.float64)
    want = logits - logits.max(-1, keepdims=True)
    want -= np.log(np.exp(want).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(word_log_probs(out, vocab)), want, atol=1e-5)
    at_targets = np.take_along_axis(want[:, :-1], np.asarray(ids)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), at_targets, atol=1e-5)


def test_type_as_input_starts_as_kalm_and_stays_causal():
    cfg = ktrain.tiny_llama(V, hidden=16, layers=1, heads=2)
    vocab = TypedVocab.build(V, TYPES)
    plain = KalmLM(cfg, KalmConfig(num_types=3, type_dim=4), num_pairs=vocab.num_pairs)
    fed = KalmLM(cfg, KalmConfig(num_types=3, type_dim=4, type_as_input=True), num_pairs=vocab.num_pairs)
    ids = jnp.asarray([[2, 5, 7, 3, 9, 6]])
    mask = jnp.ones_like(ids)
    p = ktrain.init_params(fed, jax.random.PRNGKey(0), vocab)
    assert np.all(np.asarray(p["type_in"]["kernel"]) == 0)
    same = {k: v for k, v in p.items() if k != "type_in"}
    np.testing.assert_allclose(
        np.asarray(next_token_log_probs(fed, p, ids, mask, vocab)),
        np.asarray(next_token_log_probs(plain, same, ids, mask, vocab)),
        atol=1e-6,
    )
    p = {**p, "type_in": perturb(p["type_in"], jax.random.PRNGKey(1), 1.0)}
    a = np.asarray(next_token_log_probs(fed, p, ids, mask, vocab))
    b = np.asarray(next_token_log_probs(plain, same, ids, mask, vocab))
    assert abs(a[0, 0] - b[0, 0]) < 1e-6 and np.abs(a[0, 1:] - b[0, 1:]).max() > 1e-4  # position 0 gets no type
    changed = np.asarray(next_token_log_probs(fed, p, ids.at[0, 4].set(8), mask, vocab))
    np.testing.assert_allclose(changed[0, :3], a[0, :3], atol=1e-6)  # earlier predictions never see later words


# ---------------------------------------------------------------------------------- decoding


def test_decode_types_prior_and_positions():
    vocab = kdata.Vocab([kdata.PAD, kdata.UNK, kdata.EOS, "apple", "kiwi", "tea", "eat"])
    types = {"apple": ("fruits",), "tea": ("drinks",), "kiwi": ("fruits",)}
    prior = np.exp(decode.type_prior(vocab, types, ("fruits", "drinks"), exclude=["kiwi"]))
    np.testing.assert_allclose(prior.sum(-1), 1.0)
    assert prior[vocab("apple")].argmax() == 1 and prior[vocab("tea")].argmax() == 2
    np.testing.assert_allclose(prior[vocab("kiwi")], 1 / 3)  # held out: uninformative
    fwd = np.log(np.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]))
    bwd = np.log(np.array([[0.1, 0.2, 0.7], [0.1, 0.2, 0.7]]))
    assert decode.decode_types([fwd]).tolist() == [1, 2]  # the general type is never chosen
    assert decode.decode_types([fwd, bwd]).tolist() == [2, 2]
    marg = np.log(np.array([0.5, 0.1, 0.4]))  # type 2 is common a priori: dividing it out flips word 0
    assert decode.decode_types([fwd, bwd], marginal_logp=marg).tolist() == [1, 2]
    lines = [["eat", "kiwi", ",", "tea"], ["kiwi"]]
    ids, _ = kdata.encode_lines(lines, vocab, length=8)
    rev, _ = kdata.encode_lines(lines, vocab, length=8, reverse=True)
    pos = decode.word_positions(lines, {"kiwi": 1}, length=8)
    assert pos == [(0, 1, 2, 1), (1, 0, 0, 1)]
    for li, f, b, _ in pos:  # position t predicts token t + 1
        assert ids[li, f + 1] == vocab("kiwi") and rev[li, b + 1] == vocab("kiwi")


# ---------------------------------------------------------------------------------- data


def test_recipe_data_readers(shared_data):
    root = shared_data / "kalm_namedentitylm"
    lex = kdata.read_lexicon(root)
    assert set(lex) == set(kdata.TYPE_NAMES)
    assert "buttermilk" in lex["dairy"] and "sausage" in lex["proteins"]  # list line / ",2" suffix cleaned
    assert kdata.entry_words("beef (ground)") == ["beef"] and kdata.entry_words("brown sugar") == ["brown", "sugar"]
    assert kdata.tokenize("Navy beans,  water, beef") == ["navy", "beans", ",", "water", ",", "beef"]
    types = kdata.word_types(lex, {"apple", "apples", "water", "beef"})
    assert types["apples"] == ("fruits",) and types["beef"] == ("proteins",) and "cranberries" not in types
    lines = kdata.read_lines(root / "raw_data" / "uncleaned_test_ing.txt", limit=50)
    assert len(lines) == 50 and all(lines)
    with pytest.raises(kdata.DataError, match="missing type file"):
        kdata.read_lexicon(root, types=("dairy", "spices"))


# ---------------------------------------------------------------------------------- end to end


def test_kalm_types_held_out_words_from_context():
    fruits, drinks = ["apple", "pear", "plum", "fig", "kiwi"], ["tea", "milk", "juice", "soda", "water"]
    held = {"kiwi": 1, "water": 2}  # in the text, but not in the type vocabularies
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(400):
        f, d = rng.choice(fruits), rng.choice(drinks)
        lines.append(
            ["eat", "the", f, ",", "sip", "the", d] if rng.random() < 0.5 else ["sip", "the", d, ",", "eat", "the", f]
        )
    vocab = kdata.Vocab.build(lines, min_count=1)
    types = {w: ("fruits",) for w in fruits} | {w: ("drinks",) for w in drinks}
    tv = TypedVocab.build(
        len(vocab), kdata.type_word_ids(types, vocab, ("fruits", "drinks"), exclude=held), disjoint=True
    )  # entity words only through their types: identifiable latent types
    assert tv.types_of(vocab("kiwi")) == [] and tv.types_of(vocab("fig")) == [1]
    ids, mask = kdata.encode_lines(lines, vocab, length=9)
    model = ktrain.make_model(
        "kalm", ktrain.tiny_llama(len(vocab), hidden=32, layers=1, heads=2, max_len=16), tv, type_dim=8
    )
    params = ktrain.init_params(model, jax.random.PRNGKey(0), tv)
    params, info = ktrain.train(
        model, params, ids, mask, tv, ktrain.LMTrainConfig(lr=1e-2, batch_size=32, steps=80, warmup_steps=5)
    )
    assert info["losses"][-1] < 0.6 * info["losses"][0]
    assert len(jax.tree.leaves(params)[0].sharding.device_set) == jax.device_count()  # data-parallel by default
    # after "eat the" the model expects a fruit, after "sip the" a drink: held-out words get typed
    test = [["eat", "the", "kiwi", ",", "sip", "the", "water"], ["sip", "the", "water", ",", "eat", "the", "kiwi"]]
    tid, tmask = kdata.encode_lines(test, vocab, length=9)
    ctx = ktrain.context_types(model, params, tid, tmask, tv)
    pos = decode.word_positions(test, held, length=9)
    pred = decode.decode_types([ctx[[li for li, *_ in pos], [f for _, f, _, _ in pos]]])
    assert pred.tolist() == [g for *_, g in pos] and len(pos) == 4
    ppl = ktrain.perplexity(model, params, tid, tmask, tv)["perplexity"]
    assert ppl < len(vocab) / 2
