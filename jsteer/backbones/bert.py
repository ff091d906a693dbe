"""BERT-family encoders (BERT, RoBERTa, XLM-R, CamemBERT) in Flax linen, with jsteer hooks.

Shape letters: B batch, T query tokens, S key tokens, D hidden, N heads, H head dim,
F FFN width, V vocabulary, C the three projections q/k/v, L labels.

Parameter tree (every model, bare or with a head)::

    {"encoder": {"embeddings": {"word": {"embedding": [V, D]}, "position": {"embedding": [P, D]},
                                "token_type": {"embedding": [TV, D]}, "norm": {"scale", "bias"}},
                 "layer_0": {"attention": {"qkv": {"kernel": [D, 3, N, H], "bias": [3, N, H]},
                                           "out": {"kernel": [N, H, D], "bias": [D]}},
                             "attention_norm": {...}, "ffn_in": {"kernel": [D, F], "bias": [F]},
                             "ffn_out": {"kernel": [F, D], "bias": [D]}, "ffn_norm": {...}},
                 ...},
     "head": {...}}   # absent for BertModel

so ``{"encoder": p["encoder"]}`` moves an encoder between heads unchanged.

The encoder owns the one layer loop every BERT-family method runs through, with the named sites
of :mod:`jsteer.interventions` (the decoder's protocol: ``hooks.interventions`` act there and
``capture=("resid_post.3", ...)`` returns activations in ``out.captured``)::

    embed            word-embedding lookup (+ embed_offset), before positions / token types / LN
    resid_pre.i      layer i's input (HF hidden_states[i])
    attn_out.i       attention output after its dropout, as added to the residual
    ffn_in.i         LayerNorm(resid_pre + attn_out): the FFN input and the FFN residual
    ffn_hidden.i     ffn_in dense output [B, T, F], before ``hidden_act``
    ffn_out.i        FFN output after its dropout, as added to the residual
    resid_post.i     LayerNorm(ffn_in + ffn_out): layer i's output (HF hidden_states[i + 1])
    final            the last hidden state the heads read

Methods that need more than one site (KALA's KFM, ERNIE's fusion, EaE's retrieval) share values
between them in ``ctx.state``, returned as :attr:`EncoderOutput.state`.

Hook points (see :mod:`jsteer.hooks`): ``embed_offset`` is added to the word-embedding lookup
before position / token-type embeddings and the embedding LayerNorm (HF's ``inputs_embeds``);
``position_ids`` are raw rows of the position table, in [0, max_position_embeddings) (checked
when concrete; RoBERTa: real tokens start at ``pad_token_id + 1``); ``attn_bias`` [B, T, T] is
added to the scores of every head on top of the padding mask; FiLM ``"in"`` acts on the
attention block output after its LayerNorm (the FFN input and FFN residual), ``"out"`` on the
layer output after the FFN LayerNorm. FiLM keys are 0-based layer indices in range(num_layers).

This module holds the config, the encoder and what it needs (positions, attention bias,
embedding accessors, logical axes); the heads and the models that carry them are in
:mod:`jsteer.backbones.bert_heads`, the HF conversion in :mod:`jsteer.backbones.bert_hf`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jsteer import interventions as iv
from jsteer.backbones.attention import RightPadded, attention
from jsteer.backbones.base import ACTIVATIONS, NEG_INF, Embed, check_position_ids
from jsteer.backbones.dropout import Dropout
from jsteer.backbones.kernel_norm import LayerNorm
from jsteer.backbones.matmul import Linear, pack_kernels
from jsteer.backbones.sites import SiteRunner
from jsteer.hooks import Hooks, check_encoder_hooks, check_film_layers

Array = jnp.ndarray

# HF model_type -> layout. RoBERTa-style models share the RoBERTa key names and position rule.
_LAYOUTS = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta"}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyper-parameters of a BERT-family encoder (names follow HF where unambiguous)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    classifier_dropout: Optional[float] = None  # None: use hidden_dropout (HF rule)
    pad_token_id: int = 0
    layout: str = "bert"  # "bert" | "roberta"
    num_labels: int = 2
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True  # MLM decoder shares the word-embedding matrix
    model_type: str = "bert"  # the HF model_type this came from (informational)

    def __post_init__(self):
        if self.layout not in ("bert", "roberta"):
            raise ValueError(f"BertConfig.layout must be 'bert' or 'roberta', got {self.layout!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"BertConfig.hidden_act {self.hidden_act!r} is not supported; known: {sorted(ACTIVATIONS)}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig.hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_table_size(self) -> int:
        """Rows of the learned position table: valid position ids are 0 .. max_position_embeddings-1."""
        return self.max_position_embeddings

    @property
    def max_input_length(self) -> int:
        """Longest input the default positions fit: max_position_embeddings, less the
        ``pad_token_id + 1`` rows RoBERTa-style models reserve below their first position."""
        if self.layout == "roberta":
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "BertConfig":
        """Build from an HF ``config.json`` dict (model_type bert / roberta / xlm-roberta / camembert)."""
        model_type = config.get("model_type")
        if model_type not in _LAYOUTS:
            raise ValueError(
                f"BertConfig.from_hf: model_type {model_type!r} is not a BERT-family encoder; "
                f"supported: {sorted(_LAYOUTS)}"
            )
        pos_type = config.get("position_embedding_type", "absolute")
        if pos_type not in (None, "absolute"):
            raise ValueError(
                f"BertConfig.from_hf: position_embedding_type {pos_type!r} is not supported (only 'absolute')"
            )
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError("BertConfig.from_hf: decoder / cross-attention BERT configs are not supported")
        act = config.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(f"BertConfig.from_hf: hidden_act {act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        if "num_labels" in config:
            num_labels = int(config["num_labels"])
        elif config.get("id2label"):
            num_labels = len(config["id2label"])
        else:
            num_labels = 2
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"BertConfig.from_hf: config is missing {missing}")
        pad = config.get("pad_token_id")
        layout = _LAYOUTS[model_type]
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            hidden_act=act,
            max_position_embeddings=int(config.get("max_position_embeddings", 512)),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            hidden_dropout=float(config.get("hidden_dropout_prob", 0.1)),
            attention_dropout=float(config.get("attention_probs_dropout_prob", 0.1)),
            classifier_dropout=(
                None if config.get("classifier_dropout") is None else float(config["classifier_dropout"])
            ),
            pad_token_id=int(pad if pad is not None else (1 if layout == "roberta" else 0)),
            layout=layout,
            num_labels=num_labels,
            initializer_range=float(config.get("initializer_range", 0.02)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            model_type=model_type,
        )

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BertConfig":
        """Inverse of :meth:`to_dict` (unknown keys are an error)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"BertConfig.from_dict: unknown fields {unknown}")
        return cls(**d)


