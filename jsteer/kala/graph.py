"""Relational retrieval over per-example entity graphs (KALA section 3.3).

Every example carries a small knowledge graph: its *local* entities (the ones mentioned in
the text) plus their 1-hop neighbours from the knowledge graph, and the facts among them as
directed edges ``sender -> receiver`` with a relation id. Graphs are padded with
:func:`jraph.pad_with_graphs` to static node / edge buckets (a few sizes), so jit compiles a
bounded number of shapes (:func:`batch_graphs`). For the trainer, which wants a leading batch
axis on every input, :func:`stack_graphs` reshapes the padded arrays to [B, n/B] and
:func:`flatten_graphs` restores the GraphsTuple inside jit.

Layout of the batched graph (N nodes, E edges, G graphs; all static after padding)::

    graph.nodes  = {"entity": int32 [N]}   entity-vocabulary id; 0 = null entity (unknown
                                           entity, padding node) with a zero embedding
    graph.edges  = {"relation": int32 [E]} relation id; 0 = self loop
    graph.senders, graph.receivers: int32 [E]
    graph.n_node, graph.n_edge:     int32 [G]

Tokens point into the batched graph with ``token_node`` int32 [B, T]: the node of the entity
mentioned at that token, -1 for tokens outside every mention.

Graph layer (relation-aware GATv2, one head), for an edge j -> i with relation r_ij::

    s_ij  = a^T LeakyReLU(W_dst e_i + W_rel r_ij + W_src e_j + W_ctx sg(h_i))
          = a^T LeakyReLU(W [e_i || r_ij || e_j || h_i])       (W = [W_dst|W_rel|W_src|W_ctx])
    alpha = softmax over the edges entering i of s_ij    (jraph.segment_softmax)
    e_i'  = sum_j alpha_ij W_src e_j + b

``h_i`` is the mention context of node i: the mean of the current layer's input hidden states
over the tokens mentioning it (zero for neighbour-only nodes), with the gradient stopped as in
the original (which sums instead of averaging; the mean keeps the scale independent of the
mention's length). After each layer: ReLU, then dropout (0.1). Self loops carry their own
relation embedding (the original used a zero relation vector for them).

Null masking: a node *carries information* when it is a known entity (id != 0); after a layer
it also carries information when it received some from a node that did. Edges whose sender
carries none get weight exactly 0 (in the first layer: every null and padding node), so an
unknown entity is represented only through its known neighbours, and a null node without any
is the zero vector -- the same as a point-wise lookup of the null entity.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph
import numpy as np

from jsteer.backbones.base import segment_sum, take_rows
from jsteer.backbones.matmul import Dense
from jsteer.data.buckets import GRAPH, bucket

Array = jnp.ndarray

NEG = -1e9  # masked attention logit: exp(NEG - max) underflows to exactly 0 in fp32
SELF_LOOP = 0  # relation id of the self loops every node gets


# ----------------------------------------------------------------------------------------------
# per-example graphs (NumPy) and batching


@dataclasses.dataclass
class ExampleGraph:
    """One example's entity graph (NumPy).

    entity: int32 [n] entity-vocabulary ids (0 = null) of the n nodes; the first
            ``n_local`` nodes are the example's mentioned entities, the rest neighbours.
    senders, receivers, relation: int32 [e] directed edges j -> i with their relation ids,
            self loops included (see :func:`add_self_loops`).
    """

    entity: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    relation: np.ndarray
    n_local: int

    @property
    def n_node(self) -> int:
        return int(self.entity.shape[0])

    @property
    def n_edge(self) -> int:
        return int(self.senders.shape[0])

    @staticmethod
    def empty() -> "ExampleGraph":
        z = np.zeros((0,), np.int32)
        return ExampleGraph(entity=z, senders=z, receivers=z, relation=z, n_local=0)


def add_self_loops(g: ExampleGraph) -> ExampleGraph:
    """Drops existing self loops and gives every node one, with relation :data:`SELF_LOOP`."""
    keep = g.senders != g.receivers
    idx = np.arange(g.n_node, dtype=np.int32)
    return ExampleGraph(
        entity=g.entity.astype(np.int32),
        senders=np.concatenate([g.senders[keep], idx]).astype(np.int32),
        receivers=np.concatenate([g.receivers[keep], idx]).astype(np.int32),
        relation=np.concatenate([g.relation[keep], np.full(g.n_node, SELF_LOOP)]).astype(np.int32),
        n_local=g.n_local,
    )


def batch_graphs(
    graphs: Sequence[ExampleGraph], token_nodes: np.ndarray, n_node: Optional[int] = None, n_edge: Optional[int] = None
) -> tuple[jraph.GraphsTuple, np.ndarray]:
    """Concatenates the graphs of a batch and pads them to static buckets.

    graphs: B example graphs, in batch order.
    token_nodes: int32 [B, T] local node index of each token's entity (-1 = none).
    n_node / n_edge: padded totals; default the :data:`jsteer.data.buckets.GRAPH` bucket of (real total + 1), since
      :func:`jraph.pad_with_graphs` needs at least one padding node.
    Returns (graph with B + 1 graphs, the last one padding; token_node int32 [B, T] indexing
    the batched nodes, -1 = none).
    """
    token_nodes = np.asarray(token_nodes)
    if token_nodes.ndim != 2 or token_nodes.shape[0] != len(graphs):
        raise ValueError(f"token_nodes must be [B={len(graphs)}, T], got shape {token_nodes.shape}")
    offsets = np.cumsum([0] + [g.n_node for g in graphs])
    total_nodes, total_edges = int(offsets[-1]), sum(g.n_edge for g in graphs)
    n_node = GRAPH(total_nodes + 1) if n_node is None else n_node
    n_edge = GRAPH(total_edges) if n_edge is None else n_edge
    if n_node < total_nodes + 1 or n_edge < total_edges:
        raise ValueError(
            f"graph bucket too small: {total_nodes} nodes (+1 padding) and "
            f"{total_edges} edges do not fit n_node={n_node}, n_edge={n_edge}"
        )
    for b, g in enumerate(graphs):
        bad = token_nodes[b] >= g.n_local
        if bad.any():
            raise ValueError(
                f"token_nodes[{b}] points at node {int(token_nodes[b][bad].max())} but "
                f"example {b} has only {g.n_local} local nodes"
            )
    cat = lambda xs: np.concatenate([np.asarray(x, np.int32) for x in xs]) if xs else np.zeros(0, np.int32)  # noqa: E731
    graph = jraph.GraphsTuple(
        nodes={"entity": cat([g.entity for g in graphs])},
        edges={"relation": cat([g.relation for g in graphs])},
        senders=cat([g.senders + o for g, o in zip(graphs, offsets)]),
        receivers=cat([g.receivers + o for g, o in zip(graphs, offsets)]),
        n_node=np.asarray([g.n_node for g in graphs], np.int32),
        n_edge=np.asarray([g.n_edge for g in graphs], np.int32),
        globals=None,
    )
    graph = jraph.pad_with_graphs(graph, n_node=n_node, n_edge=n_edge, n_graph=len(graphs) + 1)
    token_node = np.where(token_nodes >= 0, token_nodes + offsets[:-1, None], -1).astype(np.int32)
    return graph, token_node


GRAPH_KEYS = (
    "graph_entity",
    "graph_senders",
    "graph_receivers",
    "graph_relation",
    "graph_n_node",
    "graph_n_edge",
    "graph_mention",
    "graph_last_senders",
    "graph_last_receivers",
    "graph_last_relation",
)


def graph_need(graphs: Sequence[ExampleGraph], token_nodes: Sequence[np.ndarray]) -> tuple[int, int, int]:
    """(nodes + 1 padding node, edges, distinct mentioned nodes (at least 1)) that
    :func:`stack_graphs` must fit for these graphs; token_nodes: each example's [T] local nodes."""
    mentioned = sum(np.unique(np.asarray(t)[np.asarray(t) >= 0]).size for t in token_nodes)
    return sum(g.n_node for g in graphs) + 1, sum(g.n_edge for g in graphs), max(mentioned, 1)


