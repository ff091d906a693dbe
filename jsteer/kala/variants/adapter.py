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
Parameters under ``params["kala"]``: ``memory`` [Ne, De] and ``adapter_<l>``
{``down`` [D + De, adapter_size], ``up`` [adapter_size, D]}.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp
import jraph

from jsteer.kala.variants.common import (
    VariantConfig,
    VariantModel,
    VariantOutput,
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
        de = self.cfg.entity_dim or self.hidden_size
        self.memory = self.param("memory", nn.initializers.normal(0.02), (self.cfg.num_entities, de))
        self.adapters = {
            l: KnowledgeAdapter(self.hidden_size, self.cfg.adapter_size, name=f"adapter_{l}") for l in self.layers
        }

    def token_entities(self, graph: jraph.GraphsTuple, token_node: Array) -> Array:
        """[B, T, De] entity representation per token (zero off mentions / null)."""
        return tokens_from_nodes(lookup(self.memory, node_entities(graph)), token_node)

    def __call__(self, layer: int, y: Array, entity: Array) -> Array:
        return self.adapters[layer](y, entity)


class AdapterModel(VariantModel):
    """BERT + knowledge adapters at ``kala.knowledge_layers`` + task head."""

    method = "adapter"

    def setup_knowledge(self):
        self.knowledge = AdapterKnowledge(self.kala, self.config.hidden_size, self.knowledge_layers, name="kala")

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
        bias, h = self.begin(input_ids, attention_mask, token_type_ids, graph, token_node, deterministic)
        entity = self.knowledge.token_entities(graph, token_node)
        for i, layer in enumerate(self.encoder.layers):
            if i not in self.knowledge_layers:
                h = layer(h, bias, None, deterministic)
                continue
            a = layer.attention_block(h, bias, deterministic)
            y = layer.ffn_output(layer.intermediate(a), deterministic)
            h = layer.finish(self.knowledge(i, y, entity), a)
        return self.output(h, deterministic)