# ----------------------------------------------------------------------------- helpers


def default_position_ids(config: BertConfig, input_ids: Array) -> Array:
    """[B, T] position-table rows used when ``hooks.position_ids`` is absent.

    BERT: 0..T-1. RoBERTa (like HF): non-pad tokens count from ``pad_token_id + 1``, pad
    tokens (``input_ids == pad_token_id``) get ``pad_token_id``.
    """
    b, t = input_ids.shape
    if config.layout == "bert":
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    real = (input_ids != config.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + config.pad_token_id


def positions_of(config: BertConfig, input_ids: Array, hooks: Optional[Hooks]) -> Array:
    """Position-table rows [B, T]: ``hooks.position_ids`` (checked) or :func:`default_position_ids`."""
    if hooks is not None and hooks.position_ids is not None:
        position_ids = hooks.position_ids
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"hooks.position_ids must be {input_ids.shape}, got {position_ids.shape}")
        check_position_ids(position_ids, config.position_table_size, "BERT embeddings")
        return position_ids
    return default_position_ids(config, input_ids)


def _check_length(config: BertConfig, t: int, explicit_positions: bool) -> None:
    """Refuse T tokens the position table cannot hold (an out-of-range row gathers NaN).

    Default positions need T <= :attr:`BertConfig.max_input_length` (RoBERTa reserves
    ``pad_token_id + 1`` rows); explicit ``hooks.position_ids`` are checked by value instead.
    """
    c = config
    if t <= (c.max_position_embeddings if explicit_positions else c.max_input_length):
        return
    if c.layout == "roberta" and not explicit_positions:
        raise ValueError(
            f"input length {t} exceeds the {c.max_input_length} tokens this RoBERTa-style model can "
            f"position (max_position_embeddings {c.max_position_embeddings} - pad_token_id "
            f"{c.pad_token_id} - 1: its positions start at pad_token_id + 1)"
        )
    raise ValueError(f"input length {t} exceeds max_position_embeddings {c.max_position_embeddings}")


