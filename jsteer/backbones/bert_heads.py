"""The heads of the BERT-family encoders and the models that put one on :class:`BertEncoder`.

Shape letters as in :mod:`jsteer.backbones.bert`: B batch, T tokens, D hidden, V vocabulary,
L labels. Every model's params are ``{"encoder": ..., "head": ...}`` (no ``"head"`` for
:class:`BertModel`); every head reads the encoder's last hidden state h [B, T, D] and returns
fp32 logits:

    mlm                   MLMHead                   [B, T, V]  (tied to the word embeddings or not)
    token_classification  TokenClassificationHead   [B, T, L]  (dropout, then a linear layer)
    qa                    QAHead                    [B, T, 2]  (span start / end)

Each model returns a :class:`~jsteer.backbones.base.ModelOutput` (logits, hidden,
hidden_states, captured) and takes the encoder's arguments (hooks, ``capture=``, ...).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jsteer.backbones.base import ACTIVATIONS, ModelOutput
from jsteer.backbones.bert import Array, BertConfig, BertEncoder, dense_init, encoder_pack, layer_norm, ln_fp32
from jsteer.backbones.dropout import Dropout
from jsteer.backbones.matmul import Dense, dot_fp32_out


class MLMHead(nn.Module):
    """h [B, T, D] -> vocabulary logits [B, T, V]: dense + act + LayerNorm, then the decoder.

    BERT uses ``hidden_act`` in the transform; RoBERTa's ``lm_head`` always uses exact GELU.
    The decoder is the word-embedding matrix (passed in) when tied, else its own kernel.
    """

    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: Array, word_embedding: Optional[Array] = None) -> Array:
        c = self.config
        init = dense_init(c)
        x = Dense(c.hidden_size, kernel_init=init, dtype=self.dtype, param_dtype=jnp.float32, name="transform")(h)
        act = ACTIVATIONS["gelu"] if c.layout == "roberta" else ACTIVATIONS[c.hidden_act]
        x = ln_fp32(layer_norm(c, "norm"), act(x), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (c.vocab_size,), jnp.float32)
        if c.tie_word_embeddings:
            if word_embedding is None:
                raise ValueError("MLMHead with tied embeddings needs the word-embedding matrix")
            logits = dot_fp32_out(x, word_embedding.astype(self.dtype), (((2,), (1,)), ((), ())))  # [B,T,V]
        else:
            logits = Dense(
                c.vocab_size,
                use_bias=False,
                kernel_init=init,
                dtype=self.dtype,
                param_dtype=jnp.float32,
                name="decoder",
            )(x)
        return logits.astype(jnp.float32) + bias


class TokenClassificationHead(nn.Module):
    """h [B, T, D] -> dropout -> linear -> [B, T, L]."""

    config: BertConfig
    num_labels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: Array, deterministic: bool = True) -> Array:
        c = self.config
        rate = c.hidden_dropout if c.classifier_dropout is None else c.classifier_dropout
        h = Dropout(rate)(h, deterministic=deterministic)
        return Dense(
            self.num_labels, kernel_init=dense_init(c), dtype=self.dtype, param_dtype=jnp.float32, name="classifier"
        )(h).astype(jnp.float32)


class QAHead(nn.Module):
    """h [B, T, D] -> span logits [B, T, 2] (start, end)."""

    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: Array) -> Array:
        return Dense(2, kernel_init=dense_init(self.config), dtype=self.dtype, param_dtype=jnp.float32, name="qa")(
            h
        ).astype(jnp.float32)


class _EncoderModel(nn.Module):
    """What every model below shares: ``self.encoder`` (a :class:`BertEncoder`, set up by the
    subclass with its head), run once, then :meth:`logits` on its last hidden state [B, T, D].
    Holds no fields, so each subclass keeps its own positional field order."""

    def logits(self, h: Array, deterministic: bool) -> Optional[Array]:
        return None

    def decode_pack(self, params: dict) -> dict:
        """The "packed" collection ``LM.forward`` passes on CPU (:func:`jsteer.backbones.bert.encoder_pack`)."""
        return encoder_pack(params)

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        token_type_ids=None,
        hooks=None,
        deterministic=True,
        output_hidden_states=False,
        capture=(),
    ) -> ModelOutput:
        h, states, captured, _ = self.encoder(
            input_ids, attention_mask, token_type_ids, hooks, deterministic, output_hidden_states, capture
        )
        return ModelOutput(logits=self.logits(h, deterministic), hidden=h, hidden_states=states, captured=captured)


class BertModel(_EncoderModel):
    """Bare encoder: ModelOutput(logits=None, hidden [B, T, D], hidden_states (L+1) when asked)."""

    config: BertConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.encoder = BertEncoder(self.config, dtype=self.dtype)


class BertForMaskedLM(_EncoderModel):
    """Encoder + MLM head: logits [B, T, V] (fp32)."""

    config: BertConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.encoder = BertEncoder(self.config, dtype=self.dtype)
        self.head = MLMHead(self.config, dtype=self.dtype)

    def logits(self, h: Array, deterministic: bool) -> Array:
        emb = self.encoder.embeddings.word.embedding if self.config.tie_word_embeddings else None
        return self.head(h, emb)


class BertForTokenClassification(_EncoderModel):
    """Encoder + token classifier: logits [B, T, num_labels] (fp32). ``num_labels`` None: config's."""

    config: BertConfig
    num_labels: Optional[int] = None
    dtype: Any = jnp.float32

    def setup(self):
        self.encoder = BertEncoder(self.config, dtype=self.dtype)
        n = self.config.num_labels if self.num_labels is None else self.num_labels
        self.head = TokenClassificationHead(self.config, n, dtype=self.dtype)

    def logits(self, h: Array, deterministic: bool) -> Array:
        return self.head(h, deterministic)


class BertForQuestionAnswering(_EncoderModel):
    """Encoder + span head: logits [B, T, 2] (start, end; fp32)."""

    config: BertConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.encoder = BertEncoder(self.config, dtype=self.dtype)
        self.head = QAHead(self.config, dtype=self.dtype)

    def logits(self, h: Array, deterministic: bool) -> Array:
        return self.head(h)


HEADS = (None, "mlm", "token_classification", "qa")


def model_for_head(
    config: BertConfig, head: Optional[str], num_labels: Optional[int] = None, dtype: Any = jnp.float32
) -> nn.Module:
    """The module class matching a ``head`` name (None -> bare :class:`BertModel`)."""
    if head is None:
        return BertModel(config, dtype=dtype)
    if head == "mlm":
        return BertForMaskedLM(config, dtype=dtype)
    if head == "token_classification":
        return BertForTokenClassification(config, num_labels, dtype=dtype)
    if head == "qa":
        return BertForQuestionAnswering(config, dtype=dtype)
    raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")


def init_head(rng: jax.Array, config: BertConfig, head: str, num_labels: Optional[int] = None) -> Dict[str, Any]:
    """Freshly initialised params for ``head`` (the subtree under ``params["head"]``)."""
    h = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
    if head == "mlm":
        emb = jnp.zeros((config.vocab_size, config.hidden_size), jnp.float32)
        return MLMHead(config).init(rng, h, emb)["params"]
    if head == "token_classification":
        n = config.num_labels if num_labels is None else num_labels
        return TokenClassificationHead(config, n).init(rng, h)["params"]
    if head == "qa":
        return QAHead(config).init(rng, h)["params"]
    raise ValueError(f"unknown head {head!r}; expected one of {HEADS[1:]}")
