"""KALA task models: the BERT backbone + the knowledge module, composed through FiLM hooks.

Methods (``KalaConfig.method``), all in one harness:

- ``"finetune"``: plain fine-tuning (computes exactly what BertForTokenClassification /
  BertForQuestionAnswering compute on the same params).
- ``"more_params"``: one extra, randomly initialised :class:`BertLayer` after the encoder.
- ``"pointwise"``: KFM from the entity memory lookup only.
- ``"relational"``: KFM from the relation-aware GATv2 over each example's entity graph.

The model runs the shared :class:`~jsteer.backbones.bert.BertEncoder` (its layer loop; the tree
under ``"encoder"`` is BertEncoder's, so ``params_from_hf`` output plugs in) with KALA as
interventions at its sites (:mod:`jsteer.interventions`): at ``resid_pre.l`` of each KFM layer l,
:class:`KFMCompute` computes that layer's :class:`~jsteer.hooks.FiLM` from the layer's input (the
mention contexts h_e) and keeps it in ``ctx.state``; :class:`FiLMApply` applies its ``in`` half at
``ffn_in.l`` and its ``out`` half at ``resid_post.l`` (where ``Hooks(film=...)`` acts).
``more_params`` runs its extra layer at the ``final`` site (:class:`ExtraLayer`). Parameter tree::

    {"encoder": BertEncoder tree, "head": head tree,
     "kala": {"memory": [Ve, De], "relations": [R, 128], "kfm_<l>": ..., "graph_<l>": ...},
     "extra_layer": BertLayer tree}            # "kala" / "extra_layer" only when used

Call::

    out = model.apply({"params": p}, input_ids [B,T], attention_mask [B,T], token_type_ids=None,
                      graph=GraphsTuple, token_node=int [B,T], deterministic=True,
                      rngs={"dropout": key})       -> ModelOutput(logits, hidden)

``token_node`` indexes ``graph``'s nodes (-1: no mention).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import jraph

from jsteer import interventions as iv
from jsteer.backbones.base import ModelOutput, take_rows
from jsteer.backbones.bert import BertConfig, BertEncoder, BertLayer, attention_bias
from jsteer.backbones.bert_heads import QAHead, TokenClassificationHead
from jsteer.hooks import Hooks, apply_film
from jsteer.kala.graph import RelationalGraph, gather_tokens, mention_positions, node_context
from jsteer.kala.kfm import KFM

Array = jnp.ndarray
METHODS = ("finetune", "more_params", "pointwise", "relational")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The last layers, as in the paper: (9, 11) for 12 layers, (3, 5) for MiniLM's 6."""
    if num_layers < 2:
        return (num_layers - 1,)
    return (max(num_layers - 3, 0), num_layers - 1)


def checked_layers(layers, num_layers: int, what: str) -> tuple[int, ...]:
    """``layers`` sorted without repeats; a ValueError naming ``what`` when one is outside a
    ``num_layers``-layer backbone."""
    bad = [x for x in layers if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"{what} layers {bad} out of range for a {num_layers}-layer backbone")
    return tuple(sorted(set(layers)))