def attention_bias(attention_mask: Optional[Array], hooks: Optional[Hooks], batch: int, length: int) -> Optional[Array]:
    """Additive attention bias [B, 1, T|1, S] (fp32) from a [B, S] 0/1 mask and ``hooks.attn_bias``.

    None when there is nothing to add. Broadcasts over heads.
    """
    bias = None
    if attention_mask is not None:
        if attention_mask.shape != (batch, length):
            raise ValueError(f"attention_mask must be [{batch}, {length}], got {attention_mask.shape}")
        bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, NEG_INF).astype(jnp.float32)
    if hooks is not None and hooks.attn_bias is not None:
        ab = hooks.attn_bias
        if ab.shape != (batch, length, length):
            raise ValueError(f"hooks.attn_bias must be [{batch}, {length}, {length}], got {ab.shape}")
        ab = ab[:, None, :, :].astype(jnp.float32)
        bias = ab if bias is None else bias + ab
    return bias


def input_embeddings(params: Mapping[str, Any]) -> Array:
    """Word-embedding matrix [V, D] from a model's params (with or without a ``"params"`` level)."""
    if "params" in params and "encoder" not in params:
        params = params["params"]
    return params["encoder"]["embeddings"]["word"]["embedding"]


def output_embeddings(params: Mapping[str, Any], config: BertConfig) -> Array:
    """MLM output matrix [V, D]: the word embeddings when tied, else the head's decoder."""
    if config.tie_word_embeddings:
        return input_embeddings(params)
    if "params" in params and "encoder" not in params:
        params = params["params"]
    return params["head"]["decoder"]["kernel"].T


# Logical axis names of each param by its trailing path (jsteer.sharding maps them to mesh axes).
_AXES = {
    ("word", "embedding"): ("vocab", "embed"),
    ("position", "embedding"): (None, "embed"),
    ("token_type", "embedding"): (None, "embed"),
    ("qkv", "kernel"): ("embed", None, "heads", "head_dim"),
    ("qkv", "bias"): (None, "heads", "head_dim"),
    ("out", "kernel"): ("heads", "head_dim", "embed"),
    ("ffn_in", "kernel"): ("embed", "mlp"),
    ("ffn_in", "bias"): ("mlp",),
    ("ffn_out", "kernel"): ("mlp", "embed"),
    ("transform", "kernel"): ("embed", None),
    ("decoder", "kernel"): ("embed", "vocab"),
    ("head", "bias"): ("vocab",),
    ("classifier", "kernel"): ("embed", None),
    ("qa", "kernel"): ("embed", None),
}


def logical_axes(params) -> Any:
    """The params' pytree with each leaf replaced by its logical axis names (one per dim); other
    vectors (norms, biases of width D or of a head) are ("norm",)."""

    def one(path, leaf):
        names = tuple(getattr(k, "key", str(k)) for k in path)
        ndim = len(leaf.shape)
        axes = _AXES.get(names[-2:], ("norm",) if ndim == 1 else None)
        if axes is None or len(axes) != ndim:
            raise ValueError(f"no logical axes for BERT param {'/'.join(names)} of shape {tuple(leaf.shape)}")
        return axes

    return jax.tree_util.tree_map_with_path(one, params)


def encoder_pack(params: Mapping[str, Any]) -> dict:
    """The "packed" collection ``LM.forward`` passes on CPU: the encoder layers' kernels packed for
    ``cpu.small_gemm`` ([D, 3, N, H] qkv as [D, 3NH], [N, H, D] out as [NH, D]); heads keep XLA's
    products. Its presence also sends attention through ``cpu.block_attention``. Pure; jit-able."""
    return pack_kernels(params, lambda path: 2 if path[-3:-1] == ("attention", "out") else 1, skip=("head",))


def dense_init(config: BertConfig):
    """Kernel initialiser of every dense layer: normal(initializer_range)."""
    return nn.initializers.normal(stddev=config.initializer_range)


