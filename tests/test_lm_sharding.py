"""LM.forward / LM.generate with ``mesh=``: data-parallel over the 8 simulated devices
(tests/conftest.py), padded to the mesh size, equal to the unsharded call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_io import make_tiny_bert_mlm, make_tiny_decoder

import jsteer
from jsteer import decode
from jsteer import lm as lm_module
from jsteer.hooks import FiLM, Hooks, Steer
from jsteer.train import data_mesh

D = 32  # hidden size of the tiny models (tests/test_io.py)


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    out = {}
    for family in ("gpt2", "llama"):
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        make_tiny_decoder(path, family)
        out[family] = jsteer.load(path)
    path = tmp_path_factory.mktemp("tiny_bert")
    make_tiny_bert_mlm(path)
    out["bert"] = jsteer.load(path)
    return out


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 host devices"
    return data_mesh()


def batch(b, t=7, seed=0, left=True):
    """Random ids [b, t] in the tiny vocabularies' word range, rows padded to random lengths."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(5, 60, (b, t)).astype(np.int32)
    lengths = rs.randint(1, t + 1, b)
    lengths[0] = t
    cols = np.arange(t)[None, :]
    mask = (cols >= t - lengths[:, None]) if left else (cols < lengths[:, None])
    return ids, mask.astype(np.int32)