def stack_graphs(
    graphs: Sequence[ExampleGraph],
    token_nodes: np.ndarray,
    n_node_min: int = 0,
    n_edge_min: int = 0,
    n_mention_min: int = 0,
    smaller: int = 0,
) -> dict[str, np.ndarray]:
    """:func:`batch_graphs` laid out with a leading batch axis (what the trainer's data
    sharding expects of every input): the padded node / edge arrays, whose bucket sizes are
    multiples of B, are reshaped to [B, n/B]::

        graph_entity [B, N/B], graph_senders / graph_receivers / graph_relation [B, E/B]
        (flat node indices), graph_n_node / graph_n_edge [B] (real counts),
        token_node [B, T] (flat node index, -1 none),
        graph_mention [B, M/B]: the nodes some token mentions, ascending, padded with the last
        (always a padding) node N - 1 -- the only nodes whose KFM output reaches a token
        (:func:`mention_positions`)
        graph_last_senders / graph_last_receivers / graph_last_relation [B, L/B]: the edges into
        those nodes, padded with N - 1 -> N - 1 (relation 0) -- all the last GNN layer needs
        (:func:`last_layer_edges`); L = E/2 rounded up to a multiple of B, or E when more edges
        than that go into mentioned nodes

    Buckets: (max(B, ``n_node_min``), max(B, ``n_edge_min``), max(B, ``n_mention_min``)) x 2^k
    with the smallest k >= 0 that fits all three; a size whose minimum is 0 (not given) is
    instead the smallest power-of-two multiple of B that fits. Rounded up to multiples of B.
    ``smaller`` > 0 lets a batch whose graph fits the minima take node / edge buckets of one of
    ``smaller`` rungs below them instead (x 3/4, 1/2, 3/8, 1/4, ...: the smallest that fits; the
    mentioned-node bucket stays): the GATv2 cost grows faster than linearly with the padded edge
    count, and graph sizes within one length bucket spread over an order of magnitude. That
    costs up to ``smaller`` more compiled shapes per minima tuple.
    :func:`flatten_graphs` restores the GraphsTuple inside jit.
    """
    b = len(graphs)
    offsets = np.cumsum([0] + [g.n_node for g in graphs])[:-1, None]
    mentioned = np.unique(np.where(token_nodes >= 0, token_nodes + offsets, -1))
    mentioned = mentioned[mentioned >= 0].astype(np.int32)
    need = graph_need(graphs, token_nodes)
    given = [m > 0 for m in (n_node_min, n_edge_min, n_mention_min)]
    mins = [max(m, b) for m in (n_node_min, n_edge_min, n_mention_min)]
    # the given sizes double together, so a batch takes one rung, not a combination; the smaller
    # rungs shrink nodes and edges only (the mentioned-node bucket, cheap, stays)
    if smaller < 0:
        raise ValueError(f"smaller must be >= 0, got {smaller}")
    rung = [int(np.ceil(np.log2(max(n, 1) / m))) if g else 0 for n, m, g in zip(need, mins, given)]
    doublings = max(rung + [0])
    sizes = [m << doublings if g else m for m, g in zip(mins, given)]
    if doublings == 0 and any(given[:2]):
        for k in range(smaller, 0, -1):  # the smallest rung whose nodes and edges fit
            shrunk = [_shrunk(m, k) if g else m for m, g in zip(mins[:2], given[:2])]
            if all(s >= n for s, n in zip(shrunk, need[:2])):
                sizes[:2] = shrunk
                break
    sizes = [s if s >= n else bucket(n, (s,), "double") for s, n in zip(sizes, need)]  # no min given / float rounding
    n_node, n_edge, n_mention = (_multiple(s, b) for s in sizes)
    graph, token_node = batch_graphs(graphs, token_nodes, n_node=n_node, n_edge=n_edge)
    mention = np.full(n_mention, n_node - 1, np.int32)
    mention[: len(mentioned)] = mentioned
    into = np.flatnonzero(np.isin(graph.receivers, mentioned))  # padding edges point at a padding node
    n_last = _multiple(max(n_edge // 2, b), b)
    n_last = n_last if len(into) <= n_last else n_edge
    last = {
        k: np.full(n_last, fill, np.int32)
        for k, fill in (("senders", n_node - 1), ("receivers", n_node - 1), ("relation", 0))
    }
    for k, v in (("senders", graph.senders), ("receivers", graph.receivers), ("relation", graph.edges["relation"])):
        last[k][: len(into)] = v[into]
    return {
        "graph_entity": graph.nodes["entity"].reshape(b, -1),
        "graph_senders": graph.senders.reshape(b, -1),
        "graph_receivers": graph.receivers.reshape(b, -1),
        "graph_relation": graph.edges["relation"].reshape(b, -1),
        "graph_n_node": np.asarray(graph.n_node[:b], np.int32),
        "graph_n_edge": np.asarray(graph.n_edge[:b], np.int32),
        "token_node": token_node,
        "graph_mention": mention.reshape(b, -1),
        **{f"graph_last_{k}": v.reshape(b, -1) for k, v in last.items()},
    }


def mention_positions(mention: Array, token_node: Array) -> Array:
    """Node -> its position in ``mention`` (the ascending mentioned nodes of :func:`stack_graphs`,
    [M]); -1 for tokens outside mentions (node < 0) and for nodes not in ``mention``.
    token_node int [...] (e.g. [B, T]) -> the same shape."""
    at = jnp.minimum(jnp.searchsorted(mention, jnp.maximum(token_node, 0)), mention.shape[0] - 1)
    at = at.astype(token_node.dtype)
    return jnp.where((token_node >= 0) & (mention[at] == token_node), at, -1)


def _multiple(n: int, k: int) -> int:
    return -(-n // k) * k


def _shrunk(m: int, k: int) -> int:
    """Rung k below m: m x 3/4, 1/2, 3/8, 1/4, ... for k = 1, 2, 3, 4, ... (rounded up)."""
    num = 3 if k % 2 else 4
    return -(-m * num // (4 << (k // 2)))


def flatten_graphs(batch) -> tuple[jraph.GraphsTuple, Array]:
    """A batch with :func:`stack_graphs`'s keys -> (GraphsTuple of B + 1 graphs, the last one
    padding; token_node [B, T] into its nodes). Jit-friendly: static shapes only."""
    ent = jnp.asarray(batch["graph_entity"]).reshape(-1)
    snd = jnp.asarray(batch["graph_senders"]).reshape(-1)
    n_real = jnp.asarray(batch["graph_n_node"], jnp.int32)
    e_real = jnp.asarray(batch["graph_n_edge"], jnp.int32)
    graph = jraph.GraphsTuple(
        nodes={"entity": ent},
        edges={"relation": jnp.asarray(batch["graph_relation"]).reshape(-1)},
        senders=snd,
        receivers=jnp.asarray(batch["graph_receivers"]).reshape(-1),
        n_node=jnp.concatenate([n_real, (ent.shape[0] - jnp.sum(n_real))[None]]),
        n_edge=jnp.concatenate([e_real, (snd.shape[0] - jnp.sum(e_real))[None]]),
        globals=None,
    )
    return graph, jnp.asarray(batch["token_node"])


def last_layer_edges(batch) -> Optional[tuple[Array, Array, Array]]:
    """(senders, receivers, relation ids), each int [L], of the edges into mentioned nodes from a
    batch with :func:`stack_graphs`'s keys; None when the batch has none. The last GNN layer's
    output is read only at mentioned nodes (``mention`` of :class:`jsteer.kala.model.KalaModel`),
    and in KALA's subgraphs about a third of the edges end there, so that layer may skip the rest
    (:class:`RelationalGraph`'s ``last_edges``) with the same result at those nodes."""
    if "graph_last_senders" not in batch:
        return None
    return tuple(jnp.asarray(batch[f"graph_last_{k}"]).reshape(-1) for k in ("senders", "receivers", "relation"))


# ----------------------------------------------------------------------------------------------
# token <-> node plumbing


def node_context(hidden: Array, token_node: Array, num_nodes: int) -> Array:
    """Mean hidden state over each node's mention tokens.

    hidden [B, T, D], token_node int [B, T] (-1 = none) -> [N, D] (zero for nodes no token
    mentions: neighbours and padding).
    """
    d = hidden.shape[-1]
    ids = token_node.reshape(-1)
    ids = jnp.where(ids < 0, num_nodes, ids)  # dump segment, dropped below
    sums = segment_sum(hidden.reshape(-1, d), ids, num_nodes + 1)[:num_nodes]
    counts = segment_sum(jnp.ones_like(ids, hidden.dtype), ids, num_nodes + 1)[:num_nodes]
    return sums / jnp.maximum(counts, 1.0)[:, None]


def gather_tokens(node_values: Array, token_node: Array) -> Array:
    """node_values [N, F], token_node [B, T] -> [B, T, F], zero where token_node < 0."""
    picked = take_rows(node_values, jnp.maximum(token_node, 0))
    return picked * (token_node >= 0)[..., None].astype(node_values.dtype)


# ----------------------------------------------------------------------------------------------
# modules


def _glorot():
    return nn.initializers.glorot_uniform()


class RelationalGATv2(nn.Module):
    """One relation-aware GATv2 layer (see the module docstring for the equations).

    dim: output size (= input entity size in KALA).
    """

    dim: int
    negative_slope: float = 0.2

    @nn.compact
    def __call__(
        self,
        x: Array,
        rel: Array,
        ctx: Array,
        senders: Array,
        receivers: Array,
        sender_ok: Array,
        relation_ids: Optional[Array] = None,
        ctx_nodes: Optional[Array] = None,
        targets: Optional[Array] = None,
    ) -> tuple[Array, Array]:
        """x [N, De] node states, rel [E, Dr] relation embeddings of the edges (or, with
        ``relation_ids`` int [E], the relation table [R, Dr]: projected once per relation, not
        per edge -- the same values, R << E), ctx [N, D] mention contexts (gradient stopped
        here), senders/receivers int [E], sender_ok bool [N] (nodes that may send).

        ``ctx_nodes`` int [K]: ctx is then [K, D], the contexts of these nodes only (every other
        node's is zero, as for neighbour-only nodes; rows of a repeated node add up), so its
        projection runs on K rows instead of N. ``targets`` int [M]: compute the new states of
        these nodes only; ``receivers`` then index ``targets`` (a receiver >= M drops its edge).

        Returns (new states [N, dim] -- [M, dim] with ``targets`` --, attention weights [E])."""
        n = x.shape[0]
        src = Dense(self.dim, kernel_init=_glorot(), name="src")(x)
        c = Dense(self.dim, use_bias=False, kernel_init=_glorot(), name="ctx")(jax.lax.stop_gradient(ctx))
        if ctx_nodes is not None:
            c = segment_sum(c, ctx_nodes, n)
        dst_dense = Dense(self.dim, kernel_init=_glorot(), name="dst")
        if targets is None:
            dst, n_out = dst_dense(x) + c, n
        else:
            dst, n_out = dst_dense(take_rows(x, targets)) + take_rows(c, targets), targets.shape[0]
        edge = Dense(self.dim, kernel_init=_glorot(), name="rel")(rel)
        if relation_ids is not None:
            edge = take_rows(edge, relation_ids)
        att = self.param("att", _glorot(), (1, self.dim))[0]
        # an extra segment n_out collects dropped edges (receivers >= n_out) and is cut off
        receivers = jnp.minimum(receivers, n_out)
        src_e = take_rows(src, senders)
        z = nn.leaky_relu(take_rows(dst, jnp.minimum(receivers, n_out - 1)) + src_e + edge, self.negative_slope)
        logits = jnp.einsum("ed,d->e", z, att).astype(jnp.float32)  # the softmax's segment sums in fp32
        ok = sender_ok[senders] & (receivers < n_out)
        alpha = jraph.segment_softmax(jnp.where(ok, logits, NEG), receivers, n_out + 1) * ok
        out = segment_sum(alpha[:, None] * src_e, receivers, n_out + 1)[:n_out].astype(src.dtype)
        out = out + self.param("bias", nn.initializers.zeros, (self.dim,))
        return out, alpha


class RelationalGraph(nn.Module):
    """Stack of :class:`RelationalGATv2` layers with ReLU + dropout, null-masked.

    Returns the final node states [N, dim], zero for nodes that carry no information.
    """

    dim: int
    num_layers: int = 2
    dropout: float = 0.1

    @nn.compact
    def __call__(
        self,
        x: Array,
        rel: Array,
        ctx: Array,
        graph: jraph.GraphsTuple,
        deterministic: bool = True,
        return_attention: bool = False,
        relation_table: bool = False,
        last_edges: Optional[tuple[Array, Array, Array]] = None,
        mention: Optional[Array] = None,
    ):
        """x [N, De], rel [E, Dr] per edge (or the table [R, Dr] indexed by
        ``graph.edges["relation"]`` when ``relation_table``), ctx [N, D] (or, with ``mention``,
        [M, D]: the contexts of the ``mention`` nodes, every other node's being zero).

        ``mention`` int [M]: ascending ids of the nodes whose output is read (and the only ones
        with a mention context), e.g. :func:`stack_graphs`'s ``graph_mention``. ``last_edges``
        (needs ``mention`` and ``relation_table``): (senders, receivers, relation ids) int [L],
        the edges into the ``mention`` nodes (:func:`last_layer_edges`), which the last layer runs
        on instead of the whole edge list, computing those nodes' states only. Only their outputs
        are then valid, and that layer's attention weights are over these L edges."""
        senders, receivers = graph.senders, graph.receivers
        ids = graph.edges["relation"] if relation_table else None
        if last_edges is not None and not relation_table:
            raise ValueError("last_edges needs relation_table=True (per-edge relation rows cannot follow the subset)")
        if last_edges is not None and mention is None:
            raise ValueError("last_edges restricts the last layer to the mentioned nodes; pass mention too")
        if mention is not None and ctx.shape[0] != mention.shape[0]:
            raise ValueError(
                f"with mention [{mention.shape[0]}], ctx must hold those nodes' contexts "
                f"[{mention.shape[0]}, D], got {tuple(ctx.shape)}"
            )
        n = x.shape[0]
        ok = graph.nodes["entity"] != 0
        attentions = []
        for i in range(self.num_layers):
            layer = RelationalGATv2(self.dim, name=f"layer_{i}")
            if last_edges is not None and i == self.num_layers - 1:
                senders, receivers, ids = last_edges
                into = mention_positions(mention, receivers)
                into = jnp.where(into < 0, mention.shape[0], into)  # not a mentioned node: dropped
                x_m, alpha = layer(x, rel, ctx, senders, into, ok, ids, ctx_nodes=mention, targets=mention)
                # back to [N, D] so that dropout below draws the same mask as the full graph's
                x = jnp.zeros((n, self.dim), x_m.dtype).at[mention].set(x_m)
            else:
                x, alpha = layer(x, rel, ctx, senders, receivers, ok, ids, ctx_nodes=mention)
            attentions.append(alpha)
            x = nn.Dropout(self.dropout)(nn.relu(x), deterministic=deterministic)
            got = jax.ops.segment_max(ok[senders].astype(jnp.int32), receivers, n) > 0
            ok = ok | got
        x = x * ok[:, None].astype(x.dtype)
        return (x, attentions) if return_attention else x
