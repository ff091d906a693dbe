"""Type-embedding analyses: retrieval, kurtosis, AA/AS on models with known answers, linear
probes and TCAV gradients checked against finite differences."""

import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jsteer.backbones import bert as jb
from jsteer.backbones import bert_heads as jh
from jsteer.typevec import analysis, core, probe

# the module (the package itself exports the function `inject`)
inject = importlib.import_module("jsteer.typevec.inject")


class _Tok:
    pad_id, bos_id, eos_id, unk_id, mask_id, cls_id, sep_id = 0, None, None, 1, 4, 2, 3


@pytest.fixture(scope="module")
def tiny_mlm():
    cfg = jb.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=24,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    module = jh.BertForMaskedLM(cfg)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim > 1 else x, params)
    pm = probe.for_bert_mlm(module, params, _Tok())
    ids = jnp.asarray([[2, 7, 9, 4, 3], [2, 4, 11, 3, 0]])
    attn = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    pos = jnp.asarray([3, 1])
    return pm, ids, attn, pos


def test_neighbours_match_numpy():
    rng = np.random.default_rng(0)
    e = rng.standard_normal((40, 8)).astype(np.float32)
    te = rng.standard_normal(8).astype(np.float32)
    ids, sims = analysis.neighbours(te, e, k=5, exclude_ids=[3])
    cos = e @ te / np.linalg.norm(e, axis=1) / np.linalg.norm(te)
    cos[3] = -np.inf
    assert ids.tolist() == np.argsort(-cos)[:5].tolist()
    np.testing.assert_allclose(sims, np.sort(cos)[::-1][:5], atol=1e-5)


def test_kurtosis_matches_scipy_and_first_vector_is_stable():
    x = np.random.default_rng(1).standard_t(5, size=400)
    assert analysis.excess_kurtosis(x) == pytest.approx(scipy.stats.kurtosis(x), rel=1e-9)
    rng = np.random.default_rng(2)
    shared = rng.standard_normal(12)
    e = (rng.standard_normal((200, 12)) * 0.3 + 2.0 * shared).astype(np.float32)  # one strong type direction
    out = analysis.singular_kurtosis(e, np.arange(200), n_runs=60, n_samples=10, components=(0, 1, 2))
    assert out[0]["stability"] > 0.95 > out[1]["stability"]
    assert len(out[0]["values_raw"]) == 60 and np.isfinite(out[0]["kurtosis_oriented"])


def test_adversarial_accuracy_and_sensitivity_known_answer():
    rng = np.random.default_rng(3)
    v, d = 30, 6
    te = np.eye(d, dtype=np.float32)[0]
    w = rng.standard_normal((v, d)).astype(np.float32) * 0.5
    w[:, 0] = 0.0
    typed = np.arange(10)
    w[typed, 0] = 3.0  # typed tokens load on the TE direction, the rest do not
    x0 = rng.standard_normal(d).astype(np.float32)

    def lp(offset):
        return jax.nn.log_softmax(jnp.asarray(w) @ (jnp.asarray(x0) + offset))

    sets = np.stack([rng.choice(typed, 5, replace=False) for _ in range(4)])
    out = analysis.adversarial(lp, te, 2.0, sets)
    assert out["TE"]["AA"]["mean"] == 1.0 and out["TE"]["AA"]["std"] == 0.0
    z = w @ x0
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    dlp = w @ te - p @ (w @ te)  # d log p_m / d lambda at 0
    want = [dlp[s].mean() for s in sets]
    np.testing.assert_allclose(out["TE"]["AS"]["runs"], want, rtol=1e-4)
    assert out["TE"]["AS"]["mean"] > 0 and out["random"]["AA"]["mean"] < 1.0


def test_adversarial_on_a_backbone_matches_finite_differences(tiny_mlm):
    pm, ids, attn, pos = tiny_mlm
    fn = analysis.prompt_logprob_fn(pm.forward, pm.head, pm.params, ids, attn, pos)
    te = core.make(pm.embedding(), jnp.asarray([10, 12, 14, 16]))
    sets = np.array([[10, 12, 20], [30, 31, 32]])
    out = analysis.adversarial(fn, te, 1.0, sets)
    fn = jax.jit(fn)
    eps = 1e-3
    for r, s in enumerate(sets):
        fd = (np.mean(np.asarray(fn(eps * te))[s]) - np.mean(np.asarray(fn(-eps * te))[s])) / (2 * eps)
        assert out["TE"]["AS"]["runs"][r] == pytest.approx(fd, rel=2e-2, abs=1e-4)
        aa = np.mean(np.asarray(fn(1.0 * te))[s] > np.asarray(fn(0 * te))[s])
        assert out["TE"]["AA"]["runs"][r] == pytest.approx(aa)