def assert_close(a, b, atol=3e-5):
    """fp32: a device's matmul over fewer rows rounds differently (seen: up to 9e-6 on logits ~10)."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


def prompts(b, seed=0):
    rs = np.random.RandomState(seed)
    return [" ".join(f"w{i}" for i in rs.randint(0, 59, rs.randint(1, 6))) for _ in range(b)]


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("b", [3, 10, 16])
def test_forward_sharded_equals_unsharded(lms, mesh, family, b):
    lm = lms[family]
    ids, mask = batch(b, left=lm.is_decoder)
    ref = lm.forward(ids, mask)
    out = lm.forward(ids, mask, mesh=mesh)
    assert out.logits.shape == ref.logits.shape == (b, 7, 64)
    assert out.hidden.shape == ref.hidden.shape == (b, 7, D)
    assert_close(out.logits, ref.logits)
    assert_close(out.hidden, ref.hidden)
    # the logits vary across rows (a broadcast row 0 would not pass)
    assert np.abs(np.asarray(ref.logits)[1:] - np.asarray(ref.logits)[:1]).max() > 1e-2


def test_forward_runs_split_over_the_devices(lms, mesh, monkeypatch):
    lm = lms["llama"]
    ids, mask = batch(16)
    out = lm.forward(ids, mask, mesh=mesh)  # divisible: no padding, output stays split
    assert out.logits.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data")), 3)
    assert sorted(s.data.shape[0] for s in out.logits.addressable_shards) == [2] * 8

    seen = {}
    real = lm_module._forward

    def spy(module, params, packed, input_ids, attention_mask, hooks, arrays, static_kw):
        assert packed is None  # the CPU kernel's packed weights: one device only
        seen.update(params=params, ids=input_ids, mask=attention_mask)
        return real(module, params, packed, input_ids, attention_mask, hooks, arrays, static_kw)

    monkeypatch.setattr(lm_module, "_forward", spy)
    ids3, mask3 = batch(3, seed=1)
    out3 = lm.forward(ids3, mask3, mesh=mesh)  # padded to 8 rows, cut back to 3: replicated on the mesh
    assert out3.logits.shape == (3, 7, 64) and out3.logits.sharding.is_fully_replicated
    assert len(out3.logits.sharding.device_set) == 8
    placed = seen["ids"]
    assert placed.shape == (8, 7) and len(placed.sharding.device_set) == 8
    assert [s.data.shape for s in placed.addressable_shards] == [(1, 7)] * 8
    np.testing.assert_array_equal(np.asarray(placed)[:3], ids3)
    np.testing.assert_array_equal(np.asarray(placed)[3:], np.repeat(ids3[:1], 5, 0))  # padding: row 0
    np.testing.assert_array_equal(np.asarray(seen["mask"])[:3], mask3)
    leaf = jax.tree.leaves(seen["params"])[0]
    assert len(leaf.sharding.device_set) == 8 and leaf.sharding.is_fully_replicated


def test_params_are_placed_once_per_mesh_and_identity_is_kept(lms, mesh):
    lm = lms["gpt2"].replace(tokenizer=lms["gpt2"].tokenizer)  # a fresh LM object, same params
    identity = lm.identity
    placed = lm.params_on(mesh)
    assert lm.params_on(mesh) is placed and lm.params_on(data_mesh()) is placed  # equal mesh: cached
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in jax.tree.leaves(placed))
    assert not any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(lm.params))  # own params untouched
    lm.forward(*batch(3), mesh=mesh)
    assert lm.params_on(mesh) is placed and lm.identity == identity
    assert lm.params_on(None) is lm.params
    bumped = lm.replace(params=jax.tree.map(lambda x: x + 1.0, lm.params))
    assert bumped.params_on(mesh) is not placed
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(bumped.params_on(mesh))[0]), np.asarray(jax.tree.leaves(lm.params)[0]) + 1.0
    )


def test_forward_two_axis_mesh_and_mesh_true(lms):
    lm = lms["gpt2"]
    ids, mask = batch(3, seed=2)
    ref = lm.forward(ids, mask).logits
    grid = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))  # batch split 4 ways
    assert_close(lm.forward(ids, mask, mesh=grid).logits, ref)
    assert_close(lm.forward(ids, mask, mesh=True).logits, ref)


def _decoder_hooks(b, t, n_steers, seed=0):
    """Every batch-shaped hook field, plus a steer whose per-steer fields have S == B rows."""
    rs = np.random.RandomState(seed)
    f = lambda *shape: jnp.asarray(rs.normal(size=shape).astype(np.float32) * 0.5)  # noqa: E731
    bias = np.where(np.tril(np.ones((t, t), bool)), 0.0, -1e9).astype(np.float32)
    bias = np.broadcast_to(bias, (b, t, t)).copy()
    bias[:, :, 0] += rs.normal(size=(b, t)).astype(np.float32)
    return Hooks(
        embed_offset=f(b, t, D),
        film={1: FiLM(gamma_in=f(b, t, D), beta_out=f(b, t, D))},
        attn_bias=jnp.asarray(bias),
        position_ids=jnp.asarray(rs.randint(0, 40, (b, t)), jnp.int32),
        steer=Steer(eps=f(b, n_steers), p1=f(n_steers, D, 4), p2=f(n_steers, D, 4)),
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_batch_shaped_hooks(lms, mesh, family):
    lm = lms[family]
    b = 3
    ids, _ = batch(b, seed=3)
    mask = np.ones_like(ids)
    hooks = _decoder_hooks(b, ids.shape[1], n_steers=b)  # S == B: p1/p2 must stay whole
    ref = lm.forward(ids, mask, hooks=hooks)
    out = lm.forward(ids, mask, hooks=hooks, mesh=mesh)
    assert_close(out.logits, ref.logits)
    assert np.abs(np.asarray(ref.logits) - np.asarray(lm.forward(ids, mask).logits)).max() > 1e-2  # hooks act
    # one row's hooks move only that row, sharded as unsharded
    kick = np.random.RandomState(9).normal(size=(ids.shape[1], D)).astype(np.float32)  # not constant: LayerNorm
    moved = hooks.replace(embed_offset=hooks.embed_offset.at[2].add(kick))
    got = np.asarray(lm.forward(ids, mask, hooks=moved, mesh=mesh).logits)
    assert_close(got[:2], np.asarray(out.logits)[:2])
    assert np.abs(got[2] - np.asarray(out.logits)[2]).max() > 1e-3


def test_forward_bert_token_types_and_hooks(lms, mesh):
    lm = lms["bert"]
    b, t = 10, 7
    ids, mask = batch(b, left=False, seed=4)
    rs = np.random.RandomState(5)
    types = rs.randint(0, 2, (b, t)).astype(np.int32)
    bias = np.zeros((b, t, t), np.float32)
    bias[:, :, 1] = -1e9 * rs.randint(0, 2, (b, 1))  # some rows hide token 1
    hooks = Hooks(
        embed_offset=jnp.asarray(rs.normal(size=(b, t, D)).astype(np.float32)),
        film={0: FiLM(gamma_out=jnp.asarray(rs.normal(size=(b, t, D)).astype(np.float32) * 0.3))},
        attn_bias=jnp.asarray(bias),
        position_ids=jnp.asarray(rs.randint(0, 60, (b, t)), jnp.int32),
    )
    ref = lm.forward(ids, mask, hooks=hooks, token_type_ids=types)
    out = lm.forward(ids, mask, hooks=hooks, token_type_ids=types, mesh=mesh)
    assert out.logits.shape == (b, t, 64)
    assert_close(out.logits, ref.logits)
    assert np.abs(np.asarray(ref.logits) - np.asarray(lm.forward(ids, mask, hooks=hooks).logits)).max() > 1e-3


# ----------------------------------------------------------------------------- generate


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("b", [3, 10])
def test_generate_greedy_sharded_equals_unsharded(lms, mesh, family, b):
    lm = lms[family]
    texts = prompts(b, seed=b)
    ref = lm.generate(texts, max_new_tokens=6, return_ids=True)
    out = lm.generate(texts, max_new_tokens=6, return_ids=True, mesh=mesh)
    assert out[1].shape == (b, 6) and out[2].shape == (b,)
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[2], ref[2])
    assert out[0] == ref[0]
    assert len({tuple(r) for r in ref[1]}) > 1


@pytest.mark.parametrize("b", [3, 10])
def test_generate_sampling_same_seed_same_tokens(lms, mesh, b):
    """Row keys are split for the B real rows, as unsharded; padding rows copy row 0's key."""
    lm = lms["llama"]
    texts = prompts(b, seed=1)
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7, return_ids=True)
    ref = lm.generate(texts, **kw)
    out = lm.generate(texts, mesh=mesh, **kw)
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[2], ref[2])
    other = lm.generate(texts, mesh=mesh, **{**kw, "seed": 8})
    assert (other[1] != out[1]).any()  # the tokens are sampled (the comparison above can fail)
    greedy = lm.generate(texts, max_new_tokens=6, return_ids=True)[1]
    assert (greedy != ref[1]).any()


