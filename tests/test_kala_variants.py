"""Knowledge-integration variants in the KALA harness: K-BERT's sentence tree and visible
matrix (hand-checked), ERNIE fusion / EaE retrieval / knowledge adapter against NumPy, the
backbone-preserving zero initialisations, and every variant beating plain fine-tuning on a
task that needs knowledge."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer import interventions as iv
from jsteer.backbones.bert import BertConfig, BertEncoder
from jsteer.backbones.bert_heads import BertForTokenClassification
from jsteer.hooks import Hooks
from jsteer.kala.graph import ExampleGraph, add_self_loops, batch_graphs
from jsteer.kala.variants import kbert, registry, synthetic
from jsteer.kala.variants import train as vtrain
from jsteer.kala.variants.adapter import KnowledgeAdapter
from jsteer.kala.variants.eae import EntityRetrieval, entity_linking_loss


def tiny_bert(layers=1, **kw):
    return BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_layers=layers,
        num_heads=2,
        intermediate_size=24,
        max_position_embeddings=48,
        **kw,
    )


def japply(module, params, *args, method=None, **kw):
    return module.apply({"params": params}, *args, method=method, **kw)


def jinit(module, rng, *args, method=None):
    return module.init(rng, *args, method=method)["params"]


def perturb(tree, key, scale=0.3):
    """``tree`` + N(0, scale) noise, drawn on the host (seeded by ``key``): a jax.random.normal per
    leaf compiles one random program per shape, ~0.4 s each on XLA:CPU."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype), tree)


# ---------------------------------------------------------------------------------- numpy refs


