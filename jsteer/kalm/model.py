"""KALM on a jsteer decoder backbone, and the plain-LM baseline on the same backbone.

    model = KalmLM(llama_config, KalmConfig(num_types=8, type_as_input=True), num_pairs=vocab.num_pairs)
    out = model.apply({"params": p}, input_ids [B,T], attention_mask [B,T], typed_vocab)
        -> KalmOutput  (position t describes the token at t + 1)

Parameter tree: ``{"backbone": Decoder tree, "head": KalmHead tree, ["type_in":
Dense Dt -> D]}``; the general vocabulary's output embedding is the backbone's own.

"Type as input": in KALM's LSTM the expected type embedding of the previous step,
``sum_j P(type_t = j | c_<t) t_j`` (the predicted type of the current input word), is fed in
with the word. A transformer computes every position at once, so this is done in two passes
with shared weights: pass 1 (no type input) predicts the type distributions; their expected
embeddings, projected to D (``type_in``, zero-initialised) and shifted one step right, are
added to the input embeddings of pass 2 through ``Hooks(embed_offset=...)``; pass 2 gives the
output (type distribution and word distributions). Position 0 gets no type input.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.hooks import Hooks
from jsteer.kalm.head import KalmConfig, KalmHead, KalmOutput, TypedVocab, token_log_prob

Array = jnp.ndarray


class KalmLM(nn.Module):
    backbone_config: DecoderConfig
    kalm: KalmConfig
    num_pairs: int
    dtype: Any = jnp.float32

    def setup(self):
        d = self.backbone_config.hidden_size
        self.backbone = Decoder(self.backbone_config, dtype=self.dtype)
        self.head = KalmHead(self.kalm, self.num_pairs, d)
        if self.kalm.type_as_input:
            self.type_in = nn.Dense(d, use_bias=False, kernel_init=nn.initializers.zeros)

    def type_offsets(self, type_logp: Array) -> Array:
        """Pass-1 type distributions [B, T, K+1] -> input offsets [B, T, D] (shifted right)."""
        e = self.type_in(self.head.expected_embedding(type_logp))
        return jnp.pad(e[:, :-1], ((0, 0), (1, 0), (0, 0)))

    def __call__(self, input_ids: Array, attention_mask: Array, vocab: TypedVocab) -> KalmOutput:
        out = self.backbone(input_ids, attention_mask)
        k = self.head(out.hidden, out.logits, vocab)
        if not self.kalm.type_as_input:
            return k
        out = self.backbone(input_ids, attention_mask, hooks=Hooks(embed_offset=self.type_offsets(k.type_logp)))
        return self.head(out.hidden, out.logits, vocab)


def next_token_log_probs(model, params, input_ids: Array, attention_mask: Array, vocab: TypedVocab) -> Array:
    """log P(x_{t+1} | x_<=t) [B, T-1] for a :class:`KalmLM` or a plain :class:`~jsteer.backbones.decoder.Decoder`."""
    targets = input_ids[:, 1:]
    if isinstance(model, KalmLM):
        out = model.apply({"params": params}, input_ids, attention_mask, vocab)
        cut = KalmOutput(out.type_logp[:, :-1], out.general_logp[:, :-1], out.typed_logp[:, :-1])
        return token_log_prob(cut, vocab, targets)
    logits = model.apply({"params": params}, input_ids, attention_mask).logits[:, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), targets[..., None], -1)[..., 0]