def test_generate_batch_shaped_hooks(lms, mesh):
    lm = lms["gpt2"]
    texts = ["w1 w2 w3", "w9", "w4 w4 w5 w6"]
    ids0, _ = lm.encode_batch(texts)  # T0 = 4: prompt-shaped hooks are left-padded to the bucket
    b, t0 = ids0.shape
    rs = np.random.RandomState(0)
    f = lambda *shape: jnp.asarray(rs.normal(size=shape).astype(np.float32))  # noqa: E731
    hooks = Hooks(
        embed_offset=f(b, t0, D),
        step_offset=f(b, D),
        film={0: FiLM(beta_in=f(b, t0, D))},
        steer=Steer(eps=f(b, 3) * 0.5, p1=f(3, D, 4), p2=f(3, D, 4)),
    )
    kw = dict(max_new_tokens=6, return_ids=True)
    plain = lm.generate(texts, **kw)[1]
    ref = lm.generate(texts, hooks=hooks, **kw)
    out = lm.generate(texts, hooks=hooks, mesh=mesh, **kw)
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[2], ref[2])
    assert (ref[1] != plain).any()
    sampled = dict(kw, temperature=0.8, top_p=0.95, seed=3)
    np.testing.assert_array_equal(
        lm.generate(texts, hooks=hooks, mesh=mesh, **sampled)[1], lm.generate(texts, hooks=hooks, **sampled)[1]
    )