def np_ln(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


np_erf = np.vectorize(math.erf)


def np_gelu_exact(x):
    return 0.5 * x * (1 + np_erf(x / np.sqrt(2)))


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_softmax(x, axis=-1):
    x = x - x.max(axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis, keepdims=True)


def np_attention_block(p, h, mask, eps):
    """BERT self-attention + residual + LayerNorm. h [T, D], mask [T] 0/1."""
    qkv = np.einsum("td,dcnh->tcnh", h, p["attention"]["qkv"]["kernel"]) + p["attention"]["qkv"]["bias"]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(q.shape[-1]) + np.where(mask > 0, 0, -1e30)[None, None]
    ctx = np.einsum("nts,snh->tnh", np_softmax(s), v)
    out = np.einsum("tnh,nhd->td", ctx, p["attention"]["out"]["kernel"]) + p["attention"]["out"]["bias"]
    return np_ln(out + h, p["attention_norm"], eps)


def dense(p, x):
    return x @ p["kernel"] + (p["bias"] if "bias" in p else 0)


def graph_inputs(token_nodes, entities):
    """token_nodes [B, T] local nodes per example; entities: per example list of entity ids."""
    graphs = [
        add_self_loops(ExampleGraph(np.asarray(e, np.int32), *(np.zeros(0, np.int32),) * 3, len(e))) for e in entities
    ]
    graph, tok = batch_graphs(graphs, np.asarray(token_nodes, np.int32))
    return graph, jnp.asarray(tok)


# ---------------------------------------------------------------------------------- backbone parts


@pytest.mark.parametrize("method", ["ernie", "eae", "adapter", "kbert"])
def test_variants_run_the_shared_encoder(method):
    """Every variant's encoder is BertEncoder itself (same tree), driven through its sites: no
    method-owned layer loop or layer copy."""
    cfg = tiny_bert(layers=2)
    model = registry.build_model(method, cfg, num_labels=3, num_entities=6, entity_heads=2)
    p = jax.eval_shape(lambda: registry.init_params(model, jax.random.PRNGKey(0)))
    ids = jnp.zeros((1, 4), jnp.int32)
    enc = jax.eval_shape(lambda: BertEncoder(cfg).init(jax.random.PRNGKey(0), ids))["params"]
    assert jax.tree.map(jnp.shape, p["encoder"]) == jax.tree.map(jnp.shape, enc)
    assert type(model.bind({"params": p}).encoder) is BertEncoder


@pytest.mark.parametrize("method", ["adapter", "eae"])
def test_variant_is_bert_plus_its_intervention_by_hand(method):
    """Adapter / EaE models = plain BertForTokenClassification with the method's step written out
    here as an intervention (its module applied to its own params) at the site it acts on."""
    from jsteer.kala.variants.adapter import KnowledgeAdapter

    cfg = tiny_bert(layers=3)
    layers = (0, 2)
    model = registry.build_model(method, cfg, num_labels=3, num_entities=6, layers=layers)
    p = perturb(registry.init_params(model, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.2)
    ids = jnp.asarray([[2, 7, 8, 9, 10, 11, 3, 0], [4, 5, 6, 7, 8, 9, 10, 11]])
    mask = jnp.asarray([[1] * 7 + [0], [1] * 8])
    graph, tok = graph_inputs([[-1, 0, 0, -1, 1, 2, -1, -1], [1, -1, 0, 0, -1, -1, -1, -1]], [[4, 5, 0], [3, 1]])
    out = japply(model, p, ids, mask, None, graph, tok)
    memory, ent = np.asarray(p["kala"]["memory"]), np.asarray(graph.nodes["entity"])
    tk = np.asarray(tok)
    n = ent.shape[0]
    if method == "adapter":
        rows = np.where((ent != 0)[:, None], memory[ent], 0.0)
        e_tok = jnp.asarray(np.where((tk >= 0)[..., None], rows[np.maximum(tk, 0)], 0.0), jnp.float32)

        def step(l):
            return lambda y, ctx: KnowledgeAdapter(16, 64).apply({"params": p["kala"][f"adapter_{l}"]}, y, e_tok)

        ivs = {f"ffn_out.{l}": iv.Fn(step(l)) for l in layers}
    else:

        def step(l):
            return lambda h, ctx: EntityRetrieval(16, 16).apply(
                {"params": p["kala"][f"retrieval_{l}"]}, h, tok, p["kala"]["memory"], n
            )[0]

        ivs = {f"resid_post.{l}": iv.Fn(step(l)) for l in layers}
    ref = japply(
        BertForTokenClassification(cfg, 3),
        {"encoder": p["encoder"], "head": p["head"]},
        ids,
        mask,
        hooks=Hooks(interventions=ivs),
    )
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(ref.logits))


# ---------------------------------------------------------------------------------- K-BERT


def hand_tree():
    # [CLS] Tim Cook is visiting Beijing now [SEP]; mentions: Tim Cook (node 0), Beijing (node 1)
    ids = np.array([2, 10, 11, 12, 13, 14, 15, 3], np.int32)
    ex = {
        "input_ids": ids,
        "labels": np.array([-100, 1, 2, 0, 0, 3, 0, -100], np.int32),
        "word_index": np.array([-1, 0, 1, 2, 3, 4, 5, -1], np.int32),
        "token_node": np.array([-1, 0, 0, -1, -1, 1, -1, -1], np.int32),
        "token_entity": np.array([0, 4, 4, 0, 0, 5, 0, 0], np.int32),
        "num_words": 6,
    }
    branches = {0: [[20, 21]], 1: [[22, 23]]}  # CEO Apple / capital China
    return ex, branches


def test_sentence_tree_soft_positions_and_visible_matrix():
    ex, branches = hand_tree()
    t = kbert.build_tree(ex, branches)
    #            CLS Tim Cook CEO Apple is visiting Beijing capital China now SEP
    assert t["input_ids"].tolist() == [2, 10, 11, 20, 21, 12, 13, 14, 22, 23, 15, 3]
    assert t["soft_position"].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 6, 7]
    assert t["tree_branch"].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 2, 2, 0, 0]
    assert t["tree_owner"].tolist() == [0, 1, 1, 1, 1, 0, 0, 2, 2, 2, 0, 0]
    assert t["labels"].tolist() == [-100, 1, 2, -100, -100, 0, 0, 3, -100, -100, 0, -100]
    assert t["word_index"].tolist() == [-1, 0, 1, -1, -1, 2, 3, 4, -1, -1, 5, -1]
    assert t["token_node"].tolist() == [-1, 0, 0, -1, -1, -1, -1, 1, -1, -1, -1, -1]
    assert t["num_words"] == 6 and t["n_branch_tokens"] == 4
    # hand-checked visible matrix (rows attend to columns)
    want = np.array(
        [
            # C  T  Co CE Ap is vi Be ca Ch no S
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],  # [CLS]: the sentence only
            [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1],  # Tim: sentence + its branch
            [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1],  # Cook
            [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # CEO: its entity + its branch
            [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # Apple
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],  # is
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],  # visiting
            [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1],  # Beijing
            [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0],  # capital
            [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0],  # China
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],  # now
            [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1],  # [SEP]
        ],
        bool,
    )
    got_np = kbert.visible_matrix_np(t["tree_branch"], t["tree_owner"])
    np.testing.assert_array_equal(got_np, want)
    got = kbert.visible_matrix(jnp.asarray(t["tree_branch"])[None], jnp.asarray(t["tree_owner"])[None])
    np.testing.assert_array_equal(np.asarray(got[0]), want)
    # a length cap drops whole branches, never the sentence
    capped = kbert.build_tree(ex, branches, max_len=10)
    assert capped["input_ids"].tolist() == [2, 10, 11, 20, 21, 12, 13, 14, 15, 3]