class KnowledgeConfig:
    """What the frozen config dataclasses of KALA and the variants share: the checks of their
    common fields (``method``, ``layers``, ``num_entities``) and a JSON round trip (``layers``
    a tuple, a list in JSON)."""

    def check_common(self, methods: tuple) -> None:
        """``method`` one of ``methods``, ``layers`` made a tuple of ints, ``num_entities`` >= 1
        (the null entity)."""
        name = type(self).__name__
        if self.method not in methods:
            raise ValueError(f"{name}.method must be one of {methods}, got {self.method!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if self.num_entities < 1:
            raise ValueError(f"{name}.num_entities must be >= 1 (null entity), got {self.num_entities}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        if d.get("layers") is not None:
            d["layers"] = tuple(d["layers"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class KalaConfig(KnowledgeConfig):
    """Knowledge-module hyper-parameters.

    layers: 0-based backbone layers with KFM; None -> :func:`default_layers`.
    num_entities: entity vocabulary size including the null entity 0.
    entity_dim: entity memory width; None -> the backbone hidden size (as in the original).
    kfm_zero_init: start the KFM maps' last Linear at zero (identity KFM; see jsteer.kala.kfm).
    entity_dropout: in training, the rate at which graph nodes are made null (entity id 0) for
      the step. Every training mention is in the entity vocabulary (it is built from them), but
      at test time many are not (39% of CoNLL-2003 test mentions with a 3000-sentence
      vocabulary): without it the model never learns what to do with a null mention.
    """

    method: str = "relational"
    layers: Optional[tuple[int, ...]] = None
    num_entities: int = 1
    entity_dim: Optional[int] = None
    num_relations: int = 128
    relation_dim: int = 128
    gnn_layers: int = 2
    dropout: float = 0.1
    use_gamma: bool = True
    use_beta: bool = True
    kfm_zero_init: bool = True
    entity_dropout: float = 0.0

    def __post_init__(self):
        self.check_common(METHODS)
        if not 0.0 <= self.entity_dropout < 1.0:
            raise ValueError(f"KalaConfig.entity_dropout must be in [0, 1), got {self.entity_dropout}")
        if not (self.use_gamma or self.use_beta) and self.uses_knowledge:
            raise ValueError("KalaConfig: use_gamma and use_beta cannot both be False")

    @property
    def uses_knowledge(self) -> bool:
        return self.method in ("pointwise", "relational")

    def kfm_layers(self, num_layers: int) -> tuple[int, ...]:
        return checked_layers(default_layers(num_layers) if self.layers is None else self.layers, num_layers, "KFM")


def make_head(config: BertConfig, task: str, num_labels: int, dtype) -> nn.Module:
    """The task head under ``head``: token classification [B, T, L] (``"ner"``) or span QA [B, T, 2]."""
    if task == "ner":
        return TokenClassificationHead(config, num_labels, dtype=dtype, name="head")
    if task == "qa":
        return QAHead(config, dtype=dtype, name="head")
    raise ValueError(f"task must be 'ner' or 'qa', got {task!r}")


def apply_head(head: nn.Module, task: str, h: Array, deterministic: bool) -> Array:
    """Logits of :func:`make_head`'s head on the last hidden state h [B, T, D] (NER: dropout when training)."""
    return head(h, deterministic) if task == "ner" else head(h)


def check_inputs(method: str, input_ids: Array, graph, token_node) -> None:
    """A knowledge method needs the batch graph and ``token_node`` [B, T] shaped like input_ids."""
    b, t = input_ids.shape
    if graph is None or token_node is None:
        raise ValueError(f"method {method!r} needs graph and token_node")
    if token_node.shape != (b, t):
        raise ValueError(f"token_node must be [{b}, {t}] like input_ids, got {token_node.shape}")


def entity_memory(module: nn.Module, cfg, hidden_size: int) -> tuple[Array, int]:
    """(the ``memory`` param [Ne, De] of a knowledge ``module`` set up from ``cfg``, De):
    ``cfg.num_entities`` rows of width ``cfg.entity_dim`` (None: ``hidden_size``), N(0, 0.02)."""
    de = cfg.entity_dim or hidden_size
    return module.param("memory", nn.initializers.normal(0.02), (cfg.num_entities, de)), de


class KnowledgeModule(nn.Module):
    """Entity memory, relation embeddings, and per-KFM-layer graph + KFM maps."""

    kala: KalaConfig
    hidden_size: int
    layers: tuple[int, ...]

    def setup(self):
        k = self.kala
        self.memory, de = entity_memory(self, k, self.hidden_size)
        self.kfms = {
            l: KFM(self.hidden_size, k.use_gamma, k.use_beta, k.kfm_zero_init, name=f"kfm_{l}") for l in self.layers
        }
        if k.method == "relational":
            self.relations = self.param("relations", nn.initializers.normal(1.0), (k.num_relations, k.relation_dim))
            self.graphs = {l: RelationalGraph(de, k.gnn_layers, k.dropout, name=f"graph_{l}") for l in self.layers}

    def __call__(
        self,
        layer: int,
        context: Array,
        graph: jraph.GraphsTuple,
        token_node: Array,
        deterministic: bool = True,
        mention: Optional[Array] = None,
        last_edges=None,
    ):
        """-> FiLM for ``layer`` with [B, T, D] fields (zero outside mention tokens). The four
        maps run once per graph node and are gathered per token (same values as running them
        per token: a node's vector is the same at every token mentioning it); with ``mention``
        ([M] ascending node ids covering every node a token mentions, see
        :func:`jsteer.kala.graph.stack_graphs`) only on those nodes -- neighbour-only and
        padding nodes never reach a token, and they are most of the graph. ``last_edges``
        (with ``mention``; :func:`jsteer.kala.graph.last_layer_edges`): the edges into those
        nodes, the only ones the last GNN layer then runs on."""
        if last_edges is not None and mention is None:
            raise ValueError("last_edges restricts the GNN's last layer to the mentioned nodes; pass mention too")
        # node representations [N, De], or with ``mention`` [M, De] (those nodes' rows)
        ent = graph.nodes["entity"]

        def lookup(ids):  # memory rows, zero for the null entity
            return take_rows(self.memory, ids) * (ids != 0)[:, None].astype(self.memory.dtype)

        if self.kala.method != "relational":  # point-wise: a memory lookup per node
            x = lookup(ent if mention is None else ent[mention])
        else:
            x = lookup(ent)
            if mention is None:
                ctx = node_context(context, token_node, x.shape[0])
            else:  # the mentioned nodes' contexts only: every other node's is zero
                ctx = node_context(context, mention_positions(mention, token_node), mention.shape[0])
            only = dict(last_edges=last_edges, mention=mention)
            x = self.graphs[layer](x, self.relations, ctx, graph, deterministic, relation_table=True, **only)
            x = x if mention is None else take_rows(x, mention)
        if mention is not None:
            token_node = mention_positions(mention, token_node)
        table = self.kfms[layer](x, jnp.ones(x.shape[:1], x.dtype))
        return jax.tree.map(lambda v: gather_tokens(v, token_node), table)


# ----------------------------------------------------------------------------- KALA as interventions


def site_state(ctx: iv.SiteContext, who: str) -> dict:
    """``ctx.state``, or a ValueError naming the method when the backbone gives none (scanned)."""
    if ctx.state is None:
        raise ValueError(f"{who} keeps values between sites in ctx.state, which this backbone does not give")
    return ctx.state


class KFMCompute(iv.Intervention):
    """At ``resid_pre.l``: KALA's FiLM for layer l from the layer input h (the mention contexts),
    kept in ``ctx.state["kala.film.<l>"]``; h passes unchanged. ``knowledge``: the model's bound
    :class:`KnowledgeModule` (static); graph / token_node / mention / last_edges traced."""

    knowledge: Any = flax.struct.field(pytree_node=False)
    graph: Any
    token_node: Array
    mention: Optional[Array] = None
    last_edges: Any = None
    deterministic: bool = flax.struct.field(pytree_node=False, default=True)

    def __call__(self, h, ctx):
        film = self.knowledge(
            ctx.layer, h, self.graph, self.token_node, self.deterministic, self.mention, self.last_edges
        )
        site_state(ctx, "KALA's KFM")[f"kala.film.{ctx.layer}"] = film
        return h


class FiLMApply(iv.Intervention):
    """At ``ffn_in.l`` (``where="in"``) / ``resid_post.l`` (``"out"``): the FiLM that
    :class:`KFMCompute` left in ``ctx.state``, applied as ``Hooks(film={l: ...})`` would be."""

    where: str = flax.struct.field(pytree_node=False)

    def __call__(self, h, ctx):
        film = site_state(ctx, "KALA's KFM")[f"kala.film.{ctx.layer}"]
        return apply_film(h, Hooks(film={ctx.layer: film}), ctx.layer, self.where)


class ExtraLayer(iv.Intervention):
    """At ``final``: one more :class:`BertLayer` (``more_params``; ``layer`` static, bound)."""

    layer: Any = flax.struct.field(pytree_node=False)
    bias: Optional[Array] = None
    deterministic: bool = flax.struct.field(pytree_node=False, default=True)

    def __call__(self, h, ctx):
        return self.layer(h, self.bias, None, self.deterministic)


def kfm_interventions(knowledge, layers, graph, token_node, deterministic, mention=None, last_edges=None) -> dict:
    """{site: intervention} running KALA's KFM at ``layers`` through a backbone's sites."""
    compute = KFMCompute(knowledge, graph, token_node, mention, last_edges, deterministic)
    out = {}
    for l in layers:
        out[f"resid_pre.{l}"] = compute
        out[f"ffn_in.{l}"] = FiLMApply("in")
        out[f"resid_post.{l}"] = FiLMApply("out")
    return out


class KalaModel(nn.Module):
    """BERT + head (``"ner"``: token classification, ``"qa"``: span QA) + KALA / baselines."""

    config: BertConfig
    kala: KalaConfig
    task: str = "ner"
    num_labels: int = 2
    dtype: Any = jnp.float32

    def setup(self):
        if self.task not in ("ner", "qa"):
            raise ValueError(f"KalaModel.task must be 'ner' or 'qa', got {self.task!r}")
        self.encoder = BertEncoder(self.config, dtype=self.dtype)
        self.head = make_head(self.config, self.task, self.num_labels, self.dtype)
        self.kfm_layers = self.kala.kfm_layers(self.config.num_layers) if self.kala.uses_knowledge else ()
        if self.kala.uses_knowledge:
            self.knowledge = KnowledgeModule(self.kala, self.config.hidden_size, self.kfm_layers, name="kala")
        if self.kala.method == "more_params":
            self.extra = BertLayer(
                self.config, layer_index=self.config.num_layers, dtype=self.dtype, name="extra_layer"
            )

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Optional[Array] = None,
        token_type_ids: Optional[Array] = None,
        graph: Optional[jraph.GraphsTuple] = None,
        token_node: Optional[Array] = None,
        deterministic: bool = True,
        mention: Optional[Array] = None,
        last_edges=None,
    ) -> ModelOutput:
        """``mention``: optional [M] ascending ids of the nodes tokens mention (restricts the KFM
        maps to them; same output). ``last_edges``: optional (senders, receivers, relation ids)
        int [L] of the edges into those nodes (:func:`jsteer.kala.graph.last_layer_edges`; needs
        ``mention``): the relational GNN's last layer runs on them only (same output)."""
        b, t = input_ids.shape
        if self.kala.uses_knowledge:
            check_inputs(self.kala.method, input_ids, graph, token_node)
            if not deterministic and self.kala.entity_dropout > 0:
                graph = drop_entities(graph, self.make_rng("dropout"), self.kala.entity_dropout)
        ivs = {}
        if self.kala.uses_knowledge:
            ivs = kfm_interventions(
                self.knowledge, self.kfm_layers, graph, token_node, deterministic, mention, last_edges
            )
        if self.kala.method == "more_params":
            ivs["final"] = ExtraLayer(self.extra, attention_bias(attention_mask, None, b, t), deterministic)
        hooks = Hooks(interventions=ivs) if ivs else None
        h = self.encoder(input_ids, attention_mask, token_type_ids, hooks, deterministic).hidden
        return ModelOutput(logits=apply_head(self.head, self.task, h, deterministic), hidden=h)


def drop_entities(graph: jraph.GraphsTuple, rng: jax.Array, rate: float) -> jraph.GraphsTuple:
    """``graph`` with each node's entity replaced by the null entity 0 with probability ``rate``
    (the node then carries no information of its own, as an out-of-vocabulary entity)."""
    ent = graph.nodes["entity"]
    keep = jax.random.bernoulli(rng, 1.0 - rate, ent.shape)
    return graph._replace(nodes={**graph.nodes, "entity": jnp.where(keep, ent, 0)})


def init_params(
    model: KalaModel,
    rng: jax.Array,
    encoder_params: Optional[dict] = None,
    head_params: Optional[dict] = None,
    memory: Optional[Array] = None,
    seq_len: int = 8,
) -> dict:
    """Fresh params for ``model``; optionally overwrite the encoder / head with pretrained trees
    (e.g. from ``params_from_hf``) and the entity memory with :func:`init_memory`'s output."""
    import numpy as np

    from jsteer.kala.graph import ExampleGraph, batch_graphs  # local: avoid a cycle in docs tools

    ids = jnp.zeros((1, seq_len), jnp.int32)
    g, tn = batch_graphs([ExampleGraph.empty()], np.full((1, seq_len), -1, np.int32))
    init = jax.jit(lambda r, ids, g, tn: model.init({"params": r, "dropout": r}, ids, jnp.ones_like(ids), None, g, tn))
    params = init(rng, ids, g, jnp.asarray(tn))["params"]
    params = jax.tree.map(lambda x: x, dict(params))
    if encoder_params is not None:
        want = jax.tree.map(jnp.shape, params["encoder"])
        got = jax.tree.map(jnp.shape, encoder_params)
        if want != got:
            raise ValueError("encoder params do not match the model's BertEncoder tree (shapes/names differ)")
        params["encoder"] = jax.tree.map(jnp.asarray, encoder_params)
    if head_params is not None:
        params["head"] = jax.tree.map(jnp.asarray, head_params)
    if memory is not None:
        if "kala" not in params:
            raise ValueError(f"method {model.kala.method!r} has no entity memory")
        kala = dict(params["kala"])
        if tuple(memory.shape) != tuple(kala["memory"].shape):
            raise ValueError(f"memory has shape {tuple(memory.shape)}, expected {tuple(kala['memory'].shape)}")
        kala["memory"] = jnp.asarray(memory)
        params["kala"] = kala
    return params
