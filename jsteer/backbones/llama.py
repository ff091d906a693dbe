"""LLaMA-family decoder (LLaMA 1-3, SmolLM, Mistral, Qwen2) in Flax linen.

Pre-LN blocks: RMSNorm -> GQA self-attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP
-> residual; final RMSNorm; tied or untied output embedding.

Call (shapes: B batch, T new tokens, S cache slots, D hidden, V vocab)::

    out = LlamaForCausalLM(config).apply(
        {"params": p}, input_ids [B,T], attention_mask=[B,T] | None, hooks=Hooks | None,
        cache=KVCache | None, output_hidden_states=False, step=False, last_logits_only=False)

Two keywords beyond the shared decoder protocol, used by :func:`jsteer.decode.generate`
(every decoder backbone must accept them with the same meaning):

- ``step=True``: the tokens are *generated* tokens, so ``hooks.step_offset`` [B,D] is added to
  their embeddings (:func:`jsteer.hooks.apply_step_embed`) instead of ``hooks.embed_offset``.
- ``last_logits_only=True``: compute logits for the last position only ([B,1,V]); saves the
  [B,T,V] output projection during prefill.

Hook points: ``embed_offset`` after the token lookup; FiLM ``in`` on the post-attention
RMSNorm output (the MLP input) and ``out`` on the residual stream after the MLP add;
``attn_bias`` [B,T,T] added to the scores of the T new tokens against themselves (without a
cache that is the whole score matrix; with a cache, earlier slots get no bias);
``position_ids`` [B,T] replace the default positions (with a cache, the next position becomes
one past the largest real one); ``steer`` transforms the final-norm
output before the output embedding (``ModelOutput.hidden`` stays unsteered).

Param tree: ``embed`` (``embedding`` [V,D]), ``layers_{i}`` (``input_layernorm``,
``self_attn`` {q,k,v,o}_proj, ``post_attention_layernorm``, ``mlp`` {gate,up,down}_proj; Dense
kernels are [in, out]), ``norm``, ``lm_head`` (``kernel`` [D,V], only when untied).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsteer.backbones.attention import dot_product_attention
from jsteer.backbones.base import (Embed, KVCache, ModelOutput, attention_slots, default_positions, eos_ids,
                                   next_positions)
from jsteer.backbones.matmul import PackedDense, attend, pack_decoder_params
from jsteer.hooks import Hooks, apply_embed, apply_film, apply_steer, apply_steer_logits, apply_step_embed, check_film_layers

Array = jnp.ndarray

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` "linear" (positions / factor) or "llama3"
    (Llama 3.1 wavelength-dependent scaling)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf(self) -> dict:
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True; LLaMA attention_bias=True sets both qkv and o
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: Optional[int] = None  # Mistral: a query sees the last `sliding_window` keys
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, Tuple[int, ...], None] = None
    pad_token_id: Optional[int] = None
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        """eos ids as a tuple (HF configs store one id or a list)."""
        return eos_ids(self.eos_token_id)

    @property
    def position_table_size(self) -> None:
        """None: RoPE positions index no table (any position id is valid)."""
        return None

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Build from an HF ``config.json`` dict (model_type llama, mistral or qwen2)."""
        model_type = d.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"LlamaConfig.from_hf: model_type {model_type!r} is not supported "
                             f"(expected one of {sorted(_ARCHITECTURES)})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"LlamaConfig.from_hf: hidden_act {act!r} is not supported (only 'silu')")

        def need(key):
            if key not in d:
                raise ValueError(f"LlamaConfig.from_hf: {model_type} config lacks field {key!r}")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = d.get("head_dim") or hidden // heads
        kv_heads = d.get("num_key_value_heads") or heads

        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("LlamaConfig.from_hf: partial_rotary_factor != 1 is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type == "linear":
            scaling = RopeScaling("linear", float(rope["factor"]))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                "llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        else:
            raise ValueError(f"LlamaConfig.from_hf: rope type {rope_type!r} is not supported "
                             "(supported: default, linear, llama3)")

        if model_type == "qwen2":
            if d.get("use_sliding_window", False):
                raise ValueError("LlamaConfig.from_hf: qwen2 use_sliding_window=True is not supported")
            qkv_bias, o_bias, window = True, False, None
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            window = d.get("sliding_window") if model_type == "mistral" else None
        eos = d.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = tuple(int(e) for e in eos)
        return cls(
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=int(kv_heads),
            head_dim=int(head_dim), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta), rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=None if window is None else int(window),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
            model_type=model_type)

    def to_dict(self) -> dict:
        """HF-style ``config.json`` dict; ``LlamaConfig.from_hf(c.to_dict()) == c``."""
        d = {
            "model_type": self.model_type, "architectures": [_ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        return d

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """Empty KV cache with ``max_len`` slots: k [B, H_kv, Dh, S], v [B, H_kv, S, Dh] per layer."""
        return KVCache.init(self.num_layers, batch, max_len, self.num_kv_heads, self.head_dim, dtype)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [Dh/2] (float32, HF's formula incl. scaling)."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        inv = inv.astype(np.float32)
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return (inv / s.factor).astype(np.float32)
        low_wl = s.original_max_position_embeddings / s.low_freq_factor
        high_wl = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    """y = scale * x / sqrt(mean(x^2) + eps), normalised in float32 (as HF does)."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * y.astype(self.dtype)


def rope_cos_sin(positions: Array, inv_freq: np.ndarray) -> Tuple[Array, Array]:
    """positions [B,T] -> cos, sin [B,T,Dh] (HF layout: the Dh/2 frequencies repeated twice)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B,T,N,Dh] rotated with HF's rotate_half convention: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def _dense(features: int, bias: bool, name: str, dtype, param_dtype) -> nn.Dense:
    return PackedDense(features, use_bias=bias, dtype=dtype, param_dtype=param_dtype, name=name,
                       kernel_init=nn.initializers.normal(0.02))


class LlamaAttention(nn.Module):
    """GQA self-attention: H query heads share H_kv key/value heads in groups of G = H/H_kv."""

    config: LlamaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, cos: Array, sin: Array, visible: Array, bias: Optional[Array],
                 kv: Optional[Tuple[Array, Array]], index: Optional[Array]):
        """x [B,T,D]; visible [B,T,S] bool; bias [B,T,S] or None; kv: one layer's cached
        (k, v) in :class:`KVCache`'s layout, written at slot ``index``, or None (then S = T).
        Returns (out [B,T,D], (k, v) after the write or None)."""
        c = self.config
        b, t, _ = x.shape
        n, k_heads, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q = _dense(n * hd, c.qkv_bias, "q_proj", self.dtype, self.param_dtype)(x).reshape(b, t, n, hd)
        k = _dense(k_heads * hd, c.qkv_bias, "k_proj", self.dtype, self.param_dtype)(x).reshape(b, t, k_heads, hd)
        v = _dense(k_heads * hd, c.qkv_bias, "v_proj", self.dtype, self.param_dtype)(x).reshape(b, t, k_heads, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = None
        if kv is not None:
            k, v = new_kv = KVCache.write(*kv, k, v, index)
        out = dot_product_attention(q.reshape(b, t, k_heads, n // k_heads, hd), k, v.astype(self.dtype),
                                    scale=1.0 / math.sqrt(hd), visible=visible[:, None, None],
                                    bias=None if bias is None else bias[:, None, None].astype(jnp.float32),
                                    cache_layout=kv is not None)
        out = out.reshape(b, t, n * hd)
        return _dense(c.hidden_size, c.o_bias, "o_proj", self.dtype, self.param_dtype)(out), new_kv


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: LlamaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c = self.config
        gate = _dense(c.intermediate_size, c.mlp_bias, "gate_proj", self.dtype, self.param_dtype)(x)
        up = _dense(c.intermediate_size, c.mlp_bias, "up_proj", self.dtype, self.param_dtype)(x)
        return _dense(c.hidden_size, c.mlp_bias, "down_proj", self.dtype, self.param_dtype)(nn.silu(gate) * up)


class LlamaBlock(nn.Module):
    config: LlamaConfig
    layer: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, visible, bias, kv, index, hooks: Optional[Hooks]):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = RMSNorm(c.rms_norm_eps, name="input_layernorm", **kw)(x)
        a, new_kv = LlamaAttention(c, name="self_attn", **kw)(h, cos, sin, visible, bias, kv, index)
        x = x + a
        h = RMSNorm(c.rms_norm_eps, name="post_attention_layernorm", **kw)(x)
        h = apply_film(h, hooks, self.layer, "in")
        x = x + LlamaMLP(c, name="mlp", **kw)(h)
        return apply_film(x, hooks, self.layer, "out"), new_kv


class LlamaForCausalLM(nn.Module):
    """LLaMA-family causal LM returning :class:`ModelOutput` (see the module docstring).

    ``dtype`` is the activation dtype (attention softmax and norms stay float32; logits are
    returned as float32); ``param_dtype`` the dtype of freshly initialised params.
    """

    config: LlamaConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def decode_pack(self, params: dict) -> dict:
        """The "packed" collection :func:`jsteer.decode.generate` passes on CPU (see
        :func:`jsteer.backbones.matmul.pack_decoder_params`)."""
        return pack_decoder_params(params, "embed" if self.config.tie_word_embeddings else None)

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Optional[Array] = None,
                 hooks: Optional[Hooks] = None, cache: Optional[KVCache] = None,
                 output_hidden_states: bool = False, step: bool = False,
                 last_logits_only: bool = False) -> ModelOutput:
        c = self.config
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}, input_ids {input_ids.shape}")
        mask = attention_mask.astype(jnp.int32)
        check_film_layers(hooks, c.num_layers)

        embed = Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                      embedding_init=nn.initializers.normal(0.02), name="embed")
        x = embed(input_ids)
        x = apply_step_embed(x, hooks) if step else apply_embed(x, hooks)

        if hooks is not None and hooks.position_ids is not None:
            positions = hooks.position_ids
        else:
            positions = default_positions(mask, cache)
        cos, sin = rope_cos_sin(positions, c.inv_freq())

        index, key_mask, q_slot, k_slot, bias = attention_slots(
            mask, None if hooks is None else hooks.attn_bias, cache)
        causal = k_slot[None, :] <= q_slot[:, None]
        if c.sliding_window is not None:
            causal &= q_slot[:, None] - k_slot[None, :] < c.sliding_window
        visible = causal[None] & (key_mask[:, None, :] > 0)

        hidden_states = [x] if output_hidden_states else None
        new_k, new_v = [], []
        for i in range(c.num_layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, new_kv = LlamaBlock(c, i, dtype=self.dtype, param_dtype=self.param_dtype,
                                   name=f"layers_{i}")(x, cos, sin, visible, bias, kv, index, hooks)
            if new_kv is not None:
                new_k.append(new_kv[0])
                new_v.append(new_kv[1])
            if output_hidden_states:
                hidden_states.append(x)
        hidden = RMSNorm(c.rms_norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name="norm")(x)

        h = hidden[:, -1:] if last_logits_only else hidden
        h = apply_steer(h, hooks)
        if c.tie_word_embeddings:
            logits = attend(self, embed, h)
        else:
            logits = PackedDense(c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                                 kernel_init=nn.initializers.normal(0.02), name="lm_head")(h)

        new_cache = None
        if cache is not None:
            new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), mask=key_mask, index=index + t,
                                pos=next_positions(cache, mask, positions))
        logits = apply_steer_logits(logits.astype(jnp.float32), hooks)
        return ModelOutput(logits=logits, hidden=hidden,
                           hidden_states=None if hidden_states is None else tuple(hidden_states),
                           cache=new_cache)


