"""One decoder for every causal-LM family, with config switches (LLaMA, Mistral, Qwen2/3, Gemma-2/3,
Phi-3, OLMo-2, GPT-NeoX / Pythia, GPT-2); :mod:`jsteer.backbones.families` translates each HF config
and gives each family's weight layout.

Call (B batch, T new tokens, S cache slots, D hidden, V vocab)::

    out = Decoder(config).apply({"params": p}, input_ids [B,T], attention_mask=[B,T] | None,
        hooks=Hooks | None, cache=KVCache | None, output_hidden_states=False, step=False,
        last_logits_only=False, capture=("resid_post.3", ...))

``out.logits`` [B,T,V] fp32 (``last_logits_only``: [B,1,V]), ``out.hidden`` the final-norm output
[B,T,D], ``out.cache`` the updated KV cache, ``out.captured`` {site: [B,T,D]}. ``step=True``: the T
tokens are generated ones (decode steps: ``hooks.step_offset`` instead of ``embed_offset``;
interventions see ``ctx.decode``). The layer loop passes every activation through the sites of
:mod:`jsteer.interventions`; Hooks' built-in fields act there (module docstring of jsteer.hooks).

Block layouts (``config.block``), x the residual stream::

    pre       x += attn(n1(x));            x += mlp(n2(x))                  LLaMA, Qwen, Phi-3, GPT-2
    sandwich  x += n1b(attn(n1(x)));       x += n2b(mlp(n2(x)))             Gemma-2/3
    post      x += n1b(attn(x));           x += n2b(mlp(x))                 OLMo-2
    parallel  x += attn(n1(x)) + mlp(n2(x))                                 GPT-NeoX (use_parallel_residual)

Params (kernels [in..., out...]; every leaf has logical axis names, :func:`logical_axes`)::

    embed/embedding [V,D]        pos_embed/embedding [P,D] (learned positions)
    layers_{i}/attn_norm, ffn_norm, attn_post_norm, ffn_post_norm   {scale[, bias]} [D]
    layers_{i}/attn/{q [D,N,H], k [D,K,H], v [D,K,H], o [N,H,D]}    {kernel[, bias]}
    layers_{i}/attn/{q_norm, k_norm}  [H] (per head) or [N*H] / [K*H] (whole projection)
    layers_{i}/mlp/{gate [D,F], up [D,F], down [F,D]}               (plain MLP: up, down)
    final_norm {scale[, bias]} [D]       lm_head/kernel [D,V] (untied only)

Norms and the softmax run in float32; matrix products in ``dtype`` (fp32 accumulation).

The config is :mod:`jsteer.backbones.decoder_config`'s, the param-tree helpers (embeddings,
CPU packing, stacking, logical axes) :mod:`jsteer.backbones.decoder_params`', the per-family
config translations :mod:`jsteer.backbones.families`' and weight layouts
:mod:`jsteer.backbones.decoder_hf`'.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from jsteer import interventions as iv
from jsteer.backbones import cpu
from jsteer.backbones.attention import RightPadded, attention
from jsteer.backbones.base import (
    ACTIVATIONS,
    Embed,
    KVCache,
    ModelOutput,
    attention_slots,
    check_position_ids,
    default_positions,
    next_positions,
)
from jsteer.backbones.decoder_config import REMAT_POLICIES, DecoderConfig
from jsteer.backbones.decoder_params import decode_pack
from jsteer.backbones.matmul import Linear, dot_fp32_out
from jsteer.backbones.rope import apply_rope
from jsteer.backbones.sites import SiteRunner
from jsteer.hooks import Hooks, apply_steer_logits

Array = jnp.ndarray


# ----------------------------------------------------------------------------- layers


class Norm(nn.Module):
    """RMSNorm (``kind`` "rms") or LayerNorm ("layer", with bias) over the last axis, in fp32."""

    kind: str
    eps: float
    offset: bool = False
    weight_f32: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (d,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        if self.kind == "layer":
            mean = x32.mean(-1, keepdims=True)
            var = jnp.square(x32 - mean).mean(-1, keepdims=True)
            bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
            y = (x32 - mean) * lax.rsqrt(var + self.eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
            return y.astype(self.dtype)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = (1.0 + scale.astype(jnp.float32)) if self.offset else scale
        if self.weight_f32 or self.offset:
            return (y * w.astype(jnp.float32)).astype(self.dtype)
        return w.astype(self.dtype) * y.astype(self.dtype)


def _norm(c: DecoderConfig, name: str, dtype, param_dtype) -> Norm:
    return Norm(c.norm, c.norm_eps, c.norm_offset, c.norm_weight_f32, dtype=dtype, param_dtype=param_dtype, name=name)


class Attention(nn.Module):
    """GQA self-attention: N query heads share K key/value heads in groups of G = N / K."""

    config: DecoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, visible, bias, kv, index, layer):
        """x [B,T,D]; cos / sin [B,T,R] or None (learned positions); visible [B,T,S] bool, or
        (that, RightPadded) for a causal call without a cache; bias [B,T,S] or None; kv: this
        layer's cached (k, v) written at slot ``index``, or None.
        Returns (out [B,T,D], (k, v) after the write or None)."""
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        b, t, _ = x.shape
        n, kh, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q_proj = Linear((n, hd), use_bias=c.qkv_bias, name="q", **kw)
        q = q_proj(x)
        k = Linear((kh, hd), use_bias=c.qkv_bias, name="k", **kw)(x)
        v = Linear((kh, hd), use_bias=c.qkv_bias, name="v", **kw)(x)
        if c.qk_norm == "proj":  # OLMo-2: over the whole projection
            q = _norm(c, "q_norm", **kw)(q.reshape(b, t, n * hd)).reshape(b, t, n, hd)
            k = _norm(c, "k_norm", **kw)(k.reshape(b, t, kh * hd)).reshape(b, t, kh, hd)
        elif c.qk_norm == "head":
            q, k = _norm(c, "q_norm", **kw)(q), _norm(c, "k_norm", **kw)(k)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = None
        if kv is not None:
            k, v = new_kv = KVCache.write(*kv, k, v, index)
        scale = c.attn_scale if c.attn_scale is not None else hd**-0.5
        if c.attn_scale_by_layer:
            scale = scale / (layer + 1)
        visible, right_padded = visible if isinstance(visible, tuple) else (visible, None)
        out = attention(
            q.reshape(b, t, kh, n // kh, hd),
            k,
            v.astype(self.dtype),
            scale=scale,
            visible=visible[:, None, None],
            right_padded=right_padded,
            softcap=c.attn_softcap,
            bias=None if bias is None else bias[:, None, None].astype(jnp.float32),
            cache_layout=kv is not None,
            # the "packed" collection (generate's, LM.forward's): a CPU call with jsteer's kernels on
            cpu_kernel=q_proj.has_variable("packed", "kernel"),
        )
        out = Linear((c.hidden_size,), in_axes=2, use_bias=c.o_bias, name="o", **kw)(out.reshape(b, t, n, hd))
        return out, new_kv


class MLP(nn.Module):
    config: DecoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, site=None, layer=None) -> Array:
        """``site`` / ``layer``: the call's site runner, for ``ffn_hidden`` (the activation's input)."""
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        act = ACTIVATIONS[c.activation]

        def hidden(h):
            return h if site is None else site("ffn_hidden", layer, h)

        up = Linear((c.intermediate_size,), use_bias=c.mlp_bias, name="up", **kw)(x)
        if c.mlp == "gated":
            up = act(hidden(Linear((c.intermediate_size,), use_bias=c.mlp_bias, name="gate", **kw)(x))) * up
        else:
            up = act(hidden(up))
        return Linear((c.hidden_size,), use_bias=c.mlp_bias, name="down", **kw)(up)


class Block(nn.Module):
    """One decoder layer (``config.block`` layout). ``layer``: int, or traced under a scanned stack."""

    config: DecoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, visible, bias, kv, index, site, layer):
        return self._layer(x, cos, sin, visible, bias, kv, index, site, layer)

    def _layer(self, x, cos, sin, visible, bias, kv, index, site, i):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        attn = Attention(c, name="attn", **kw)
        mlp = MLP(c, name="mlp", **kw)
        x = site("resid_pre", i, x)
        if c.block == "parallel":
            a, new_kv = attn(_norm(c, "attn_norm", **kw)(x), cos, sin, visible, bias, kv, index, i)
            a = site("attn_out", i, a)
            f = site("ffn_out", i, mlp(site("ffn_in", i, _norm(c, "ffn_norm", **kw)(x)), site, i))
            return site("resid_post", i, x + a + f), new_kv
        h = x if c.block == "post" else _norm(c, "attn_norm", **kw)(x)
        a, new_kv = attn(h, cos, sin, visible, bias, kv, index, i)
        if c.block in ("sandwich", "post"):
            a = _norm(c, "attn_post_norm", **kw)(a)
        x = x + site("attn_out", i, a)
        h = site("ffn_in", i, x if c.block == "post" else _norm(c, "ffn_norm", **kw)(x))
        f = mlp(h, site, i)
        if c.block in ("sandwich", "post"):
            f = _norm(c, "ffn_post_norm", **kw)(f)
        x = x + site("ffn_out", i, f)
        return site("resid_post", i, x), new_kv


class _ScannedBlock(Block):
    """Block in ``nn.scan``'s (carry, xs) form: carry (x, per-layer captures), xs (layer index,
    sliding flag, this layer's cache slice or None); the rest is broadcast."""

    @nn.compact
    def __call__(self, carry, xs, shared, site):
        x, caps = carry
        layer, sliding, kv = xs
        (cos, sin), (cos_l, sin_l), visible, visible_l, bias, index = shared
        if cos is not None and cos_l is not cos:
            cos, sin = jnp.where(sliding, cos_l, cos), jnp.where(sliding, sin_l, sin)
        if self.config.sliding_window:
            visible = jnp.where(sliding, visible_l, visible)
        site.set_carry(caps)
        x, new_kv = self._layer(x, cos, sin, visible, bias, kv, index, site, layer)
        return (x, {k: site.captured[k] for k in caps}), new_kv


