"""Entities as Experts (Févry et al., EMNLP 2020) as a KALA-harness variant.

After each chosen layer l (default: after a third of the depth, as the paper's layer 4 of 12),
every mention m (the tokens pointing at one node of the harness graph) reads the entity memory
E [Ne, De] (``params["kala"]["memory"]``)::

    q_m   = W_q mean_{t in m} h_t                       mention-pooled query     [De]
    a_m   = softmax_k(q_m . E_k)   over k = 1..Ne-1     retrieval (null row 0 excluded)
    r_m   = sum_k a_mk E_k                              retrieved entity         [De]
    h_t  <- h_t + MLP(r_m)  for t in m                  added back (other tokens unchanged)

The MLP is Linear-GELU-Linear with the last layer zero-initialised, so training starts from
the plain backbone. Entity linking is supervised with the harness' own links: the auxiliary
loss is the cross-entropy of a_m against the mention's entity id, averaged over mentions of
known (non-null) entities (counted once, at their first token) and weighted by ``el_weight``;
unknown (null) mentions still retrieve, from their context alone. Computed token-aligned
([B, T, Ne] logits), so the cost does not grow with the graph's padded node count.
It runs as an intervention at the shared encoder's ``resid_post.l`` (:class:`EaeRetrieval`), which
leaves its retrieval logits in ``ctx.state`` for the loss. Parameters under ``params["kala"]``:
``memory`` and
``retrieval_<l>`` {``query``, ``mlp_in``, ``mlp_out``}.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import jraph
import optax

from jsteer import interventions as iv
from jsteer.backbones.base import NEG_INF
from jsteer.kala.model import entity_memory, site_state
from jsteer.kala.variants.common import (
    VariantConfig,
    VariantModel,
    first_mention_tokens,
    mention_pool,
    node_entities,
    token_entities,
)

Array = jnp.ndarray


class EntityRetrieval(nn.Module):
    """One EaE memory access (see the module docstring)."""

    hidden: int
    entity_dim: int

    @nn.compact
    def __call__(self, h: Array, token_node: Array, memory: Array, num_nodes: int) -> tuple[Array, Array]:
        """h [B, T, D], token_node [B, T], memory [Ne, De] -> (new h [B, T, D], retrieval
        logits [B, T, Ne] with the null column at NEG_INF; equal over a mention's tokens)."""
        query = nn.Dense(self.entity_dim, kernel_init=nn.initializers.normal(0.02), name="query")(
            mention_pool(h, token_node, num_nodes)
        )
        logits = jnp.einsum("BTD,KD->BTK", query, memory)
        logits = logits.at[..., 0].set(NEG_INF)
        retrieved = jnp.einsum("BTK,KD->BTD", jax.nn.softmax(logits, axis=-1), memory)
        x = nn.gelu(nn.Dense(self.hidden, kernel_init=nn.initializers.normal(0.02), name="mlp_in")(retrieved))
        delta = nn.Dense(self.hidden, kernel_init=nn.initializers.zeros, name="mlp_out")(x)
        return h + delta * (token_node >= 0)[..., None].astype(h.dtype), logits


def entity_linking_loss(logits: Array, gold: Array, use: Array) -> tuple[Array, Array]:
    """Mean cross-entropy of the retrieval at the ``use`` positions.

    logits [..., Ne], gold [...] entity ids, use bool [...] -> (loss [], count [])."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, gold)
    count = jnp.sum(use)
    return jnp.sum(jnp.where(use, ce, 0.0)) / jnp.maximum(count, 1), count


class EaeKnowledge(nn.Module):
    cfg: VariantConfig
    hidden_size: int
    layers: tuple[int, ...]

    def setup(self):
        self.memory, de = entity_memory(self, self.cfg, self.hidden_size)
        self.retrievals = {l: EntityRetrieval(self.hidden_size, de, name=f"retrieval_{l}") for l in self.layers}

    def __call__(self, layer: int, h: Array, token_node: Array, num_nodes: int):
        return self.retrievals[layer](h, token_node, self.memory, num_nodes)


class EaeRetrieval(iv.Intervention):
    """At ``resid_post.l``: h -> h + MLP(retrieved entity) on mention tokens, the retrieval
    logits [B, T, Ne] into ``ctx.state["eae.logits.<l>"]``. ``knowledge``: the model's bound
    :class:`EaeKnowledge`; ``num_nodes``: the batch graph's node count (static)."""

    knowledge: Any = flax.struct.field(pytree_node=False)
    token_node: Array = None
    num_nodes: int = flax.struct.field(pytree_node=False, default=0)

    def __call__(self, h, ctx):
        new_h, logits = self.knowledge(ctx.layer, h, self.token_node, self.num_nodes)
        site_state(ctx, "EaE")[f"eae.logits.{ctx.layer}"] = logits
        return new_h.astype(h.dtype)


class EaeModel(VariantModel):
    """BERT + EaE memory layers + task head; ``aux_loss`` = el_weight * entity-linking loss."""

    method = "eae"

    def setup_knowledge(self):
        self.knowledge = EaeKnowledge(self.kala, self.config.hidden_size, self.knowledge_layers, name="kala")

    def interventions(self, graph: jraph.GraphsTuple, token_node: Array, deterministic: bool) -> dict:
        retrieval = EaeRetrieval(self.knowledge, token_node, node_entities(graph).shape[0])
        return {f"resid_post.{l}": retrieval for l in self.knowledge_layers}

    def outputs(self, out, graph: jraph.GraphsTuple, token_node: Array) -> dict:
        """The entity-linking loss of every memory layer's retrieval (mean) as ``aux_loss``
        (x ``el_weight``), with its accuracy on the first token of each linked mention."""
        gold = token_entities(graph, token_node)
        use = first_mention_tokens(token_node) & (gold != 0)
        losses, accs = [], []
        for l in self.knowledge_layers:
            logits = out.state[f"eae.logits.{l}"]
            loss, count = entity_linking_loss(logits, gold, use)
            losses.append(loss)
            hit = (jnp.argmax(logits, -1) == gold) & use
            accs.append(jnp.sum(hit) / jnp.maximum(count, 1))
        el = sum(losses) / len(losses)
        return {"aux_loss": self.kala.el_weight * el, "aux": {"el_loss": el, "el_accuracy": sum(accs) / len(accs)}}