def test_linear_probe_recovers_the_concept_direction():
    rng = np.random.default_rng(4)
    direction = rng.standard_normal(10)
    direction /= np.linalg.norm(direction)
    x = rng.standard_normal((200, 10))
    y = (x @ direction > 0).astype(np.float32)
    x = x + 1.5 * (2 * y[:, None] - 1) * direction  # margin
    w, b = analysis.linear_probe(jnp.asarray(x), jnp.asarray(y))
    m = analysis.probe_metrics(w, b, jnp.asarray(x), y)
    assert m["acc"] == 1.0 and m["f1"] == 1.0
    assert float(np.dot(np.asarray(core.normalize(w)), direction)) > 0.9
    metrics, cavs = analysis.layer_probes(
        jnp.stack([jnp.asarray(x)] * 2), jnp.asarray(y), jnp.stack([jnp.asarray(x)] * 2), y
    )
    assert len(metrics) == 2 and np.allclose(np.linalg.norm(np.asarray(cavs), axis=1), 1.0)


def test_layer_gradient_and_tcav(tiny_mlm):
    pm, ids, attn, pos = tiny_mlm
    tgt = [10, 12, 14]
    g = np.asarray(analysis.layer_gradient(pm.forward, pm.head, pm.params, ids, attn, pos, tgt, 0))
    v = np.random.default_rng(5).standard_normal(16).astype(np.float32)
    eps = 1e-3
    from jsteer.hooks import FiLM, Hooks

    onehot = np.zeros((2, 5, 1), np.float32)
    onehot[np.arange(2), np.asarray(pos)] = 1.0

    @jax.jit
    def f(scale):
        hk = Hooks(film={0: FiLM(beta_out=jnp.asarray(onehot) * (scale * jnp.asarray(v)))})
        out = pm.forward(pm.params, ids, attn, hk)
        h = out.hidden[np.arange(2), np.asarray(pos)]
        lp = jax.nn.log_softmax(pm.head(pm.params, h), axis=-1)
        return jax.scipy.special.logsumexp(lp[:, jnp.asarray(tgt)], axis=1)

    fd = (np.asarray(f(eps)) - np.asarray(f(-eps))) / (2 * eps)
    np.testing.assert_allclose(g @ v, fd, rtol=2e-2, atol=1e-4)
    hs = analysis.position_states(pm.forward, pm.params, ids, attn, pos)
    assert hs.shape == (3, 2, 16)
    cavs = np.zeros((3, 16), np.float32)
    cavs[1] = g[0] / np.linalg.norm(g[0])
    s = analysis.tcav(pm.forward, pm.head, pm.params, ids, attn, pos, tgt, jnp.asarray(cavs), [0])
    assert s[0] >= 0.5  # row 0 moves up along its own gradient
    s_neg = analysis.tcav(pm.forward, pm.head, pm.params, ids, attn, pos, tgt, -jnp.asarray(cavs), [0])
    assert s[0] + s_neg[0] == pytest.approx(1.0)


def test_concept_generation_hooks_cover_prompt_and_steps():
    te = jnp.arange(4, dtype=jnp.float32)
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    h = analysis.concept_generation_hooks(te, -2.0, mask)
    np.testing.assert_allclose(np.asarray(h.embed_offset)[0, 0], 0.0)
    np.testing.assert_allclose(np.asarray(h.embed_offset)[1, 2], -2.0 * np.arange(4))
    np.testing.assert_allclose(np.asarray(h.step_offset), -2.0 * np.tile(np.arange(4), (2, 1)))
    assert isinstance(inject.last_positions(jnp.asarray(mask)), jnp.ndarray)


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "results" / "typevec"


def test_analysis_report_renders_the_committed_results(tmp_path):
    """jsteer.typevec.analysis_report (experiments/typevec_analysis.py's analysis.md and plots, and
    notebooks/type_embeddings.ipynb): every part's table from analysis.json, and the two plots
    written where asked."""
    import json

    from jsteer.typevec import analysis_report

    res = json.loads((RESULTS / "analysis.json").read_text())
    md = analysis_report.markdown(res)
    for title in ("## Table 1", "## Figure 3", "## Table 2", "## Figures 4-5", "## Table 9"):
        assert title in md
    assert "| City | 1.00 | london," in md
    assert analysis_report.markdown({}) == "# Type-embedding analyses\n\n"
    analysis_report.plots(res, "re_", out=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["re_kurtosis.png", "re_layers.png"]


def test_gradient_analyses_run_on_sharded_params(tiny_mlm):
    """layer_gradient (and so TCAV) on params split over a 4x2 (fsdp x tensor: the tiny model has
    2 heads) mesh of host devices equals the one-device result."""
    from jsteer import sharding

    pm, ids, attn, pos = tiny_mlm
    tgt = [10, 12, 14]
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    rules = {**sharding.PRESETS["fsdp_tp"], "vocab": None}
    placed = sharding.shard(pm.params, sharding.infer_axes(pm.params), mesh, rules)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(placed))
    one = np.asarray(analysis.layer_gradient(pm.forward, pm.head, pm.params, ids, attn, pos, tgt, 0))
    split = np.asarray(analysis.layer_gradient(pm.forward, pm.head, placed, ids, attn, pos, tgt, 0))
    np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-6)