def test_kbert_branches_reach_only_their_entity_in_one_layer():
    cfg = tiny_bert(layers=1)
    ex, branches = hand_tree()
    t = kbert.build_tree(ex, branches)
    model = registry.build_model("kbert", cfg, num_labels=5)
    p = registry.init_params(model, jax.random.PRNGKey(0), seq_len=12)
    graph, tok = graph_inputs(np.full((1, 12), -1), [[]])

    def run(ids):
        extras = {k: jnp.asarray(t[k])[None] for k in kbert.TREE_KEYS}
        return np.asarray(
            japply(
                model, p, jnp.asarray(ids)[None], jnp.ones((1, 12), jnp.int32), None, graph, tok, extras=extras
            ).hidden[0]
        )

    base = run(t["input_ids"])
    changed = t["input_ids"].copy()
    changed[[3, 4]] = [30, 31]  # rewrite Tim Cook's branch
    diff = np.abs(run(changed) - base).sum(-1)
    assert np.all(diff[[0, 5, 6, 7, 8, 9, 10, 11]] == 0)  # CLS, sentence, the other entity and branch
    assert np.all(diff[[1, 2, 3, 4]] > 1e-4)  # the entity and its branch
    # no branches: exactly plain BERT on the sentence
    plain = kbert.build_tree(ex, {})
    extras = {k: jnp.asarray(plain[k])[None] for k in kbert.TREE_KEYS}
    g8, tok8 = graph_inputs(np.full((1, 8), -1), [[]])
    out = japply(
        model, p, jnp.asarray(plain["input_ids"])[None], jnp.ones((1, 8), jnp.int32), None, g8, tok8, extras=extras
    )
    ref = japply(BertForTokenClassification(cfg, 5), p, jnp.asarray(ex["input_ids"])[None])
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-6)
    with pytest.raises(ValueError, match="kbert needs extras"):
        model.apply({"params": p}, jnp.asarray(plain["input_ids"])[None], None, None, g8, tok8)


# ---------------------------------------------------------------------------------- ERNIE


