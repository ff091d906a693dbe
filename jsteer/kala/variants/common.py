"""Pieces shared by the knowledge-integration variants (ERNIE, K-BERT, EaE, adapter).

Every variant is a task model with the same call and parameter layout as
:class:`jsteer.kala.model.KalaModel`, so the KALA harness' data (mentions, entity ids, graphs),
memory initialisation, training engine and evaluation apply unchanged::

    out = model.apply({"params": p}, input_ids [B,T], attention_mask [B,T], token_type_ids,
                      graph (GraphsTuple), token_node [B,T], deterministic=True,
                      extras={name: [B,T] int}, rngs={"dropout": key})
        -> VariantOutput(logits, hidden, aux_loss=None | [], aux={name: []})

    params = {"encoder": BertEncoder tree (unchanged names, so ``params_from_hf`` output plugs
              in), "head": head tree, "kala": {"memory": [Ne, De], ...method parts}}

Every variant runs the shared :class:`~jsteer.backbones.bert.BertEncoder` (its one layer loop)
and acts through its sites (:mod:`jsteer.interventions`): ERNIE's fusion at ``ffn_hidden.l``,
EaE's retrieval at ``resid_post.l``, the knowledge adapter at ``ffn_out.l``; K-BERT through the
encoder's ``attn_bias`` / ``position_ids`` hooks. Each intervention holds the method's own bound
module (static) and the per-batch arrays it reads (traced); values a method passes between sites
(ERNIE's entity stream, EaE's retrieval logits) travel in ``ctx.state``.

Everything knowledge-related lives under ``"kala"`` so the harness' optimiser puts it in the
``kala_lr`` group. ``model.kala`` is a :class:`VariantConfig` (``uses_knowledge`` is True but for
K-BERT, whose knowledge arrives in its sentence tree: the harness hands the others their graph and
``token_node``).

Entities reach tokens as in KALA: ``token_node`` [B,T] points every mention token at its node of
the batched graph (-1 outside mentions); ``graph.nodes["entity"]`` holds the node's entity id
(0 = null: unknown entity or padding, whose memory row is treated as zero).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import flax.struct
import jax.numpy as jnp
import jraph

from jsteer.backbones.attention import dot_product_attention
from jsteer.backbones.base import ModelOutput, take_rows
from jsteer.backbones.bert import BertConfig, BertEncoder, EncoderOutput
from jsteer.hooks import Hooks
from jsteer.kala.graph import node_context
from jsteer.kala.model import KnowledgeConfig, apply_head, check_inputs, checked_layers, default_layers, make_head

Array = jnp.ndarray
VARIANT_METHODS = ("ernie", "kbert", "eae", "adapter")


@flax.struct.dataclass
class VariantOutput(ModelOutput):
    """:class:`ModelOutput` plus an auxiliary loss the training objective adds (EaE's entity
    linking) and scalar diagnostics."""

    aux_loss: Optional[Array] = None
    aux: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class VariantConfig(KnowledgeConfig):
    """Hyper-parameters of a knowledge-integration variant.

    method: one of :data:`VARIANT_METHODS`.
    layers: 0-based backbone layers with knowledge; None -> the method's default
      (:meth:`knowledge_layers`). Unused by K-BERT (knowledge enters at the input).
    num_entities: entity vocabulary size including the null entity 0.
    entity_dim: entity memory width; None -> the backbone hidden size (memory initialised
      from the backbone's contextual features, as for KALA).
    entity_heads: heads of ERNIE's entity self-attention (must divide the entity width).
    adapter_size: bottleneck width of the knowledge adapter.
    el_weight: weight of EaE's entity-linking loss.
    dropout: dropout inside the knowledge modules.
    """

    method: str = "ernie"
    layers: Optional[tuple[int, ...]] = None
    num_entities: int = 1
    entity_dim: Optional[int] = None
    entity_heads: int = 4
    adapter_size: int = 64
    el_weight: float = 1.0
    dropout: float = 0.1

    def __post_init__(self):
        self.check_common(VARIANT_METHODS)
        if self.adapter_size < 1 or self.entity_heads < 1:
            raise ValueError("VariantConfig.adapter_size and entity_heads must be >= 1")

    @property
    def uses_knowledge(self) -> bool:
        """Whether the model reads the batch graph / ``token_node`` (K-BERT reads its tree extras)."""
        return self.method != "kbert"

    def knowledge_layers(self, num_layers: int) -> tuple[int, ...]:
        """Chosen layers, checked; defaults: ERNIE / adapter the last layers as KALA ((3, 5) for
        6 layers, (9, 11) for 12); EaE one memory layer after a third of the depth (after layer
        4 of 12, as in the paper: index 3); K-BERT none."""
        if self.method == "kbert":
            return ()
        if self.layers is not None:
            layers = self.layers
        elif self.method == "eae":
            layers = (max(num_layers // 3 - 1, 0),)
        else:
            layers = default_layers(num_layers)
        return checked_layers(layers, num_layers, self.method)


class VariantModel(nn.Module):
    """What every variant model shares: the shared :class:`BertEncoder` under ``encoder``, the
    task head under ``head``, the layers ``kala.knowledge_layers`` as ``self.knowledge_layers``
    and the call of the module docstring. A subclass sets ``method`` (its registry name), builds
    its knowledge modules (under ``kala``) in :meth:`setup_knowledge` and gives the encoder its
    :meth:`interventions` (or, K-BERT, its own :meth:`hooks`); :meth:`outputs` adds auxiliary
    outputs read from the encoder's result."""

    config: BertConfig
    kala: VariantConfig
    task: str = "ner"
    num_labels: int = 2
    dtype: Any = jnp.float32
    method = ""  # class attribute, not a field

    def setup(self):
        self.encoder = BertEncoder(self.config, dtype=self.dtype)
        self.head = make_head(self.config, self.task, self.num_labels, self.dtype)
        self.knowledge_layers = self.kala.knowledge_layers(self.config.num_layers)
        self.setup_knowledge()

    def setup_knowledge(self) -> None:
        raise NotImplementedError

    def hooks(self, input_ids: Array, graph, token_node, deterministic: bool, extras: Optional[dict]) -> Hooks:
        """The encoder's hooks for one batch: the graph and ``token_node`` checked, then
        :meth:`interventions`."""
        check_inputs(self.method, input_ids, graph, token_node)
        return Hooks(interventions=self.interventions(graph, token_node, deterministic))

    def interventions(self, graph: jraph.GraphsTuple, token_node: Array, deterministic: bool) -> dict:
        """{site: Intervention} of the method for one batch."""
        raise NotImplementedError

    def outputs(self, out: EncoderOutput, graph, token_node) -> dict:
        """Extra :class:`VariantOutput` fields (``aux_loss``, ``aux``) from the encoder's output."""
        return {}

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Optional[Array] = None,
        token_type_ids: Optional[Array] = None,
        graph: Optional[jraph.GraphsTuple] = None,
        token_node: Optional[Array] = None,
        deterministic: bool = True,
        extras: Optional[dict] = None,
    ) -> VariantOutput:
        hooks = self.hooks(input_ids, graph, token_node, deterministic, extras)
        out = self.encoder(input_ids, attention_mask, token_type_ids, hooks, deterministic)
        logits = apply_head(self.head, self.task, out.hidden, deterministic)
        return VariantOutput(logits=logits, hidden=out.hidden, **self.outputs(out, graph, token_node))


