"""GPT-2 decoder (Flax linen) with a static-shape KV cache and the jsteer hook points.

Pre-LN blocks, learned absolute positions, fused QKV projection, tied output embedding::

    x = wte[ids] (+ hooks) + wpe[pos]
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(film_in(ln_2(x)));  x = film_out(x)
    hidden = ln_f(x);  logits = steer(hidden) @ wte^T

Param tree (HF Conv1D weights are already [in, out], so kernels are stored untransposed)::

    wte/embedding [V,D]   wpe/embedding [P,D]   ln_f/{scale,bias} [D]
    h_{i}/ln_1, h_{i}/ln_2               {scale,bias} [D]
    h_{i}/attn/c_attn/{kernel [D,3D], bias [3D]}    h_{i}/attn/c_proj/{kernel [D,D], bias}
    h_{i}/mlp/c_fc/{kernel [D,F], bias [F]}         h_{i}/mlp/c_proj/{kernel [F,D], bias}
    lm_head/kernel [D,V]   (only when tie_word_embeddings is False)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jsteer.backbones.attention import dot_product_attention
from jsteer.backbones.base import (ACTIVATIONS, Embed, KVCache, ModelOutput, attention_slots, check_position_ids,
                                   default_positions, eos_ids, next_positions)
from jsteer.backbones.matmul import PackedDense, attend, pack_decoder_params
from jsteer.hooks import Hooks, apply_embed, apply_film, apply_steer, apply_steer_logits, apply_step_embed, check_film_layers

Array = jnp.ndarray

# the activation_function values GPT-2 configs use
_ACTIVATIONS = {name: ACTIVATIONS[name] for name in
                ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu", "relu", "silu", "swish", "quick_gelu")}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int = 3072
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 50256
    eos_token_id: Union[int, Tuple[int, ...], None] = 50256
    pad_token_id: Optional[int] = None
    initializer_range: float = 0.02  # std of random init (module.init); HF's default
    dtype: str = "float32"  # activation dtype; params stay float32, LayerNorm/softmax run in float32

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):  # e.g. to_dict() after a JSON round trip
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.activation_function not in _ACTIVATIONS:
            raise ValueError(f"GPT2Config: unsupported activation_function {self.activation_function!r} "
                             f"(supported: {', '.join(sorted(_ACTIVATIONS))})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        """eos ids as a tuple (HF configs store one id or a list)."""
        return eos_ids(self.eos_token_id)

    @property
    def position_table_size(self) -> int:
        """Rows of the learned position table: valid position ids are 0 .. n_positions-1."""
        return self.n_positions

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "GPT2Config":
        """HF ``config.json`` dict (model_type gpt2) -> GPT2Config."""
        if cfg.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"GPT2Config.from_hf: model_type is {cfg.get('model_type')!r}, expected 'gpt2'")
        for key in ("vocab_size", "n_embd", "n_layer", "n_head"):
            if key not in cfg:
                raise ValueError(f"GPT2Config.from_hf: config.json lacks required field {key!r}")
        if cfg.get("add_cross_attention", False):
            raise ValueError("GPT2Config.from_hf: add_cross_attention=True (encoder-decoder GPT-2) is not supported")
        n_embd = int(cfg["n_embd"])
        n_inner = cfg.get("n_inner")
        eos = cfg.get("eos_token_id", 50256)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            n_positions=int(cfg.get("n_positions", 1024)),
            n_embd=n_embd,
            n_layer=int(cfg["n_layer"]),
            n_head=int(cfg["n_head"]),
            n_inner=int(n_inner) if n_inner is not None else 4 * n_embd,
            activation_function=str(cfg.get("activation_function", "gelu_new")),
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            bos_token_id=cfg.get("bos_token_id", 50256),
            eos_token_id=tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else eos,
            pad_token_id=cfg.get("pad_token_id"),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPT2Config":
        """Inverse of :meth:`to_dict` (unknown keys are an error)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"GPT2Config.from_dict: unknown fields {unknown}")
        return cls(**d)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """Empty KV cache with ``max_len`` slots: k [B, H, Dh, S], v [B, H, S, Dh] per layer.

        Slots may outnumber ``n_positions`` (left padding uses slots, not positions); a real
        token at position >= n_positions has no position embedding and yields NaN logits.
        """
        return KVCache.init(self.n_layer, batch, max_len, self.n_head, self.head_dim, dtype)