# ----------------------------------------------------------------------------------------------
# Params


def input_embeddings(params) -> Array:
    """Token-embedding matrix [V, D]."""
    return params["embed"]["embedding"]


def output_embeddings(params, config: LlamaConfig) -> Array:
    """Output-embedding matrix E [V, D] (logits = h E^T): the input embedding when tied."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"]
    return params["lm_head"]["kernel"].T


def _hf_layout(config: LlamaConfig) -> dict:
    """{hf_name: (path in our param tree, HF shape, transpose?)}."""
    c = config
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": (("embed", "embedding"), (c.vocab_size, d), False),
           "model.norm.weight": (("norm", "scale"), (d,), False)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head", "kernel"), (c.vocab_size, d), True)
    for i in range(c.num_layers):
        hf, me = f"model.layers.{i}.", f"layers_{i}"
        out[hf + "input_layernorm.weight"] = ((me, "input_layernorm", "scale"), (d,), False)
        out[hf + "post_attention_layernorm.weight"] = ((me, "post_attention_layernorm", "scale"), (d,), False)
        for name, (o, bias) in {"q_proj": (q, c.qkv_bias), "k_proj": (kv, c.qkv_bias),
                                "v_proj": (kv, c.qkv_bias), "o_proj": (d, c.o_bias)}.items():
            i_dim = q if name == "o_proj" else d
            out[hf + f"self_attn.{name}.weight"] = ((me, "self_attn", name, "kernel"), (o, i_dim), True)
            if bias:
                out[hf + f"self_attn.{name}.bias"] = ((me, "self_attn", name, "bias"), (o,), False)
        for name, (o, i_dim) in {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}.items():
            out[hf + f"mlp.{name}.weight"] = ((me, "mlp", name, "kernel"), (o, i_dim), True)
            if c.mlp_bias:
                out[hf + f"mlp.{name}.bias"] = ((me, "mlp", name, "bias"), (o,), False)
    return out


def params_from_hf(state_dict: Mapping[str, Any], config: LlamaConfig, dtype=jnp.float32) -> dict:
    """HF ``LlamaForCausalLM`` state dict ({name: [out, in] array}) -> our param tree.

    Accepts names with or without the ``model.`` prefix. Raises KeyError for a missing tensor
    and ValueError for a wrong shape or an unexpected tensor (usually a config mismatch).
    """
    sd = dict(state_dict)
    if "model.embed_tokens.weight" not in sd and "embed_tokens.weight" in sd:
        sd = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in sd.items()}
    layout = _hf_layout(config)
    params: dict = {}
    for name, (path, shape, transpose) in layout.items():
        if name not in sd:
            raise KeyError(f"params_from_hf: missing tensor {name!r} (expected shape {shape})")
        w = np.asarray(sd[name], dtype=np.float32)
        if w.shape != shape:
            raise ValueError(f"params_from_hf: tensor {name!r} has shape {w.shape}, expected {shape}")
        node = params
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jnp.asarray(w.T if transpose else w, dtype=dtype)
    ignored = ("rotary_emb.inv_freq", "lm_head.weight")
    extra = sorted(k for k in sd if k not in layout and not k.endswith(ignored))
    if extra:
        raise ValueError(f"params_from_hf: {len(extra)} unexpected tensors for this config, e.g. "
                         f"{extra[:5]} (num_layers={config.num_layers}, qkv_bias={config.qkv_bias})")
    return params