def _layer_stack(c: DecoderConfig, x, rope, rope_l, visible, visible_l, bias, cache, index, site, kw, hidden_states):
    """The layer loop: unrolled (params ``layers_{i}``) or one ``nn.scan`` (params ``layers``, every
    leaf with a leading layer axis; compile time independent of depth). Returns (x, new k, new v):
    tuples of per-layer arrays, or stacked [L, ...] arrays when scanned."""
    policy = REMAT_POLICIES[c.remat]
    if c.remat != "none" and site.capture and not c.scan_layers:
        raise ValueError(
            "capture= with remat needs scan_layers=True (a rematerialised unrolled layer cannot "
            "hand out its activations); or capture with remat='none'"
        )
    if not c.scan_layers:
        block = Block if c.remat == "none" else nn.remat(Block, policy=policy, static_argnums=(8, 9))
        new_k, new_v = [], []
        for i in range(c.num_layers):
            local = c.is_sliding(i)
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, new_kv = block(c, name=f"layers_{i}", **kw)(
                x, *(rope_l if local else rope), visible_l if local else visible, bias, kv, index, site, i
            )
            if new_kv is not None:
                new_k.append(new_kv[0])
                new_v.append(new_kv[1])
            if hidden_states is not None:
                hidden_states.append(x)
        return x, tuple(new_k), tuple(new_v)
    if hidden_states is not None:
        raise ValueError(
            "output_hidden_states needs the unrolled layer stack; with scan_layers=True "
            "use capture=('resid_post.0', ...)"
        )
    sliding = jnp.asarray([c.is_sliding(i) for i in range(c.num_layers)])
    kv = None if cache is None else (cache.k, cache.v)
    body = _ScannedBlock if c.remat == "none" else nn.remat(_ScannedBlock, policy=policy, static_argnums=(4,))
    scan = nn.scan(
        body,
        variable_axes={"params": 0, "packed": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast),
        length=c.num_layers,
    )
    (x, caps), new_kv = scan(c, name="layers", **kw)(
        (x, site.carry(x)),
        (jnp.arange(c.num_layers), sliding, kv),
        (rope, rope_l, visible, visible_l, bias, index),
        site,
    )
    site.set_carry(caps)
    return (x,) + (tuple(new_kv) if new_kv is not None else ((), ()))