def _visibility(key_mask: Array, q_slots: Array, k_slots: Array) -> Array:
    """[B,T,K] bool: query slot t may attend to key slot s (causal and s holds a real token)."""
    return (key_mask[:, None, :] > 0) & (k_slots[None, None, :] <= q_slots[None, :, None])


def _dense(config: GPT2Config, features: int, dtype, name: str, use_bias: bool = True) -> nn.Dense:
    return PackedDense(features, use_bias=use_bias, dtype=dtype, param_dtype=jnp.float32,
                       kernel_init=nn.initializers.normal(config.initializer_range), name=name)


def _layer_norm(config: GPT2Config, x: Array, name: str) -> Array:
    """LayerNorm computed in float32, cast back to x's dtype."""
    ln = nn.LayerNorm(epsilon=config.layer_norm_epsilon, dtype=jnp.float32, param_dtype=jnp.float32, name=name)
    return ln(x.astype(jnp.float32)).astype(x.dtype)


class GPT2Attention(nn.Module):
    config: GPT2Config
    layer_idx: int

    @nn.compact
    def __call__(self, x: Array, visible: Array, bias: Optional[Array],
                 cache_kv: Optional[tuple[Array, Array]], index: Optional[Array]):
        """x [B,T,D]; visible [B,T,K] bool; bias [B,T,K] or None; cache_kv: one layer's
        cached (k, v) in :class:`KVCache`'s layout, written at slot ``index``, or None (then K = T).

        Returns (out [B,T,D], updated cache (k, v), or None without a cache)."""
        cfg = self.config
        b, t, _ = x.shape
        qkv = _dense(cfg, 3 * cfg.n_embd, x.dtype, "c_attn")(x).reshape(b, t, 3, cfg.n_head, cfg.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B,T,N,H]: N heads of size H
        new_kv = None
        if cache_kv is not None:
            k, v = new_kv = KVCache.write(*cache_kv, k, v, index)
            k, v = k.astype(x.dtype), v.astype(x.dtype)
        scale = cfg.head_dim ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(self.layer_idx + 1)
        ctx = dot_product_attention(q[:, :, :, None], k, v, scale=scale, visible=visible[:, None, None],
                                    bias=None if bias is None else bias[:, None, None].astype(jnp.float32),
                                    cache_layout=cache_kv is not None)
        ctx = ctx.reshape(b, t, cfg.n_embd)
        return _dense(cfg, cfg.n_embd, x.dtype, "c_proj")(ctx), new_kv