def test_generate_runs_split_over_the_devices(lms, mesh, monkeypatch):
    lm = lms["gpt2"]
    seen = {}
    real = decode.generate

    def spy(module, params, input_ids, attention_mask=None, **kw):
        out = real(module, params, input_ids, attention_mask, **kw)
        seen.update(ids=input_ids, keys=kw["rng"], tokens=out.tokens)
        return out

    monkeypatch.setattr(decode, "generate", spy)
    lm.generate(prompts(10), max_new_tokens=4, mesh=mesh, temperature=1.0, seed=5)
    ids = seen["ids"]
    assert ids.shape[0] == 16 and len(ids.sharding.device_set) == 8
    assert [s.data.shape[0] for s in ids.addressable_shards] == [2] * 8
    assert len(seen["tokens"].sharding.device_set) == 8
    assert not seen["tokens"].sharding.is_fully_replicated
    keys = np.asarray(seen["keys"])
    np.testing.assert_array_equal(keys[:10], np.asarray(jax.random.split(jax.random.PRNGKey(5), 10)))
    np.testing.assert_array_equal(keys[10:], np.repeat(keys[:1], 6, 0))


# ----------------------------------------------------------------------------- errors


def test_mesh_without_data_axis_is_a_clear_error(lms):
    lm = lms["gpt2"]
    bad = Mesh(np.asarray(jax.devices()), ("batch",))
    with pytest.raises(ValueError, match=r"LM.forward: the mesh has axes \('batch',\) but no 'data' axis"):
        lm.forward(*batch(3), mesh=bad)
    with pytest.raises(ValueError, match=r"LM.generate: .*no 'data' axis"):
        lm.generate(["w1"], max_new_tokens=2, mesh=bad)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        lm.forward(*batch(3), mesh="data")


def test_params_replaced_in_place_are_placed_afresh(lms, mesh):
    """An array of lm.params replaced in place (same dict) is not served from the placed copy."""
    lm = lms["llama"].replace(tokenizer=lms["llama"].tokenizer)
    lm.params = jax.tree.map(lambda x: x, lm.params)  # own containers, so the shared fixture is untouched
    ids, mask = batch(3)
    lm.forward(ids, mask, mesh=mesh)
    lm.params["final_norm"]["scale"] = lm.params["final_norm"]["scale"] * 3.0
    assert_close(lm.forward(ids, mask, mesh=mesh).logits, lm.forward(ids, mask).logits)


def test_batch_shaped_hooks_of_another_batch_size_are_refused(lms, mesh):
    """With 3 rows, hooks of 8 (the padded size) or 4 rows are errors naming the field and B = 3,
    as without a mesh; a leading dim of 1 still broadcasts."""
    lm = lms["llama"]
    ids, mask = batch(3)
    for hooks, field in (
        (Hooks(embed_offset=jnp.zeros((8, 7, D))), "embed_offset"),
        (Hooks(step_offset=jnp.zeros((4, D))), "step_offset"),
        (Hooks(steer=Steer(eps=jnp.zeros((8, 1)), vec=jnp.ones((1, D)))), "steer.eps"),
        (Hooks(film={1: FiLM(gamma_in=jnp.zeros((8, 7, D)))}), r"film\[1\]"),
    ):
        with pytest.raises(ValueError, match=rf"hooks.{field} has a leading \(batch\) dim of \d, but the batch has 3"):
            lm.forward(ids, mask, hooks=hooks, mesh=mesh)
    one = Hooks(embed_offset=jnp.full((1, 7, D), 0.1))
    assert_close(lm.forward(ids, mask, hooks=one, mesh=mesh).logits, lm.forward(ids, mask, hooks=one).logits)