def test_ernie_fusion_layer_matches_numpy():
    cfg = tiny_bert(layers=1)
    model = registry.build_model("ernie", cfg, num_labels=3, num_entities=6, entity_heads=2, entity_dim=8)
    p = perturb(registry.init_params(model, jax.random.PRNGKey(0)), jax.random.PRNGKey(1), 0.2)
    ids = jnp.asarray([[2, 7, 8, 9, 10, 11, 3, 0]])
    mask = np.array([1, 1, 1, 1, 1, 1, 1, 0])
    tn = [[-1, 0, 0, -1, 1, 2, -1, -1]]  # node 0 (entity 4) over 2 tokens, node 1 (entity 5), node 2 null
    graph, tok = graph_inputs(tn, [[4, 5, 0]])
    out = japply(model, p, ids, jnp.asarray(mask)[None], None, graph, tok)
    q = jax.tree.map(np.asarray, p)
    h0 = np.asarray(japply(model, p, ids, method=lambda m, x: m.encoder.embeddings(x)))[0]
    lp, f = q["encoder"]["layer_0"], q["kala"]["fusion_0"]
    eps = cfg.layer_norm_eps
    a = np_attention_block(lp, h0, mask, eps)
    ent = np.array([0, 1, 0, 0, 1, 0, 0, 0], bool)  # first tokens of known-entity mentions
    e = np.zeros((8, 8))
    e[1], e[4] = q["kala"]["memory"][4], q["kala"]["memory"][5]
    # entity self-attention among entity positions, residual, LayerNorm
    qkv = np.einsum("td,dcnh->tcnh", e, f["entity_attention"]["qkv"]["kernel"]) + f["entity_attention"]["qkv"]["bias"]
    s = np.einsum("tnh,snh->nts", qkv[:, 0], qkv[:, 1]) / np.sqrt(4)
    s = np.where(ent[None, None, :], s, -np.inf)
    ctx = np.zeros((8, 2, 4))
    ctx[ent] = np.einsum("nts,snh->tnh", np_softmax(s[:, ent]), qkv[:, 2])
    att = np.einsum("tnh,nhd->td", ctx, f["entity_attention"]["out"]["kernel"]) + f["entity_attention"]["out"]["bias"]
    e_t = np_ln(e + att, f["entity_attention"]["norm"], 1e-6) * ent[:, None]
    # h_j = act(W_t w~_j + W_e e~_j + b) on aligned tokens, act(W_t w~_j + b) elsewhere
    hid = np_gelu_exact(dense(lp["ffn_in"], a) + (e_t @ f["ent_in"]["kernel"]) * ent[:, None])
    w_out = np_ln(dense(lp["ffn_out"], hid) + a, lp["ffn_norm"], eps)
    logits = dense(q["head"]["classifier"], w_out)
    np.testing.assert_allclose(np.asarray(out.hidden[0]), w_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.logits[0]), logits, atol=2e-5)
    # entity output e' = LN(W_eo h_j + e~_j) at entity positions (1 layer: read it via a method)
    e_out_np = np_ln(dense(f["ent_out"], hid) + e_t, f["ent_out_norm"], 1e-6) * ent[:, None]
    fusion = japply(
        model,
        p,
        jnp.asarray(hid, jnp.float32)[None],
        jnp.asarray(e_t, jnp.float32)[None],
        jnp.asarray(ent)[None],
        method=lambda m, hh, ee, en: m.knowledge.fusions[0].entity_output(hh, ee, en),
    )
    np.testing.assert_allclose(np.asarray(fusion[0]), e_out_np, atol=2e-5)


@pytest.mark.parametrize("method,zero", [("ernie", "ent_in"), ("adapter", "up"), ("eae", "mlp_out")])
def test_zeroed_knowledge_path_is_plain_bert(method, zero):
    cfg = tiny_bert()
    model = registry.build_model(method, cfg, num_labels=3, num_entities=6, entity_heads=2)
    p = registry.init_params(model, jax.random.PRNGKey(0))
    p = {**p, "kala": perturb(p["kala"], jax.random.PRNGKey(1))}
    ids = jnp.asarray([[2, 7, 8, 9, 10, 11, 3, 0]])
    graph, tok = graph_inputs([[-1, 0, 0, -1, 1, 2, -1, -1]], [[4, 5, 0]])
    ref = japply(BertForTokenClassification(cfg, 3), {"encoder": p["encoder"], "head": p["head"]}, ids)
    out = japply(model, p, ids, None, None, graph, tok)
    assert np.abs(np.asarray(out.logits - ref.logits)).max() > 1e-3  # knowledge does change the output

    def zeroed(tree):
        return {
            k: (jax.tree.map(jnp.zeros_like, v) if k == zero else zeroed(v) if isinstance(v, dict) else v)
            for k, v in tree.items()
        }

    out0 = japply(model, {**p, "kala": zeroed(p["kala"])}, ids, None, None, graph, tok)
    np.testing.assert_allclose(np.asarray(out0.logits), np.asarray(ref.logits), atol=1e-6)


