"""Knowledge adapter as a KALA-harness variant: a bottleneck adapter after the FFN that reads
the token's entity.

In each chosen layer l (default: KALA's layers), between the FFN and its residual LayerNorm
(Houlsby et al.'s position)::

    y_t  = ffn_out(act(ffn_in(a_t)))                     the layer's FFN output      [D]
    y_t <- y_t + W_up act(W_down [y_t ; e_t] + b_down) + b_up                        [D]
    out  = LayerNorm(y_t + a_t)

with e_t the memory row of the entity mentioned at token t (zero outside mentions and for the
null entity) and ``W_up`` zero-initialised, so training starts from the plain layer. Every
token passes through the adapter (its entity part is zero off mentions), as adapters do.
It runs as an intervention at the shared encoder's ``ffn_out.l`` site (:class:`AdapterSite`).
Parameters under ``params["kala"]``: ``memory`` [Ne, De] and ``adapter_<l>``
{``down`` [D + De, adapter_size], ``up`` [adapter_size, D]}.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax.numpy as jnp
import jraph

from jsteer import interventions as iv
from jsteer.kala.model import entity_memory
from jsteer.kala.variants.common import (
    VariantConfig,
    VariantModel,
    lookup,
    node_entities,
    tokens_from_nodes,
)

Array = jnp.ndarray


class KnowledgeAdapter(nn.Module):
    """[y ; e] [..., D + De] -> y + up(gelu(down([y ; e]))) [..., D]."""

    hidden: int
    size: int

    @nn.compact
    def __call__(self, y: Array, entity: Array) -> Array:
        x = jnp.concatenate([y, entity.astype(y.dtype)], axis=-1)
        x = nn.gelu(nn.Dense(self.size, kernel_init=nn.initializers.normal(0.02), name="down")(x))
        return y + nn.Dense(self.hidden, kernel_init=nn.initializers.zeros, name="up")(x)


class AdapterKnowledge(nn.Module):
    cfg: VariantConfig
    hidden_size: int
    layers: tuple[int, ...]

    def setup(self):
        self.memory, de = entity_memory(self, self.cfg, self.hidden_size)
        self.adapters = {
            l: KnowledgeAdapter(self.hidden_size, self.cfg.adapter_size, name=f"adapter_{l}") for l in self.layers
        }

    def token_entities(self, graph: jraph.GraphsTuple, token_node: Array) -> Array:
        """[B, T, De] entity representation per token (zero off mentions / null)."""
        return tokens_from_nodes(lookup(self.memory, node_entities(graph)), token_node)

    def __call__(self, layer: int, y: Array, entity: Array) -> Array:
        return self.adapters[layer](y, entity)


class AdapterSite(iv.Intervention):
    """At ``ffn_out.l``: y -> y + up(gelu(down([y ; e]))). ``knowledge``: the model's bound
    :class:`AdapterKnowledge`; ``entity`` [B, T, De] the token entities."""

    knowledge: Any = flax.struct.field(pytree_node=False)
    entity: Array = None

    def __call__(self, y, ctx):
        return self.knowledge(ctx.layer, y, self.entity).astype(y.dtype)


class AdapterModel(VariantModel):
    """BERT + knowledge adapters at ``kala.knowledge_layers`` + task head."""

    method = "adapter"

    def setup_knowledge(self):
        self.knowledge = AdapterKnowledge(self.kala, self.config.hidden_size, self.knowledge_layers, name="kala")

    def interventions(self, graph: jraph.GraphsTuple, token_node: Array, deterministic: bool) -> dict:
        site = AdapterSite(self.knowledge, self.knowledge.token_entities(graph, token_node))
        return {f"ffn_out.{l}": site for l in self.knowledge_layers}
