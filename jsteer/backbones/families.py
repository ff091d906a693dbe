"""Decoder families: each HF ``model_type`` is a config translation (HF config.json dict ->
:class:`~jsteer.backbones.decoder_config.DecoderConfig`) plus a weight layout (HF tensor names ->
:mod:`jsteer.convert.layout` entries, in :mod:`jsteer.backbones.decoder_hf`). Nothing is
approximated: a config field this module does not know, or a value of a known field it does not
implement, is refused with the field named.

==============  =========================================================================
model_type      what differs from LLaMA
==============  =========================================================================
llama           (Llama 1-3.x; rope_type default / linear / dynamic / yarn / longrope / llama3)
mistral         sliding-window attention on every layer
qwen2           q/k/v biases; optional sliding window on upper layers (layer_types)
qwen3           per-head q/k RMSNorm
gemma2          embeddings x sqrt(D), (1 + w) RMSNorm, GeGLU (tanh GELU), sandwich norms,
                attention-logit and final-logit soft-capping, alternating sliding / global
                layers, query_pre_attn_scalar
gemma3_text     Gemma-2's block with per-head q/k norm, local / global RoPE bases
phi3            fused qkv_proj and gate_up_proj; long-context RoPE (longrope)
olmo2           q/k RMSNorm over the whole projection; norms after attention and FFN
gpt_neox        LayerNorm with bias, parallel residual, partial rotary, per-head fused qkv
gpt2            learned positions, LayerNorm, fused c_attn (Conv1D [in, out] weights)
==============  =========================================================================

Each family is a short config translation built from the same helpers and refusal rules; the
weight layouts are :mod:`jsteer.backbones.decoder_hf`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from jsteer.backbones.decoder_config import FULL, SLIDING, DecoderConfig
from jsteer.backbones.rope import rope_from_hf

# Keys that describe training, serialisation or generation defaults, never the forward pass.
_META = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "use_cache",
    "initializer_range",
    "auto_map",
    "_attn_implementation",
    "attn_implementation",
    "cache_implementation",
    "pretraining_tp",
    "tokenizer_class",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "use_return_dict",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "max_length",
    "prefix",
    "chunk_size_feed_forward",
    "tie_encoder_decoder",
    "gradient_checkpointing",
    "keys_to_ignore_at_inference",
    # dropout rates: jsteer's decoders run without dropout (inference and frozen-backbone methods)
    "attention_dropout",
    "hidden_dropout",
    "embd_pdrop",
    "resid_pdrop",
    "attn_pdrop",
    "classifier_dropout",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "_sliding_window_pattern",
    "sliding_window_pattern",
    "max_window_layers",
    "num_labels",
    "label_smoothing",
    "is_encoder_decoder",
}
_COMMON = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
}


def _need(d: Mapping, key: str, where: str):
    if d.get(key) is None:
        raise ValueError(f"{where}: config lacks field {key!r}")
    return d[key]


def _check_keys(d: Mapping, known: set, where: str) -> None:
    unknown = sorted(set(d) - known - _META)
    if unknown:
        raise ValueError(
            f"{where}: config field {unknown[0]!r} (= {d[unknown[0]]!r}) is not understood by "
            f"jsteer's {d.get('model_type')} reader; refusing rather than guessing what it changes"
        )


def _refuse(where: str, field: str, value, supported: str) -> None:
    raise ValueError(f"{where}: config field {field!r} = {value!r} is not supported ({supported})")


def _eos(v):
    return tuple(int(e) for e in v) if isinstance(v, (list, tuple)) else v


def _base(
    d: Mapping, where: str, *, act_key: str = "hidden_act", default_act: str = "silu", tie_default: bool = False
) -> dict:
    hidden, heads = int(_need(d, "hidden_size", where)), int(_need(d, "num_attention_heads", where))
    if not d.get("head_dim") and hidden % heads:
        _refuse(where, "num_attention_heads", heads, f"hidden_size {hidden} must be a multiple of it")
    return dict(
        model_type=d["model_type"],
        vocab_size=int(_need(d, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_need(d, "intermediate_size", where)),
        num_layers=int(_need(d, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        activation=str(d.get(act_key) or default_act),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", tie_default)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
    )


def _rope_dict(d: Mapping, layer_type: Optional[str] = None):
    """The RoPE parameter dict for one layer type, from rope_parameters (maybe nested by layer
    type) or the older rope_scaling."""
    p = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(p, Mapping) and layer_type is not None and layer_type in p:
        return p[layer_type]
    if isinstance(p, Mapping) and (FULL in p or SLIDING in p):
        return p.get(FULL)
    return p


def _rope(
    d: Mapping,
    base: dict,
    where: str,
    *,
    partial: float = 1.0,
    theta_default: float = 10000.0,
    layer_type: Optional[str] = None,
    theta: Optional[float] = None,
):
    field = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    return rope_from_hf(
        _rope_dict(d, layer_type),
        theta=theta if theta is not None else float(d.get("rope_theta", theta_default)),
        head_dim=base["head_dim"],
        partial=float(d.get("partial_rotary_factor", partial)),
        max_position_embeddings=base["max_position_embeddings"],
        original_max=d.get("original_max_position_embeddings"),
        where=f"{where}: {field}",
    )


def _layer_types(d: Mapping, n: int, where: str, default: Callable[[int], str]) -> tuple:
    types = d.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(n))
    if len(types) != n or set(types) - {FULL, SLIDING}:
        _refuse(where, "layer_types", types, f"one of {FULL!r} / {SLIDING!r} per layer")
    return tuple(types)


# ----------------------------------------------------------------------------- config translations


def _llama_like(d: Mapping, where: str) -> dict:
    mt = d["model_type"]
    known = _COMMON | {
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "use_sliding_window",
        "layer_types",
        "original_max_position_embeddings",
    }
    _check_keys(d, known, where)
    c = _base(d, where)
    if c["activation"] != "silu":
        _refuse(where, "hidden_act", c["activation"], "only 'silu'")
    c.update(norm_eps=float(d.get("rms_norm_eps", 1e-6)), mlp_bias=bool(d.get("mlp_bias", False)))
    if mt == "qwen2":
        c.update(qkv_bias=True)
    else:
        c.update(qkv_bias=bool(d.get("attention_bias", False)), o_bias=bool(d.get("attention_bias", False)))
    if mt == "qwen3":
        c.update(qk_norm="head", o_bias=c["qkv_bias"])
    window = d.get("sliding_window")
    if mt == "mistral" and window:
        c.update(sliding_window=int(window), layer_types=(SLIDING,) * c["num_layers"])
    elif mt in ("qwen2", "qwen3") and d.get("use_sliding_window") and window:
        start = int(d.get("max_window_layers", c["num_layers"]))
        types = _layer_types(d, c["num_layers"], where, lambda i: SLIDING if i >= start else FULL)
        c.update(sliding_window=int(window), layer_types=types if SLIDING in types else None)
    elif mt == "llama" and window is not None:
        _refuse(where, "sliding_window", window, "llama has no sliding window")
    c["rope"] = _rope(d, c, where)
    return c


def _gemma(d: Mapping, where: str) -> dict:
    mt = d["model_type"]
    known = _COMMON | {
        "hidden_act",
        "hidden_activation",
        "rms_norm_eps",
        "attention_bias",
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_size",
        "layer_types",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
        "rope_local_base_freq",
    }
    _check_keys(d, known, where)
    if d.get("use_bidirectional_attention"):
        _refuse(where, "use_bidirectional_attention", True, "causal attention only")
    c = _base(
        d, where, act_key="hidden_activation", default_act=d.get("hidden_act") or "gelu_pytorch_tanh", tie_default=True
    )
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or (2 if mt == "gemma2" else 6)
    types = _layer_types(d, c["num_layers"], where, lambda i: SLIDING if (i + 1) % pattern else FULL)
    c.update(
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        norm_offset=True,
        block="sandwich",
        embed_scale=True,
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=d.get("final_logit_softcapping"),
        sliding_window=int(d.get("sliding_window") or d.get("sliding_window_size") or 4096),
        layer_types=types,
    )
    if mt == "gemma2":
        c["attn_softcap"] = d.get("attn_logit_softcapping")
        c["rope"] = _rope(d, c, where)
    else:  # transformers' Gemma-3 ignores attn_logit_softcapping
        c["qk_norm"] = "head"
        nested = d.get("rope_parameters")
        if isinstance(nested, Mapping) and SLIDING in nested:
            c["rope"] = _rope(d, c, where, layer_type=FULL, theta_default=1e6)
            c["rope_local"] = _rope(d, c, where, layer_type=SLIDING)
        else:  # the older form: rope_scaling / rope_theta are global, rope_local_base_freq the local base
            c["rope"] = _rope(d, c, where, theta_default=1e6)
            c["rope_local"] = rope_from_hf(
                None,
                theta=float(d.get("rope_local_base_freq", 10000.0)),
                head_dim=c["head_dim"],
                partial=1.0,
                where=where,
                original_max=None,
                max_position_embeddings=c["max_position_embeddings"],
            )
    return c


def _phi3(d: Mapping, where: str) -> dict:
    known = _COMMON | {
        "hidden_act",
        "rms_norm_eps",
        "sliding_window",
        "original_max_position_embeddings",
        "attention_bias",
    }
    _check_keys(d, known, where)
    if d.get("attention_bias"):
        _refuse(where, "attention_bias", True, "Phi-3's fused projections have no bias")
    c = _base(d, where)
    if c["activation"] != "silu":
        _refuse(where, "hidden_act", c["activation"], "only 'silu'")
    c["norm_eps"] = float(d.get("rms_norm_eps", 1e-5))
    if d.get("sliding_window"):
        c.update(sliding_window=int(d["sliding_window"]), layer_types=(SLIDING,) * c["num_layers"])
    rope = dict(_rope_dict(d) or {})
    if rope.get("type") == "su" or rope.get("rope_type") == "su":  # Phi-3's original name for longrope
        rope.pop("type", None)
        rope["rope_type"] = "longrope"
        d = {**d, "rope_scaling": rope, "rope_parameters": None}
    c["rope"] = _rope(d, c, where)
    return c


def _olmo2(d: Mapping, where: str) -> dict:
    _check_keys(d, _COMMON | {"hidden_act", "rms_norm_eps", "attention_bias"}, where)
    c = _base(d, where)
    if c["activation"] != "silu":
        _refuse(where, "hidden_act", c["activation"], "only 'silu'")
    c.update(
        norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        norm_weight_f32=True,
        block="post",
        qk_norm="proj",
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
    )
    c["rope"] = _rope(d, c, where)
    return c


def _gpt_neox(d: Mapping, where: str) -> dict:
    known = _COMMON | {
        "hidden_act",
        "layer_norm_eps",
        "use_parallel_residual",
        "rotary_pct",
        "rotary_emb_base",
        "attention_bias",
        "is_decoder",
    }
    _check_keys(d, known, where)
    c = _base(d, where, default_act="gelu")
    if c["num_kv_heads"] != c["num_heads"]:
        _refuse(where, "num_key_value_heads", c["num_kv_heads"], "GPT-NeoX has no grouped-query attention")
    bias = bool(d.get("attention_bias", True))
    c.update(
        norm="layer",
        norm_eps=float(d.get("layer_norm_eps", 1e-5)),
        mlp="plain",
        mlp_bias=True,
        qkv_bias=bias,
        o_bias=bias,
        block="parallel" if d.get("use_parallel_residual", True) else "pre",
    )
    c["rope"] = _rope(
        d,
        c,
        where,
        partial=float(d.get("rotary_pct", 1.0)),
        theta=float(d["rotary_emb_base"]) if "rotary_emb_base" in d else None,
    )
    return c


def _gpt2(d: Mapping, where: str) -> dict:
    known = {
        "vocab_size",
        "n_positions",
        "n_ctx",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx",
        "tie_word_embeddings",
        "reorder_and_upcast_attn",
        "add_cross_attention",
    }
    _check_keys(d, known, where)
    if d.get("add_cross_attention"):
        _refuse(where, "add_cross_attention", True, "decoder-only GPT-2")
    hidden, heads = int(_need(d, "n_embd", where)), int(_need(d, "n_head", where))
    if hidden % heads:
        _refuse(where, "n_head", heads, f"n_embd {hidden} must be a multiple of it")
    return dict(
        model_type="gpt2",
        vocab_size=int(_need(d, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(d.get("n_inner") or 4 * hidden),
        num_layers=int(_need(d, "n_layer", where)),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        norm="layer",
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        qkv_bias=True,
        o_bias=True,
        mlp="plain",
        mlp_bias=True,
        activation=str(d.get("activation_function", "gelu_new")),
        attn_scale=None if d.get("scale_attn_weights", True) else 1.0,
        attn_scale_by_layer=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
        position="learned",
        max_position_embeddings=int(d.get("n_positions", 1024)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id", 50256),
        eos_token_id=_eos(d.get("eos_token_id", 50256)),
        pad_token_id=d.get("pad_token_id"),
    )


_TRANSLATE: dict[str, Callable[[Mapping, str], dict]] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "gpt_neox": _gpt_neox,
    "gpt2": _gpt2,
}
MODEL_TYPES = tuple(_TRANSLATE)


def config_from_hf(d: Mapping[str, Any], where: str = "config.json") -> DecoderConfig:
    """HF config.json dict (or :meth:`DecoderConfig.to_dict`'s form) -> DecoderConfig."""
    if "jsteer_decoder" in d:
        return DecoderConfig.from_dict(d["jsteer_decoder"])
    mt = d.get("model_type")
    if mt not in _TRANSLATE:
        hint = " (the multimodal Gemma-3; jsteer reads the text-only 'gemma3_text')" if mt == "gemma3" else ""
        raise ValueError(f"{where}: model_type {mt!r} is not supported{hint}; decoders: {', '.join(MODEL_TYPES)}")
    if d.get("is_encoder_decoder"):
        _refuse(where, "is_encoder_decoder", True, "decoder-only models")
    if d.get("quantization_config") is not None:
        _refuse(
            where,
            "quantization_config",
            d["quantization_config"].get("quant_method", "?"),
            "jsteer reads unquantised weights (or GGUF files)",
        )
    return DecoderConfig(**_TRANSLATE[mt](d, where))


__all__ = ["MODEL_TYPES", "config_from_hf"]