# ---------------------------------------------------------------------------------- EaE, adapter


def test_eae_retrieval_and_linking_loss_match_numpy():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 5, 6)).astype(np.float32)
    memory = rng.normal(size=(7, 4)).astype(np.float32)
    graph, tok = graph_inputs([[-1, 0, 0, 1, -1], [0, -1, -1, -1, -1]], [[3, 0], [6]])
    n = graph.nodes["entity"].shape[0]
    layer = EntityRetrieval(hidden=6, entity_dim=4)
    p = perturb(layer.init(jax.random.PRNGKey(0), h, tok, memory, n)["params"], jax.random.PRNGKey(1))
    new_h, logits = layer.apply({"params": p}, h, tok, memory, n)
    q = jax.tree.map(np.asarray, p)
    tk = np.asarray(tok)
    want = h.copy()
    for b in range(2):
        for node in set(tk[b][tk[b] >= 0]):
            sel = tk[b] == node
            query = dense(q["query"], h[b][sel].mean(0))
            lg = memory @ query
            lg[0] = -np.inf  # the null entity is never retrieved
            r = np_softmax(lg) @ memory
            delta = dense(q["mlp_out"], np_gelu_tanh(dense(q["mlp_in"], r)))
            want[b][sel] += delta
            np.testing.assert_allclose(
                np.asarray(logits[b])[sel][:, 1:], np.tile(lg[1:], (sel.sum(), 1)), rtol=1e-5, atol=1e-5
            )
    np.testing.assert_allclose(np.asarray(new_h), want, atol=1e-5)
    assert np.all(np.asarray(new_h)[tk < 0] == h[tk < 0])
    # linking loss: mean CE at the first token of known-entity mentions
    gold = np.array([[0, 3, 3, 0, 0], [6, 0, 0, 0, 0]])
    use = np.array([[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]], bool)
    loss, count = entity_linking_loss(logits, jnp.asarray(gold), jnp.asarray(use))
    lg = np.asarray(logits, np.float64)
    ce = [
        -(lg[b, t, gold[b, t]] - np.log(np.exp(lg[b, t, 1:] - lg[b, t, 1:].max()).sum()) - lg[b, t, 1:].max())
        for b, t in zip(*np.nonzero(use))
    ]
    assert int(count) == 2 and float(loss) == pytest.approx(np.mean(ce), rel=1e-5)


def test_eae_model_reports_linking_loss():
    cfg = tiny_bert()
    model = registry.build_model("eae", cfg, num_labels=3, num_entities=6)
    p = registry.init_params(model, jax.random.PRNGKey(0))
    graph, tok = graph_inputs([[-1, 0, 0, -1, 1, 2, -1, -1]], [[4, 5, 0]])
    out = japply(model, p, jnp.asarray([[2, 7, 8, 9, 10, 11, 3, 0]]), None, None, graph, tok)
    # two linked mentions (the null one is not supervised); near-uniform retrieval over 5 entities
    assert float(out.aux["el_loss"]) == pytest.approx(math.log(5), abs=0.1)
    assert float(out.aux_loss) == pytest.approx(float(out.aux["el_loss"]))


def test_adapter_layer_matches_numpy():
    rng = np.random.default_rng(1)
    y, e = rng.normal(size=(2, 3, 6)).astype(np.float32), rng.normal(size=(2, 3, 4)).astype(np.float32)
    layer = KnowledgeAdapter(hidden=6, size=5)
    p = perturb(jinit(layer, jax.random.PRNGKey(0), y, e), jax.random.PRNGKey(1))
    got = japply(layer, p, y, e)
    q = jax.tree.map(np.asarray, p)
    want = y + dense(q["up"], np_gelu_tanh(dense(q["down"], np.concatenate([y, e], -1))))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


# ---------------------------------------------------------------------------------- registry


