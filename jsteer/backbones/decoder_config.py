"""The decoder's configuration: :class:`DecoderConfig`, every switch that tells the families apart.

:mod:`jsteer.backbones.families` builds one from an HF config.json; :class:`jsteer.backbones.decoder.Decoder`
reads it. Sizes: V ``vocab_size``, D ``hidden_size``, F ``intermediate_size``, L ``num_layers``,
N ``num_heads``, K ``num_kv_heads`` (N a multiple of K), H ``head_dim``. Block layouts
(:data:`BLOCKS`) are drawn in :mod:`jsteer.backbones.decoder`'s docstring; ``layer_types`` gives
each layer :data:`FULL` or :data:`SLIDING` attention; ``remat`` names one of
:data:`REMAT_POLICIES`. The KV cache a config makes (:meth:`DecoderConfig.init_cache`) holds
k [B, K, H, S] and v [B, K, S, H] per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp

from jsteer.backbones.base import ACTIVATIONS, KVCache, eos_ids
from jsteer.backbones.rope import Rope

BLOCKS = ("pre", "sandwich", "post", "parallel")
# what a rematerialised layer keeps from its forward for the backward pass
REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything that distinguishes the families (built by :mod:`jsteer.backbones.families`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    norm: str = "rms"  # "rms" | "layer" (with bias)
    norm_eps: float = 1e-6
    norm_offset: bool = False  # Gemma: scale by (1 + w)
    norm_weight_f32: bool = False  # weight applied in fp32 before the cast (Gemma, OLMo-2); else after
    block: str = "pre"
    qk_norm: Optional[str] = None  # None | "head" (Qwen3, Gemma-3) | "proj" (OLMo-2)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp: str = "gated"  # "gated": down(act(gate(x)) * up(x)) | "plain": down(act(up(x)))
    mlp_bias: bool = False
    activation: str = "silu"
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_scale_by_layer: bool = False  # GPT-2 scale_attn_by_inverse_layer_idx: / (layer + 1)
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None  # per layer FULL | SLIDING; None: all FULL
    position: str = "rope"  # "rope" | "learned"
    rope: Optional[Rope] = None
    rope_local: Optional[Rope] = None  # sliding layers' RoPE (Gemma-3); None: ``rope``
    max_position_embeddings: int = 2048
    embed_scale: bool = False  # Gemma: embeddings x sqrt(D)
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Union[int, Tuple[int, ...], None] = None
    pad_token_id: Optional[int] = None
    scan_layers: bool = False  # one nn.scan over stacked layer params (compile time independent of L)
    remat: str = "none"  # rematerialise each layer in the backward: "none" | "dots" | "full"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name, value, allowed in (
            ("block", self.block, BLOCKS),
            ("norm", self.norm, ("rms", "layer")),
            ("mlp", self.mlp, ("gated", "plain")),
            ("position", self.position, ("rope", "learned")),
            ("qk_norm", self.qk_norm, (None, "head", "proj")),
        ):
            if value not in allowed:
                raise ValueError(f"DecoderConfig.{name}={value!r}; expected one of {allowed}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.activation {self.activation!r} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        if self.position == "rope" and self.rope is None:
            raise ValueError("DecoderConfig: position='rope' needs a rope")
        types = self.layer_types or ()
        if types and (len(types) != self.num_layers or set(types) - {FULL, SLIDING}):
            raise ValueError(
                f"DecoderConfig.layer_types must give {FULL!r} or {SLIDING!r} for each of the "
                f"{self.num_layers} layers, got {types}"
            )
        if SLIDING in types and not self.sliding_window:
            raise ValueError("DecoderConfig: sliding_attention layers need sliding_window")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"DecoderConfig.remat={self.remat!r}; expected one of {tuple(REMAT_POLICIES)}")

    @property
    def stop_ids(self) -> Tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    @property
    def position_table_size(self) -> Optional[int]:
        """Rows of a learned position table (valid ids 0..P-1); None for RoPE (no table)."""
        return self.max_position_embeddings if self.position == "learned" else None

    @property
    def cache_reset_length(self) -> Optional[int]:
        """Phi-3's LongRoPE switches to its long factors once a sequence outgrows this many tokens;
        transformers' Phi-3 generate then recomputes the KV cache, and :func:`jsteer.decode.generate`
        does the same (other families keep the cached keys, in both libraries)."""
        if self.model_type == "phi3" and self.rope is not None and self.rope.rope_type == "longrope":
            return int(self.rope.p["original_max_position_embeddings"])
        return None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """Empty KV cache with ``max_len`` slots: k [B, K, H, S], v [B, K, S, H] per layer (one
        [L, ...] array each with ``scan_layers``)."""
        return KVCache.init(
            self.num_layers, batch, max_len, self.num_kv_heads, self.head_dim, dtype, stacked=self.scan_layers
        )

    def to_dict(self) -> dict:
        """A config.json dict that :func:`jsteer.backbones.families.config_from_hf` reads back to
        an equal config (``jsteer_decoder`` form; HF's own keys are kept in ``LM.hf_config``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("rope", "rope_local"):
            d[k] = None if d[k] is None else dataclasses.asdict(d[k])
        d["layer_types"] = None if self.layer_types is None else list(self.layer_types)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        return {"jsteer_decoder": d, "model_type": self.model_type}

    @classmethod
    def llama(
        cls,
        *,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        **kw,
    ) -> "DecoderConfig":
        """A LLaMA-shaped config built by hand (toy and from-scratch models)."""
        head_dim = head_dim or hidden_size // num_heads
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            rope=Rope(theta=rope_theta, dim=head_dim, max_position_embeddings=max_position_embeddings),
            **kw,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DecoderConfig":
        d = dict(d)
        for k in ("rope", "rope_local"):
            if d.get(k) is not None:
                r = dict(d[k])
                r["params"] = tuple((p, tuple(v) if isinstance(v, list) else v) for p, v in r.get("params", ()))
                d[k] = Rope(**r)
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"jsteer_decoder config: unknown field {unknown[0]!r}")
        return cls(**d)