def dense(config: BertConfig, dtype, features: Tuple[int, ...], name: str, in_axes: int = 1) -> Linear:
    """An encoder layer's dense map (bias, fp32 params, :func:`dense_init`; packed-kernel aware)."""
    return Linear(features, in_axes=in_axes, use_bias=True, kernel_init=dense_init(config), dtype=dtype, name=name)


def layer_norm(config: BertConfig, name: Optional[str] = None) -> LayerNorm:
    """A LayerNorm with fp32 params and compute (``layer_norm_eps``): flax's, or jsteer's CPU kernel."""
    return LayerNorm(epsilon=config.layer_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32, name=name)


def ln_fp32(module: LayerNorm, x: Array, dtype, kernel: bool = False) -> Array:
    """Apply a LayerNorm in fp32 and cast back to the compute dtype. ``kernel``: by jsteer's CPU kernel
    where it applies (training, and the packed forwards: see BertLayer)."""
    return module(x.astype(jnp.float32), kernel=kernel).astype(dtype)


# ----------------------------------------------------------------------------- modules


class BertEmbeddings(nn.Module):
    """input_ids [B, T] -> LayerNorm(word (+ embed_offset) + position + token_type) [B, T, D]."""

    config: BertConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        init = nn.initializers.normal(stddev=c.initializer_range)
        self.word = Embed(c.vocab_size, c.hidden_size, embedding_init=init, param_dtype=jnp.float32)
        self.position = Embed(c.max_position_embeddings, c.hidden_size, embedding_init=init, param_dtype=jnp.float32)
        self.token_type = Embed(c.type_vocab_size, c.hidden_size, embedding_init=init, param_dtype=jnp.float32)
        self.norm = layer_norm(c)
        self.dropout = Dropout(c.hidden_dropout)

    def __call__(
        self,
        input_ids: Array,
        token_type_ids: Optional[Array] = None,
        hooks: Optional[Hooks] = None,
        deterministic: bool = True,
        site: Optional[SiteRunner] = None,
        kernel: bool = False,
    ) -> Array:
        """``site``: the encoder's site runner (``embed``); None builds one from ``hooks``. ``kernel``:
        the LayerNorm by jsteer's CPU kernel (as in training; the encoder's packed forwards)."""
        position_ids = positions_of(self.config, input_ids, hooks)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        site = site or SiteRunner(hooks, (), position_ids, None, False)
        x = site("embed", None, self.word(input_ids))
        x = x + self.token_type(token_type_ids) + self.position(position_ids)
        x = ln_fp32(self.norm, x, self.dtype, kernel=kernel or not deterministic)
        return self.dropout(x, deterministic=deterministic)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with fused QKV and output projection (no residual / LayerNorm).

    h [B, T, D], bias [B, 1, T|1, S] additive (or None) -> [B, T, D].
    """

    config: BertConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: Array, bias: Optional[Array] = None, deterministic: bool = True) -> Array:
        """``bias``: [B, 1, T|1, S], or (that, RightPadded) when it is the key padding alone."""
        c = self.config
        qkv_proj = dense(c, self.dtype, (3, c.num_heads, c.head_dim), "qkv")
        qkv = qkv_proj(h)  # [B, T, 3, N, H]
        bias, right_padded = bias if isinstance(bias, tuple) else (bias, None)
        drop = Dropout(c.attention_dropout)
        ctx = attention(
            qkv[:, :, 0, :, None],
            qkv[:, :, 1],
            qkv[:, :, 2],
            scale=1.0 / math.sqrt(c.head_dim),
            bias=None if bias is None else bias[:, :, None],
            dropout=drop.hash(deterministic),
            right_padded=right_padded,
            # the "packed" collection (LM.forward's on CPU): jsteer's kernels are on
            cpu_kernel=qkv_proj.has_variable("packed", "kernel"),
            qkv=qkv,
        )[:, :, :, 0]  # [B, T, N, H]
        return dense(c, self.dtype, (c.hidden_size,), "out", in_axes=2)(ctx)


class BertLayer(nn.Module):
    """One post-LN transformer layer: h [B, T, D] -> [B, T, D], through the sites ``resid_pre``,
    ``attn_out``, ``ffn_in``, ``ffn_hidden``, ``ffn_out`` and ``resid_post`` of ``layer_index``.

    ``bias``: additive attention bias [B, 1, T|1, S] (see :func:`attention_bias`). ``site``: the
    encoder's :class:`~jsteer.backbones.sites.SiteRunner`; None (a layer run on its own) builds
    one from ``hooks`` (its FiLM and interventions for ``layer_index``).
    """

    config: BertConfig
    layer_index: int = 0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        h: Array,
        bias: Optional[Array] = None,
        hooks: Optional[Hooks] = None,
        deterministic: bool = True,
        site: Optional[SiteRunner] = None,
    ) -> Array:
        c, i = self.config, self.layer_index
        site = site or SiteRunner(hooks, (), None, None, False)
        drop = Dropout(c.hidden_dropout)
        h = site("resid_pre", i, h.astype(self.dtype))
        a = BertSelfAttention(c, dtype=self.dtype, name="attention")(h, bias, deterministic)
        a = site("attn_out", i, drop(a, deterministic=deterministic))
        # jsteer's CPU kernels: in training (their backward) and in LM.forward's packed forwards
        kernel = not deterministic or "packed" in self.variables
        a = site("ffn_in", i, ln_fp32(layer_norm(c, "attention_norm"), a + h, self.dtype, kernel))
        f = dense(c, self.dtype, (c.intermediate_size,), "ffn_in")(a)
        f = ACTIVATIONS[c.hidden_act](site("ffn_hidden", i, f))
        f = dense(c, self.dtype, (c.hidden_size,), "ffn_out")(f)
        f = site("ffn_out", i, drop(f, deterministic=deterministic))
        return site("resid_post", i, ln_fp32(layer_norm(c, "ffn_norm"), f + a, self.dtype, kernel))


class EncoderOutput(NamedTuple):
    """What :class:`BertEncoder` returns: ``hidden`` the last hidden state [B, T, D] (after the
    ``final`` site), ``hidden_states`` (embeddings, layer 1..L) or None, ``captured`` {site: h}
    for ``capture=`` (None when empty), ``state`` the sites' shared dict (``ctx.state``)."""

    hidden: Array
    hidden_states: Optional[Tuple[Array, ...]] = None
    captured: Optional[dict] = None
    state: Optional[dict] = None