class Decoder(nn.Module):
    """Causal LM returning :class:`ModelOutput` (module docstring). ``dtype``: activation / matmul
    dtype (norms, softmax and logits in fp32); ``param_dtype``: dtype of freshly initialised params."""

    config: DecoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def decode_pack(self, params: dict) -> dict:
        """The "packed" collection :func:`jsteer.decode.generate` passes on CPU (:func:`decode_pack`)."""
        return decode_pack(params, self.config)

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        attention_mask: Optional[Array] = None,
        hooks: Optional[Hooks] = None,
        cache: Optional[KVCache] = None,
        output_hidden_states: bool = False,
        step: bool = False,
        last_logits_only: bool = False,
        capture: Tuple[str, ...] = (),
    ) -> ModelOutput:
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        if attention_mask.shape != (b, t):
            raise ValueError(f"attention_mask has shape {attention_mask.shape}, input_ids {input_ids.shape}")
        mask = attention_mask.astype(jnp.int32)
        capture = iv.check_capture(capture, c.num_layers)
        if hooks is not None:
            from jsteer.hooks import check_film_layers

            check_film_layers(hooks, c.num_layers)
            iv.check_interventions(hooks.interventions, c.num_layers)
        if hooks is not None and hooks.position_ids is not None:
            positions = hooks.position_ids
            check_position_ids(positions, c.position_table_size, c.model_type)
        else:
            positions = default_positions(mask, cache)
        site = SiteRunner(hooks, capture, positions, mask, step, ffn_width=c.intermediate_size)

        embed = Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(0.02),
            name="embed",
        )
        x = embed(input_ids)
        if c.embed_scale:
            x = x * jnp.asarray(math.sqrt(c.hidden_size), self.dtype)
        x = site("embed", None, x)
        rope = rope_l = (None, None)
        if c.position == "learned":
            if cache is None and t > c.max_position_embeddings:
                raise ValueError(f"input length {t} exceeds the {c.max_position_embeddings} learned positions")
            x = x + Embed(
                c.max_position_embeddings,
                c.hidden_size,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                embedding_init=nn.initializers.normal(0.02),
                name="pos_embed",
            )(positions)
        else:
            # kernels on (CPU): cos / sin computed once, not fused into each head's rotation
            once = cpu.materialize if "packed" in self.variables else (lambda x: x)
            rope = rope_l = tuple(map(once, c.rope.cos_sin(positions)))
            if c.rope_local is not None:
                rope_l = tuple(map(once, c.rope_local.cos_sin(positions)))

        index, key_mask, q_slot, k_slot, bias = attention_slots(mask, None if hooks is None else hooks.attn_bias, cache)
        visible = visible_l = (k_slot[None, :] <= q_slot[:, None])[None] & (key_mask[:, None, :] > 0)
        if c.sliding_window:
            visible_l = visible & (q_slot[:, None] - k_slot[None, :] < c.sliding_window)[None]
        elif cache is None and bias is None:  # causal over the call's own keys: cuDNN may mask by lengths
            visible = visible_l = (visible, RightPadded.of(key_mask))
        hidden_states = [x] if output_hidden_states else None
        x, new_k, new_v = _layer_stack(
            c, x, rope, rope_l, visible, visible_l, bias, cache, index, site, kw, hidden_states
        )
        hidden = _norm(c, "final_norm", **kw)(x)
        h = hidden[:, -1:] if last_logits_only else hidden
        h = site("final", None, h)
        if c.tie_word_embeddings:
            has = self.has_variable("packed", "embed_attend")
            packed = self.get_variable("packed", "embed_attend") if has else None
            rows = math.prod(h.shape[:-1])
            if packed is not None and self.dtype == jnp.float32 and h.dtype == jnp.float32:
                table = embed.embedding.T  # [D, V]: the tangent's operand; the kernel reads packed
                logits = cpu.packed_matmul(h.reshape(rows, -1), table, packed).reshape(h.shape[:-1] + (-1,))
            else:  # h E^T with fp32 logits (embed.attend would round them to the compute dtype)
                table = embed.embedding.astype(self.dtype)
                logits = dot_fp32_out(h.astype(self.dtype), table, (((h.ndim - 1,), (1,)), ((), ())))
        else:
            logits = Linear((c.vocab_size,), name="lm_head", fp32_out=True, **kw)(h)
        logits = logits.astype(jnp.float32)
        if c.final_softcap is not None:
            logits = jnp.tanh(logits / c.final_softcap) * c.final_softcap
        logits = apply_steer_logits(logits, hooks)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(
                k=new_k, v=new_v, mask=key_mask, index=index + t, pos=next_positions(cache, mask, positions)
            )
        return ModelOutput(
            logits=logits,
            hidden=hidden,
            cache=new_cache,
            captured=site.captured or None,
            hidden_states=None if hidden_states is None else tuple(hidden_states),
        )


__all__ = ["Decoder", "Block", "Linear", "Norm"]