# ----------------------------------------------------------------------------------------------
# entities


def node_entities(graph: jraph.GraphsTuple) -> Array:
    """Entity id of every node [N] (0 = null / padding)."""
    return graph.nodes["entity"]


def lookup(memory: Array, entity: Array) -> Array:
    """memory [Ne, De], entity ids [...] -> [..., De]; the null entity 0 maps to zero. Gathered by
    :func:`take_rows` (a bf16 memory's gradient accumulates in fp32)."""
    return take_rows(memory, entity) * (entity != 0)[..., None].astype(memory.dtype)


def tokens_from_nodes(node_values: Array, token_node: Array, node_ok: Optional[Array] = None) -> Array:
    """node_values [N, F], token_node [B, T] -> [B, T, F]; zero outside mentions and (with
    ``node_ok`` [N] bool) at tokens whose node is not ok."""
    picked = take_rows(node_values, jnp.maximum(token_node, 0))
    keep = token_node >= 0
    if node_ok is not None:
        keep = keep & node_ok[jnp.maximum(token_node, 0)]
    return picked * keep[..., None].astype(node_values.dtype)


def token_entities(graph: jraph.GraphsTuple, token_node: Array) -> Array:
    """Entity id of the mention at every token [B, T] (0 outside mentions / null)."""
    ent = jnp.asarray(node_entities(graph))[jnp.maximum(token_node, 0)]
    return jnp.where(token_node >= 0, ent, 0)


def first_mention_tokens(token_node: Array) -> Array:
    """bool [B, T]: the first token of every mention run (where an entity is "aligned")."""
    prev = jnp.pad(token_node[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return (token_node >= 0) & (token_node != prev)


def mention_pool(h: Array, token_node: Array, num_nodes: int) -> Array:
    """Mean of h [B, T, F] over each token's mention (the tokens pointing at its graph node),
    at every mention token; zero elsewhere. [B, T, F]."""
    return tokens_from_nodes(node_context(h, token_node, num_nodes), token_node)


def masked_softmax_attention(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """q/k/v [B, T, H, Dh], visible bool [B, T, T] -> [B, T, H, Dh]; rows with nothing visible
    give 0."""
    out = dot_product_attention(
        q[:, :, :, None], k, v, scale=1.0 / math.sqrt(q.shape[-1]), visible=visible[:, None, None]
    )[:, :, :, 0]
    return out * visible.any(-1)[:, :, None, None]