def test_registry_names_and_errors():
    assert set(registry.METHODS) >= {"finetune", "pointwise", "relational", "ernie", "kbert", "eae", "adapter"}
    cfg = tiny_bert()
    assert registry.extra_keys(registry.build_model("kbert", cfg)) == kbert.TREE_KEYS
    assert registry.extra_keys(registry.build_model("relational", cfg, num_entities=3)) == ()
    with pytest.raises(ValueError, match="unknown method"):
        registry.build_model("knowbert", cfg)
    with pytest.raises(ValueError, match="does not take options"):
        registry.build_model("ernie", cfg, gnn_layers=2)
    with pytest.raises(ValueError, match="out of range"):
        registry.init_params(registry.build_model("adapter", cfg, layers=(5,)), jax.random.PRNGKey(0))


# ---------------------------------------------------------------------------------- training


def test_each_variant_beats_plain_finetuning_when_knowledge_is_needed():
    task = synthetic.make_task(0)
    # one layer: every method's knowledge enters at layer 0 (ERNIE / adapter / EaE defaults for 1 layer)
    cfg = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tc = vtrain.TrainConfig(lr=3e-3, kala_lr=3e-3, batch_size=32, max_steps=60, warmup_ratio=0.1, seed=0)
    gold = [tags for _, tags, _, _ in task.test]
    kg = task.knowledge_graph()
    f1 = {}
    for method in ("finetune", "ernie", "kbert", "eae", "adapter"):
        opts = {"entity_heads": 2} if method == "ernie" else {}
        model = registry.build_model(
            method, cfg, num_labels=len(synthetic.LABELS), num_entities=len(task.entities), **opts
        )
        encode = functools.partial(registry.encode_ner, method)
        train, test = task.encode("train", encode, kg=kg), task.encode("test", encode, kg=kg)
        memory = task.memory if method in ("ernie", "eae", "adapter") else None
        params = registry.init_params(model, jax.random.PRNGKey(0), memory=memory, seq_len=16)
        res = vtrain.fit(model, params, train, tc)
        assert res.losses[-1] < 0.2, (method, res.losses[-1])
        f1[method] = vtrain.evaluate_ner(model, res.params, test, gold, synthetic.LABELS)["f1"]
    assert f1["finetune"] < 50, f1
    for method in ("ernie", "kbert", "eae", "adapter"):
        assert f1[method] > f1["finetune"] + 20, f1


def test_training_batches_carry_what_each_method_reads():
    """Graph arrays only for models that read them (fine-tuning or K-BERT would recompile per
    graph bucket); K-BERT's tree arrays for K-BERT."""
    from jsteer.kala import train as ktrain

    task = synthetic.make_task(0)
    cfg = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    tc = vtrain.TrainConfig(batch_size=4)
    kg = task.knowledge_graph()
    for method, has_graph in (
        ("finetune", False),
        ("more_params", False),
        ("pointwise", True),
        ("ernie", True),
        ("kbert", False),
    ):
        model = registry.build_model(method, cfg, num_labels=len(synthetic.LABELS), num_entities=len(task.entities))
        train = task.encode("train", functools.partial(registry.encode_ner, method), kg=kg)[:8]
        batch = next(iter(ktrain._Endless.for_model(model, train, tc, "ner", vtrain.batch_keys(model))))
        assert ("graph_senders" in batch) == has_graph, method
        assert set(kbert.TREE_KEYS) <= set(batch) if method == "kbert" else not set(kbert.TREE_KEYS) & set(batch)


