"""ERNIE (Zhang et al., ACL 2019) as a KALA-harness variant: knowledgeable fusion layers.

As in ERNIE, entities are aligned with tokens: the entity of a mention sits at the mention's
first token, so the entity stream is a sequence e [B, T, De] with a mask ``ent`` [B, T] (first
tokens of mentions of known entities). At each chosen layer l the pretrained BERT layer
becomes an aggregator of the two streams::

    w~ = LayerNorm(w + MH-ATT(w))                     BERT's own attention block     [B,T,D]
    e~ = LayerNorm(e + MH-ATT(e))                     entity self-attention among the
                                                      entity positions (new params)  [B,T,De]
    h_j = act(W_t w~_j + W_e e~_j + b)   where ent_j  information fusion             [B,T,F]
    h_j = act(W_t w~_j + b)              elsewhere    (W_t, b: BERT's ffn_in)
    w_j' = LayerNorm(W_o h_j + w~_j)                  token output (BERT's ffn_out / ffn_norm)
    e_j' = LayerNorm(W_eo h_j + e~_j)    where ent_j  entity output (new)

With ``W_e = 0`` the token stream is exactly the plain BERT layer. It runs as one intervention
at the shared encoder's ``ffn_hidden.l`` site (:class:`ErnieFusion`: W_t w~ + b there, w~ the
``ffn_in.l`` value), the entity stream carried from one fusion layer to the next in
``ctx.state``. Entity states start as the entity memory rows (``params["kala"]["memory"]``,
initialised like KALA's from the backbone's contextual features; ERNIE used TransE vectors) and
flow from one fusion layer to the next (unchanged in between). Null (unknown) entities are not aligned.

Parameters under ``params["kala"]``: ``memory`` [Ne, De] and per fusion layer ``fusion_<l>``
{``entity_attention`` {qkv, out, norm}, ``ent_in`` (W_e [De, F]), ``ent_out`` (W_eo [F, De]),
``ent_out_norm``}.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax.numpy as jnp
import jraph

from jsteer import interventions as iv
from jsteer.backbones.base import ACTIVATIONS, take_rows
from jsteer.kala.model import entity_memory, site_state
from jsteer.kala.variants.common import (
    VariantConfig,
    VariantModel,
    first_mention_tokens,
    masked_softmax_attention,
    token_entities,
)

Array = jnp.ndarray


class EntitySelfAttention(nn.Module):
    """Multi-head self-attention among entity positions + residual + LayerNorm.

    x [B, T, De], visible bool [B, T, T] -> [B, T, De].
    """

    dim: int
    heads: int
    dropout: float = 0.1

    @nn.compact
    def __call__(self, x: Array, visible: Array, deterministic: bool = True) -> Array:
        if self.dim % self.heads:
            raise ValueError(f"ERNIE entity width {self.dim} is not a multiple of entity_heads {self.heads}")
        qkv = nn.DenseGeneral((3, self.heads, self.dim // self.heads), name="qkv")(x)  # [B, T, 3, H, Dh]
        ctx = masked_softmax_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], visible)
        out = nn.DenseGeneral(self.dim, axis=(-2, -1), name="out")(ctx)
        out = nn.Dropout(self.dropout)(out, deterministic=deterministic)
        return nn.LayerNorm(name="norm")(x + out)


class FusionLayer(nn.Module):
    """The entity side of one ERNIE aggregator (the token side is the BERT layer's own)."""

    intermediate: int
    entity_dim: int
    heads: int
    dropout: float = 0.1

    def setup(self):
        self.entity_attention = EntitySelfAttention(self.entity_dim, self.heads, self.dropout)
        self.ent_in = nn.Dense(self.intermediate, use_bias=False, kernel_init=nn.initializers.normal(0.02))
        self.ent_out = nn.Dense(self.entity_dim, kernel_init=nn.initializers.normal(0.02))
        self.ent_out_norm = nn.LayerNorm()
        self.drop = nn.Dropout(self.dropout)

    def attend(self, e: Array, ent: Array, deterministic: bool = True) -> Array:
        """e [B, T, De], ent bool [B, T] -> e~ [B, T, De] (zero where not ent)."""
        visible = ent[:, :, None] & ent[:, None, :]
        return self.entity_attention(e, visible, deterministic) * ent[..., None]

    def fuse(self, e_tilde: Array, ent: Array) -> Array:
        """W_e e~_j at entity positions, zero elsewhere: [B, T, F]."""
        return self.ent_in(e_tilde) * ent[..., None]

    def entity_output(self, f: Array, e_tilde: Array, ent: Array, deterministic: bool = True) -> Array:
        """f [B, T, F] fused hidden h, e~ [B, T, De] -> e' [B, T, De] (zero where not ent)."""
        y = self.drop(self.ent_out(f), deterministic=deterministic)
        return self.ent_out_norm(y + e_tilde) * ent[..., None]


class ErnieKnowledge(nn.Module):
    """Entity memory + one :class:`FusionLayer` per chosen layer (the ``"kala"`` subtree)."""

    cfg: VariantConfig
    hidden_size: int
    intermediate_size: int
    layers: tuple[int, ...]

    def setup(self):
        self.memory, de = entity_memory(self, self.cfg, self.hidden_size)
        self.fusions = {
            l: FusionLayer(self.intermediate_size, de, self.cfg.entity_heads, self.cfg.dropout, name=f"fusion_{l}")
            for l in self.layers
        }

    def initial_entities(self, entity: Array, ent: Array) -> Array:
        """entity ids [B, T], ent mask [B, T] -> memory rows [B, T, De] (zero where not ent)."""
        return take_rows(self.memory, entity) * ent[..., None].astype(self.memory.dtype)


class ErnieFusion(iv.Intervention):
    """At ``ffn_hidden.l``: pre-activation W_t w~ + b -> W_t w~ + b + W_e e~ (at aligned tokens),
    and the entity output e' from the fused hidden act(.) into ``ctx.state["ernie.entities"]``
    (the next fusion layer's input; the first reads ``entities``, the memory rows).
    ``knowledge``: the model's bound :class:`ErnieKnowledge`; ``activation``: BERT's
    ``hidden_act``."""

    knowledge: Any = flax.struct.field(pytree_node=False)
    activation: str = flax.struct.field(pytree_node=False)
    entities: Array = None  # [B, T, De]
    ent: Array = None  # bool [B, T]
    deterministic: bool = flax.struct.field(pytree_node=False, default=True)

    def __call__(self, pre, ctx):
        state = site_state(ctx, "ERNIE")
        fusion = self.knowledge.fusions[ctx.layer]
        e_tilde = fusion.attend(state.get("ernie.entities", self.entities), self.ent, self.deterministic)
        pre = pre + fusion.fuse(e_tilde, self.ent).astype(pre.dtype)
        state["ernie.entities"] = fusion.entity_output(
            ACTIVATIONS[self.activation](pre), e_tilde, self.ent, self.deterministic
        )
        return pre


class ErnieModel(VariantModel):
    """BERT + ERNIE fusion at ``kala.knowledge_layers`` + task head (see the module docstring)."""

    method = "ernie"

    def setup_knowledge(self):
        self.knowledge = ErnieKnowledge(
            self.kala, self.config.hidden_size, self.config.intermediate_size, self.knowledge_layers, name="kala"
        )

    def interventions(self, graph: jraph.GraphsTuple, token_node: Array, deterministic: bool) -> dict:
        entity = token_entities(graph, token_node)
        ent = first_mention_tokens(token_node) & (entity != 0)
        fusion = ErnieFusion(
            self.knowledge, self.config.hidden_act, self.knowledge.initial_entities(entity, ent), ent, deterministic
        )
        return {f"ffn_hidden.{l}": fusion for l in self.knowledge_layers}