class BertEncoder(nn.Module):
    """Embeddings + ``num_layers`` :class:`BertLayer` s (the tree under ``params["encoder"]``):
    the one layer loop of every BERT-family model and method, with the sites of the module
    docstring. Returns an :class:`EncoderOutput` (``out[0]`` the last hidden state)."""

    config: BertConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.embeddings = BertEmbeddings(self.config, dtype=self.dtype)
        self.layers = [
            BertLayer(self.config, layer_index=i, dtype=self.dtype, name=f"layer_{i}")
            for i in range(self.config.num_layers)
        ]

    def __call__(
        self,
        input_ids: Array,
        attention_mask: Optional[Array] = None,
        token_type_ids: Optional[Array] = None,
        hooks: Optional[Hooks] = None,
        deterministic: bool = True,
        output_hidden_states: bool = False,
        capture: Tuple[str, ...] = (),
    ) -> EncoderOutput:
        c = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        b, t = input_ids.shape
        _check_length(c, t, explicit_positions=hooks is not None and hooks.position_ids is not None)
        check_film_layers(hooks, c.num_layers)
        check_encoder_hooks(hooks)
        capture = iv.check_capture(capture, c.num_layers)
        if hooks is not None:
            iv.check_interventions(hooks.interventions, c.num_layers)
        bias = attention_bias(attention_mask, hooks, b, t)
        if attention_mask is not None and (hooks is None or hooks.attn_bias is None):
            bias = (bias, RightPadded.of(attention_mask, causal=False))  # cuDNN may mask by lengths
        mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        site = SiteRunner(hooks, capture, positions_of(c, input_ids, hooks), mask, False, ffn_width=c.intermediate_size)
        h = self.embeddings(input_ids, token_type_ids, hooks, deterministic, site, kernel="packed" in self.variables)
        states = [h] if output_hidden_states else None
        for layer in self.layers:
            h = layer(h, bias, hooks, deterministic, site)
            if states is not None:
                states.append(h)
        h = site("final", None, h)
        return EncoderOutput(h, None if states is None else tuple(states), site.captured or None, site.state)