class GPT2MLP(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """x [B,T,D] -> [B,T,D]."""
        cfg = self.config
        h = _dense(cfg, cfg.n_inner, x.dtype, "c_fc")(x)
        h = _ACTIVATIONS[cfg.activation_function](h)
        return _dense(cfg, cfg.n_embd, x.dtype, "c_proj")(h)


class GPT2Block(nn.Module):
    config: GPT2Config
    layer_idx: int

    @nn.compact
    def __call__(self, x, visible, bias, cache_kv, index, hooks: Optional[Hooks]):
        """x [B,T,D] -> ([B,T,D], updated (k, v) or None)."""
        cfg = self.config
        h = _layer_norm(cfg, x, "ln_1")
        a, new_kv = GPT2Attention(cfg, self.layer_idx, name="attn")(h, visible, bias, cache_kv, index)
        x = x + a
        h = _layer_norm(cfg, x, "ln_2")
        h = apply_film(h, hooks, self.layer_idx, "in")
        x = x + GPT2MLP(cfg, name="mlp")(h)
        x = apply_film(x, hooks, self.layer_idx, "out")
        return x, new_kv


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its (tied) LM head; see :mod:`jsteer.backbones.base` for the call protocol.

    The activation dtype is ``config.dtype`` (LayerNorm and softmax run in float32, logits are
    returned as float32; params are float32 unless cast).
    """

    config: GPT2Config

    @property
    def dtype(self):
        """Activation dtype (also the KV-cache dtype :func:`jsteer.decode.generate` allocates)."""
        return jnp.dtype(self.config.dtype)

    def decode_pack(self, params: dict) -> dict:
        """The "packed" collection :func:`jsteer.decode.generate` passes on CPU (see
        :func:`jsteer.backbones.matmul.pack_decoder_params`)."""
        return pack_decoder_params(params, "wte" if self.config.tie_word_embeddings else None)

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Optional[Array] = None,
                 hooks: Optional[Hooks] = None, cache: Optional[KVCache] = None,
                 output_hidden_states: bool = False, step: bool = False,
                 last_logits_only: bool = False) -> ModelOutput:
        """input_ids [B,T] int; attention_mask [B,T] (1 real, 0 pad; rows left-padded).

        Hooks as in :mod:`jsteer.backbones.llama`: ``embed_offset`` is added to the token
        embedding (before the position embedding); with ``step=True`` (generated tokens)
        ``step_offset`` is added instead. ``position_ids`` [B,T] replace the default positions
        (values in [0, n_positions), checked when concrete; with a cache the next position
        becomes one past the largest real one, as in LLaMA).
        ``attn_bias`` [B,T,T] is added to the scores of the T new tokens against themselves
        (with a cache, earlier slots get no bias). FiLM ``in`` acts on the ln_2 output (MLP
        input), ``out`` on the residual stream after the MLP add. ``steer`` transforms the ln_f
        output before the output embedding. ``last_logits_only``: logits [B,1,V] of the last
        position only.

        Returns ModelOutput(logits [B,T,V] float32, hidden [B,T,D] = ln_f output (unsteered),
        hidden_states (embeddings + each block's output, L+1 x [B,T,D]) when asked, cache).
        """
        cfg = self.config
        dtype = self.dtype
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}, input_ids {input_ids.shape}")
        if cache is None and t > cfg.n_positions:
            raise ValueError(f"input length {t} exceeds GPT-2's n_positions {cfg.n_positions} (learned positions)")
        mask = attention_mask.astype(jnp.int32)
        check_film_layers(hooks, cfg.n_layer)
        init = nn.initializers.normal(cfg.initializer_range)
        wte = Embed(cfg.vocab_size, cfg.n_embd, dtype=dtype, param_dtype=jnp.float32,
                    embedding_init=init, name="wte")
        wpe = Embed(cfg.n_positions, cfg.n_embd, dtype=dtype, param_dtype=jnp.float32,
                    embedding_init=init, name="wpe")

        x = wte(input_ids)
        x = apply_step_embed(x, hooks) if step else apply_embed(x, hooks)
        if hooks is not None and hooks.position_ids is not None:
            positions = hooks.position_ids
            check_position_ids(positions, cfg.n_positions, "GPT-2")
        else:
            positions = default_positions(mask, cache)
        x = x + wpe(positions)

        index, key_mask, q_slots, k_slots, bias = attention_slots(
            mask, None if hooks is None else hooks.attn_bias, cache)
        visible = _visibility(key_mask, q_slots, k_slots)

        hidden_states = [x] if output_hidden_states else None
        new_k, new_v = [], []
        for i in range(cfg.n_layer):
            cache_kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = GPT2Block(cfg, i, name=f"h_{i}")(x, visible, bias, cache_kv, index, hooks)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if output_hidden_states:
                hidden_states.append(x)

        hidden = _layer_norm(cfg, x, "ln_f")
        h = apply_steer(hidden[:, -1:] if last_logits_only else hidden, hooks)
        if cfg.tie_word_embeddings:
            logits = attend(self, wte, h)
        else:
            logits = _dense(cfg, cfg.vocab_size, dtype, "lm_head", use_bias=False)(h)

        new_cache = None
        if cache is not None:
            new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), mask=key_mask, index=index + t,
                                pos=next_positions(cache, mask, positions))
        logits = apply_steer_logits(logits.astype(jnp.float32), hooks)
        return ModelOutput(logits=logits, hidden=hidden,
                           hidden_states=tuple(hidden_states) if output_hidden_states else None,
                           cache=new_cache)


# ----------------------------------------------------------------------------- params


def _unwrap(params):
    return params["params"] if "params" in params and "wte" not in params else params


def input_embeddings(params) -> Array:
    """Token-embedding matrix [V,D] (params with or without a ``"params"`` level)."""
    return _unwrap(params)["wte"]["embedding"]


def output_embeddings(params, config: GPT2Config) -> Array:
    """Matrix [V,D] the final hidden state is dotted with (= input embeddings when tied)."""
    params = _unwrap(params)
    if config.tie_word_embeddings:
        return params["wte"]["embedding"]
    return params["lm_head"]["kernel"].T


_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints


def _hf_key_map(config: GPT2Config) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """HF tensor name (without ``transformer.``) -> (param path, expected HF shape, transpose)."""
    d, f, v = config.n_embd, config.n_inner, config.vocab_size
    m = {
        "wte.weight": (("wte", "embedding"), (v, d), False),
        "wpe.weight": (("wpe", "embedding"), (config.n_positions, d), False),
        "ln_f.weight": (("ln_f", "scale"), (d,), False),
        "ln_f.bias": (("ln_f", "bias"), (d,), False),
    }
    for i in range(config.n_layer):
        hf, jx = f"h.{i}.", f"h_{i}"
        for ln in ("ln_1", "ln_2"):
            m[f"{hf}{ln}.weight"] = ((jx, ln, "scale"), (d,), False)
            m[f"{hf}{ln}.bias"] = ((jx, ln, "bias"), (d,), False)
        for mod, name, n_in, n_out in (("attn", "c_attn", d, 3 * d), ("attn", "c_proj", d, d),
                                       ("mlp", "c_fc", d, f), ("mlp", "c_proj", f, d)):
            m[f"{hf}{mod}.{name}.weight"] = ((jx, mod, name, "kernel"), (n_in, n_out), False)
            m[f"{hf}{mod}.{name}.bias"] = ((jx, mod, name, "bias"), (n_out,), False)
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = (("lm_head", "kernel"), (v, d), True)
    return m


def params_from_hf(state_dict: Mapping[str, np.ndarray], config: GPT2Config, dtype=np.float32) -> dict:
    """HF GPT-2 state dict (names with or without ``transformer.``) -> jsteer param tree.

    Raises KeyError naming a missing tensor (as the BERT and LLaMA converters do) and
    ValueError naming an unexpected or mis-shaped tensor.
    """
    key_map = _hf_key_map(config)
    params: dict = {}
    seen = set()
    for raw_name, value in state_dict.items():
        name = raw_name[len("transformer."):] if raw_name.startswith("transformer.") else raw_name
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the same matrix as wte
        if name not in key_map:
            raise ValueError(f"GPT-2 params_from_hf: unexpected tensor {raw_name!r} with shape {tuple(np.shape(value))}")
        if name in seen:
            raise ValueError(f"GPT-2 params_from_hf: tensor {name!r} given twice (with and without 'transformer.')")
        seen.add(name)
        path, shape, transpose = key_map[name]
        arr = np.asarray(value)
        if tuple(arr.shape) != shape:
            raise ValueError(f"GPT-2 params_from_hf: tensor {raw_name!r} has shape {tuple(arr.shape)}, "
                             f"expected {shape}")
        arr = arr.T if transpose else arr
        node = params
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jnp.asarray(arr, dtype=dtype)
    missing = [k for k in key_map if k not in seen]
    if missing:
        raise KeyError(f"GPT-2 params_from_hf: missing tensor {missing[0]!r}"
                       + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return params