def test_one_fit_for_kala_models_and_variants():
    """One fit: the variants harness is jsteer.kala.train.fit with its forward and batch keys.
    On KALA's own models (fine-tuning, relational) both give bit-identical params and losses;
    on EaE the fit equals a Trainer run of the objective written out here (token cross-entropy
    plus the entity-linking aux loss) over the harness' batch stream."""
    import optax

    from jsteer.data import ner as ner_lib
    from jsteer.kala import train as ktrain
    from jsteer.train import Trainer, data_mesh

    task = synthetic.make_task(0, n_train=40)
    cfg = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    tc = vtrain.TrainConfig(lr=3e-3, kala_lr=3e-3, batch_size=8, max_steps=4, warmup_ratio=0.25, seed=1)
    kg = task.knowledge_graph()

    def setup(method):
        model = registry.build_model(method, cfg, num_labels=len(synthetic.LABELS), num_entities=len(task.entities))
        train = task.encode("train", functools.partial(registry.encode_ner, method), kg=kg)
        memory = task.memory if method in ("eae", "relational") else None
        return model, registry.init_params(model, jax.random.PRNGKey(0), memory=memory, seq_len=16), train

    def same(a, b):
        assert a.losses == b.losses and len(a.losses) == tc.max_steps
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    for method in ("finetune", "relational"):
        model, params, train = setup(method)
        same(ktrain.fit(model, params, train, tc), vtrain.fit(model, params, train, tc))

    model, params, train = setup("eae")

    def reference_loss(p, batch, rng):
        graph, token_node = ktrain.model_inputs(model, batch)
        out = model.apply(
            {"params": p},
            batch["input_ids"],
            batch["attention_mask"],
            batch.get("token_type_ids"),
            graph,
            token_node,
            deterministic=False,
            extras=None,
            rngs={"dropout": rng},
        )
        valid = batch["labels"] != ner_lib.IGNORE_INDEX
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, jnp.maximum(batch["labels"], 0))
        return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1) + out.aux_loss, {}

    ref = Trainer(
        reference_loss,
        params,
        ktrain.optimizer_config(tc, tc.max_steps),
        mesh=data_mesh(jax.devices()[:1]),
        seed=tc.seed,
        progress=False,
    )
    losses = []
    ref.fit(
        ktrain._Endless.for_model(model, train, tc, "ner", vtrain.batch_keys(model)),
        tc.max_steps,
        on_step=lambda s, m: losses.append(float(m["loss"])),
    )
    same(vtrain.fit(model, params, train, tc), ktrain.FitResult(ref.params, losses, 0, 0, 0, 0, None, 0))


def test_variants_table_merges_the_harness_sweep_of_the_same_protocol(tmp_path):
    """jsteer.kala.variants.report (experiments/kala_variants.py --table, the notebook's table):
    KALA's own methods come from the harness sweep only when it ran the same protocol, times skip
    runs marked timing_perturbed, and harness rows are marked."""
    import json

    from jsteer.kala.variants import report

    setup = {"train_size": 10, "test_size": 5, "epochs": 1, "batch_size": 4, "lr": 3e-4, "kala_lr": 1e-3, "max_len": 32}

    def run(method, seed, f1, secs, **kw):
        return {"method": method, "seed": seed, "f1": f1, "train_seconds": secs, "steps": 3, "params": 7, **kw}

    mine = [
        run("ernie", 0, 70.0, 10.0),
        run("ernie", 1, 72.0, 99.0, timing_perturbed=True),
        run("finetune", 0, 60.0, 5),
    ]
    (tmp_path / "variants_conll.json").write_text(json.dumps({"setup": setup, "runs": mine}))
    harness = [{**run("x", 0, 65.0, 6.0), "variant": v} for v in ("finetune", "relational", "relational_edrop")]
    (tmp_path / "ner_conll.json").write_text(json.dumps({"setup": setup, "runs": harness}))

    res = report.load_results(tmp_path)
    assert list(res) == ["conll"]
    s = res["conll"]["summary"]
    assert set(s) == {"ernie", "finetune", "relational"}  # the sweep's own finetune wins; no edrop row
    assert s["finetune"]["f1"] == 60.0 and res["conll"]["sources"]["relational"] == "ner_conll.json"
    assert s["ernie"]["f1"] == 71.0 and s["ernie"]["n"] == 2 and s["ernie"]["train_seconds"] == 10.0
    text = report.table(res)
    assert "| KALA (relational) † | 65.00 ± 0.00 (n=1) | 6 | – |" in text
    assert "| ERNIE (fusion) | 71.00 ± 1.41 (n=2) | 10 | – |" in text
    assert "K-BERT" not in text and "timing_perturbed" in text

    (tmp_path / "ner_conll.json").write_text(json.dumps({"setup": {**setup, "lr": 1e-4}, "runs": harness}))
    assert set(report.load_results(tmp_path)["conll"]["summary"]) == {"ernie", "finetune"}
