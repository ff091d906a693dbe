"""jsteer.decode.generate: HF greedy parity, sampling semantics, hooks, no recompilation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer import decode, sampling
from jsteer.backbones import cpu
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_hf import params_from_hf
from jsteer.backbones.decoder_params import stack_layers
from jsteer.backbones.families import config_from_hf
from jsteer.decode import generate
from jsteer.hooks import FiLM, Hooks, Steer
from jsteer.io import _bucket_length as bucket_length

V, D, N = 89, 32, 6


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
        initializer_range=0.3,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = config_from_hf(hf_cfg.to_dict())
    params = params_from_hf({k: v.numpy() for k, v in hf.state_dict().items()}, cfg)
    return hf, Decoder(cfg), params


def prompts(seed=0, lengths=(8, 5, 2), t=8):
    rs = np.random.RandomState(seed)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for b, n in enumerate(lengths):
        ids[b, t - n :] = rs.randint(3, V, n)
        mask[b, t - n :] = 1
    return ids, mask


def test_greedy_matches_hf_generate(tiny):
    hf, model, params = tiny
    ids, mask = prompts()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(ids).long(),
            attention_mask=torch.tensor(mask).long(),
            max_new_tokens=N,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[:, ids.shape[1] :].numpy()
    out = generate(model, params, ids, mask, max_new_tokens=N)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.lengths.tolist() == [N] * 3
    # top-k = 1 sampling is greedy, whatever the temperature and key
    k1 = generate(model, params, ids, mask, max_new_tokens=N, temperature=1.7, top_k=1, rng=jax.random.PRNGKey(9))
    np.testing.assert_array_equal(np.asarray(k1.tokens), ref)


def test_sampling_keys_rows_and_recompilation(tiny):
    _, model, params = tiny
    ids, mask = prompts(lengths=(4, 4, 4))
    ids[:] = ids[0]  # identical prompts: rows differ only through their keys
    kw = dict(max_new_tokens=N, temperature=1.0)
    key = jax.random.PRNGKey(0)
    a = np.asarray(generate(model, params, ids, mask, rng=key, **kw).tokens)
    n_compiled = decode.compiled_count()
    b = np.asarray(generate(model, params, ids, mask, rng=key, **kw).tokens)
    np.testing.assert_array_equal(a, b)  # reproducible
    assert len({tuple(r) for r in a}) > 1, "rows with different keys should sample differently"
    c = np.asarray(generate(model, params, ids, mask, rng=jax.random.PRNGKey(1), **kw).tokens)
    assert (a != c).any()
    # a row's samples depend only on its own key
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    r1 = np.asarray(generate(model, params, ids, mask, rng=keys, **kw).tokens)
    r2 = np.asarray(generate(model, params, ids, mask, rng=keys.at[1].set(jax.random.PRNGKey(77)), **kw).tokens)
    np.testing.assert_array_equal(r1[[0, 2]], r2[[0, 2]])
    assert (r1[1] != r2[1]).any()

    # changing sampling values, stop-id values, per-row params or prompt text: no new program
    other_ids, other_mask = prompts(seed=5, lengths=(3, 1, 4), t=8)
    generate(model, params, other_ids, other_mask, max_new_tokens=N, temperature=0.3, top_p=0.8, top_k=5)
    generate(
        model, params, ids, mask, max_new_tokens=N, temperature=jnp.asarray([0.0, 0.5, 2.0]), top_p=0.5, stop_ids=(5, 7)
    )
    generate(model, params, ids, mask, max_new_tokens=N)
    assert decode.compiled_count() == n_compiled
    generate(model, params, ids, mask, max_new_tokens=N + 1)  # a new static length does compile
    assert decode.compiled_count() == n_compiled + 1


def _filter_reference(logits, top_k, top_p):
    """NumPy top-k then top-p (nucleus of the renormalised top-k distribution)."""
    bsz, v = logits.shape
    expected = np.full((bsz, v), -np.inf, np.float32)
    for b in range(bsz):
        order = np.argsort(-logits[b], kind="stable")
        k = top_k[b] or v
        kept = order[:k]
        p = np.exp(logits[b, kept].astype(np.float64) - logits[b, kept].max())
        p /= p.sum()
        # nucleus: the smallest prefix with mass >= top_p
        n = int(np.searchsorted(np.cumsum(p), top_p[b] - 1e-7) + 1) if top_p[b] < 1 else k
        expected[b, kept[:n]] = logits[b, kept[:n]]
    return expected


@pytest.mark.parametrize("v", [1000, 1024])  # 1000: the plain reduce; 1024: folded over 16-lane slices
def test_argmax_tokens_is_argmax_with_ties_and_infinities(v):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, v)).astype(np.float32)
    x[0, [5, 700]] = 9.0  # tie: the first wins
    x[1, :] = -np.inf  # nothing finite: token 0, as argmax
    x[2, v - 1] = np.inf
    x[3, :] = 2.5  # all tied
    x[4, [0, v - 1]] = 7.0
    x[5, 3] = np.nan  # NaN: a token in range (argmax: the NaN's)
    got = np.asarray(jax.jit(sampling.argmax_tokens)(jnp.asarray(x)))
    np.testing.assert_array_equal(got[:5], np.argmax(x[:5], -1))
    assert got.dtype == np.int32 and 0 <= got[5] < v


def test_top_k_top_p_filter_matches_numpy():
    rs = np.random.RandomState(0)
    logits = rs.randn(4, 50).astype(np.float32) * 2
    top_k = np.array([0, 5, 0, 3], np.int32)
    top_p = np.array([1.0, 1.0, 0.6, 0.9], np.float32)
    got = np.asarray(sampling._filter_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    np.testing.assert_array_equal(got, _filter_reference(logits, top_k, top_p))


@pytest.mark.parametrize("scale", [6.0, 0.3])  # peaked: nucleus inside the candidates; flat: it is not
def test_top_p_candidate_fast_path_is_exact(scale):
    rs = np.random.RandomState(1)
    logits = (rs.randn(5, 400) * scale).astype(np.float32)
    top_k = np.array([0, 10, 0, 200, 0], np.int32)  # 200 > candidates: needs the full sort
    top_p = np.array([0.9, 1.0, 1.0, 0.95, 0.5], np.float32)
    want = _filter_reference(logits, top_k, top_p)
    for rows in ([0, 1, 2, 4], [0, 1, 2, 3, 4]):
        got = np.asarray(
            sampling._filter_top_k_top_p(
                jnp.asarray(logits[rows]), jnp.asarray(top_k[rows]), jnp.asarray(top_p[rows]), candidates=16
            )
        )
        np.testing.assert_array_equal(got, want[rows])
    kept = np.isfinite(want).sum(axis=1)
    assert (kept[[0, 4]] > 16).any() == (scale < 1)  # the flat case really exercises the fallback


def test_wide_nucleus_bisection_matches_sort():
    """Rows whose nucleus is wider than the candidates take the bisection threshold (no sort): the
    same kept set as the full sort and the NumPy reference, with ties, -inf and negative logits."""
    rs = np.random.RandomState(2)
    logits = (rs.randn(12, 3000) * 0.3 - 4.0).astype(np.float32)
    logits[1, :1500] = np.round(logits[1, :1500], 1)  # many exact ties
    logits[2, rs.rand(3000) < 0.3] = -np.inf  # masked tokens
    logits[3] = 0.0  # all equal: the whole row is kept
    top_k = np.zeros(12, np.int32)
    top_p = np.linspace(0.05, 0.99, 12).astype(np.float32)
    x, k, p = jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)
    got = np.asarray(sampling._filter_top_k_top_p(x, k, p, candidates=16))
    np.testing.assert_array_equal(got, np.asarray(sampling._filter_sorted(x, k, p)))
    untied = [b for b in range(12) if b not in (1, 3)]  # the NumPy reference cuts a tie at the boundary
    np.testing.assert_array_equal(got[untied], _filter_reference(logits, top_k, top_p)[untied])
    assert (np.isfinite(got).sum(axis=1) > 16).sum() >= 10  # most rows really took the bisection
    assert np.isfinite(got[3]).all()


def test_stop_ids_pad_and_lengths(tiny):
    _, model, params = tiny
    ids, mask = prompts()
    free = np.asarray(generate(model, params, ids, mask, max_new_tokens=N).tokens)
    stop = int(free[0, 2])
    out = generate(model, params, ids, mask, max_new_tokens=N, stop_ids=(stop,), pad_id=-1)
    toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(3):
        hits = np.nonzero(free[b] == stop)[0]
        n = hits[0] + 1 if len(hits) else N
        assert lens[b] == n
        np.testing.assert_array_equal(toks[b, :n], free[b, :n])
        assert (toks[b, n:] == -1).all()
    # every row stopping at once exits early with the same output layout
    first = np.unique(free[:, 0])
    all_stop = generate(model, params, ids, mask, max_new_tokens=N, stop_ids=tuple(int(x) for x in first))
    assert np.asarray(all_stop.lengths).tolist() == [1, 1, 1]
    assert (np.asarray(all_stop.tokens)[:, 1:] == 0).all()


def naive_greedy(model, params, ids, mask, n, embed_offset, step_offset, film_gamma, steer):
    """Greedy decoding by a full forward (no cache) each step: prompt positions get
    embed_offset and FiLM, generated positions step_offset, and the steer acts everywhere.
    The sequence has a fixed length t + n; the not-yet-generated tail cannot influence
    earlier positions (causal attention), so one jitted program serves every step."""
    b, t = ids.shape
    seq = np.concatenate([ids, np.zeros((b, n), ids.dtype)], 1)
    full_mask = jnp.asarray(np.concatenate([mask, np.ones((b, n), mask.dtype)], 1))
    hooks = Hooks(
        embed_offset=jnp.concatenate([embed_offset, jnp.broadcast_to(step_offset[:, None], (b, n, D))], 1),
        film={1: FiLM(gamma_in=jnp.concatenate([film_gamma, jnp.zeros((b, n, D))], 1))},
        steer=steer,
    )
    forward = jax.jit(lambda p, s: model.apply({"params": p}, s, full_mask, hooks=hooks).logits)
    for i in range(n):
        logits = forward(params, jnp.asarray(seq))
        seq[:, t + i] = np.asarray(jnp.argmax(logits[:, t + i - 1], -1))
    return seq[:, t:]


def test_hooks_in_generation_match_naive_loop(tiny):
    _, model, params = tiny
    ids, mask = prompts()
    rs = np.random.RandomState(1)
    emb = jnp.asarray(rs.randn(3, 8, D), jnp.float32)
    step = jnp.asarray(rs.randn(3, D), jnp.float32)
    gamma = jnp.asarray(rs.randn(3, 8, D), jnp.float32)
    steer = Steer(
        eps=jnp.asarray([2.0]),
        p1=jnp.asarray(rs.randn(1, D, 4), jnp.float32),
        p2=jnp.asarray(rs.randn(1, D, 4), jnp.float32),
    )
    hooks = Hooks(embed_offset=emb, step_offset=step, film={1: FiLM(gamma_in=gamma)}, steer=steer)
    got = np.asarray(generate(model, params, ids, mask, max_new_tokens=N, hooks=hooks).tokens)
    ref = naive_greedy(model, params, ids, mask, N, emb, step, gamma, steer)
    np.testing.assert_array_equal(got, ref)
    plain = np.asarray(generate(model, params, ids, mask, max_new_tokens=N).tokens)
    assert (got != plain).any(), "the hooks should change the generation"


def test_input_validation_and_buckets(tiny):
    _, model, params = tiny
    ids, mask = prompts()
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, params, ids, mask[:, ::-1], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, params, ids, mask, max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, params, ids, mask, max_new_tokens=2, temperature=jnp.zeros(5))
    assert [bucket_length(n) for n in (1, 16, 17, 100, 2048, 2049)] == [16, 16, 32, 128, 2048, 4096]
    with pytest.raises(ValueError):
        bucket_length(0)


def test_repetition_penalty_and_min_new_tokens_match_hf(tiny):
    hf, model, params = tiny
    ids, mask = prompts()
    n = 12
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(ids).long(),
            attention_mask=torch.tensor(mask).long(),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            repetition_penalty=1.8,
        )[:, ids.shape[1] :].numpy()
    out = generate(model, params, ids, mask, max_new_tokens=n, repetition_penalty=1.8)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    plain = generate(model, params, ids, mask, max_new_tokens=n)
    assert (np.asarray(plain.tokens) != ref).any(), "the penalty should change the greedy tokens"
    # min_new_tokens: HF holds the eos back for that many tokens; pick a stop id greedy would emit early
    stop = int(np.asarray(plain.tokens)[0, 1])
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(ids).long(),
            attention_mask=torch.tensor(mask).long(),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=stop,
            min_new_tokens=6,
        )
    ref = ref[:, ids.shape[1] :].numpy()
    out = generate(model, params, ids, mask, max_new_tokens=n, stop_ids=[stop], min_new_tokens=6)
    got = np.asarray(out.tokens)[:, : ref.shape[1]]
    np.testing.assert_array_equal(np.where(got == stop, stop, got), ref)  # HF pads finished rows with pad 0 too
    assert (np.asarray(out.lengths) >= 6).all()


def test_stream_in_chunks_equals_generate_and_stops_rows(tiny):
    _, model, params = tiny
    ids, mask = prompts()
    want = generate(model, params, ids, mask, max_new_tokens=N, temperature=0.8, rng=3)
    states = list(decode.stream(model, params, ids, mask, max_new_tokens=N, chunk=4, temperature=0.8, rng=3))
    assert [int(s.i) for s in states] == [1, 5, N]  # the prefill, then 4 tokens a chunk
    np.testing.assert_array_equal(np.asarray(states[-1].tokens), np.asarray(want.tokens))
    gen = decode.stream(model, params, ids, mask, max_new_tokens=N, chunk=2)
    first = next(gen)
    last = gen.send(np.array([True, False, False]))  # stop row 0 after its first token
    for s in gen:
        last = s
    assert int(last.lengths[0]) == 1 and (np.asarray(last.tokens)[0, 1:] == 0).all() and int(first.i) == 1


@pytest.mark.parametrize("k", [4])
def test_steps_per_check_gives_the_same_tokens(tiny, k):
    """k decode steps per read of the stop condition (generate's steps_per_check): the same tokens and
    lengths as one, with idle steps past the end (N = 6 is no multiple of 4), rows stopping mid-chunk,
    every row stopping, sampling, the repetition penalty and a steer; and stream's chunks (3 and 1:
    k - 1 idle steps a chunk), which resume from a cache whose held slot an idle step wrote."""
    _, model, params = tiny
    ids, mask = prompts()
    free = np.asarray(generate(model, params, ids, mask, max_new_tokens=N).tokens)
    rs = np.random.RandomState(1)
    steer = Steer(eps=jnp.asarray([2.0]), p1=jnp.asarray(rs.randn(1, D, 4)), p2=jnp.asarray(rs.randn(1, D, 4)))
    step = jnp.asarray(rs.randn(3, D), jnp.float32)
    cases = [
        dict(),
        dict(stop_ids=(int(free[0, 2]),), pad_id=-1),
        dict(stop_ids=tuple(int(x) for x in np.unique(free[:, 0]))),
        dict(temperature=0.8, top_p=0.9, rng=7),
        dict(repetition_penalty=1.5, min_new_tokens=2, stop_ids=(int(free[1, 1]),)),
        dict(hooks=Hooks(step_offset=step, steer=steer), temperature=0.5, rng=2),
    ]
    for kw in cases:
        one = generate(model, params, ids, mask, max_new_tokens=N, **kw)
        many = generate(model, params, ids, mask, max_new_tokens=N, steps_per_check=k, **kw)
        np.testing.assert_array_equal(np.asarray(many.tokens), np.asarray(one.tokens), err_msg=str(kw))
        np.testing.assert_array_equal(np.asarray(many.lengths), np.asarray(one.lengths), err_msg=str(kw))
    want = generate(model, params, ids, mask, max_new_tokens=N, temperature=0.8, rng=3)
    for chunk, steps in ((3, [1, 4, N]), (1, list(range(1, N + 1)))):
        kw = dict(max_new_tokens=N, chunk=chunk, temperature=0.8, rng=3, steps_per_check=k)
        states = list(decode.stream(model, params, ids, mask, **kw))
        assert [int(s.i) for s in states] == steps
        np.testing.assert_array_equal(np.asarray(states[-1].tokens), np.asarray(want.tokens), err_msg=str(chunk))
    with pytest.raises(ValueError, match="steps_per_check must be an int >= 1"):
        generate(model, params, ids, mask, max_new_tokens=N, steps_per_check=0)


def _loop_copies(model, params, ids, mask, kernels: bool = False) -> int:
    fn = jax.jit(lambda p, i, m: generate(model, p, i, m, max_new_tokens=N, cpu_kernels=kernels).tokens)
    return decode.loop_body_copies(fn.lower(params, ids, mask).compile().as_text())


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_one_row_decodes_without_copying_its_cache(tiny, scan):
    """Batch 1 on CPU: the loop carries the KV cache without its batch axis and writes it in that
    shape, so the compiled loop copies no more than at batch 2 (kept as [B, ...]: every layer's cache
    several times a step); same tokens as the row decoded beside another, streamed too."""
    _, model, params = tiny
    if scan:
        model = Decoder(dataclasses.replace(model.config, scan_layers=True))
        params = stack_layers(params, model.config.num_layers)
    ids, mask = prompts(lengths=(8, 5))
    assert jax.default_backend() == "cpu"
    for kernels in (False, True) if cpu.available() else (False,):  # jsteer's CPU decode kernels too
        one_row = _loop_copies(model, params, ids[:1], mask[:1], kernels)
        assert one_row <= _loop_copies(model, params, ids, mask, kernels), kernels
    keys = jax.random.split(jax.random.PRNGKey(4), 2)  # per-row keys: row 0 samples the same alone
    two = generate(model, params, ids, mask, max_new_tokens=N, temperature=0.8, rng=keys)
    one = generate(model, params, ids[:1], mask[:1], max_new_tokens=N, temperature=0.8, rng=keys[:1])
    np.testing.assert_array_equal(np.asarray(one.tokens)[0], np.asarray(two.tokens)[0])
    greedy = generate(model, params, ids[:1], mask[:1], max_new_tokens=N)
    states = list(decode.stream(model, params, ids[:1], mask[:1], max_new_tokens=N, chunk=2))
    np.testing.assert_array_equal(np.asarray(states[-1].tokens), np.asarray(greedy.tokens))
