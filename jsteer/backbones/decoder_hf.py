"""HF checkpoints of the decoder families -> the param tree of :mod:`jsteer.backbones.decoder`.

:func:`layout` gives {HF tensor name: :class:`~jsteer.convert.layout.Entry`} for a
:class:`~jsteer.backbones.decoder_config.DecoderConfig`: torch Linear weights [out, in] become
kernels [in, ...] (q [D, N, H], k / v [D, K, H], o [N, H, D], MLP [D, F] / [F, D]); fused
tensors (Phi-3's qkv_proj / gate_up_proj, GPT-NeoX's per-head query_key_value, GPT-2's Conv1D
c_attn stored [in, out]) are cut into their pieces. :func:`params_from_hf` reads a state dict
(possibly lazy) through it, scanned-layer configs getting the stacked form.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.convert.layout import Entry, RenamedView, cut, entry, split, transpose


def _proj(n: int, h: int):
    """torch Linear [n*h, D] -> kernel [D, n, h]."""
    return lambda w: w.T.reshape(w.shape[1], n, h)


def _heads(n: int, h: int):
    return lambda b: b.reshape(n, h)


def _out(n: int, h: int):
    """torch Linear [D, n*h] -> kernel [n, h, D]."""
    return lambda w: w.T.reshape(n, h, w.shape[0])


def _norm_entries(out: dict, hf: str, path: tuple, d: int, bias: bool) -> None:
    out[hf + ".weight"] = entry(path + ("scale",), (d,))
    if bias:
        out[hf + ".bias"] = entry(path + ("bias",), (d,))


def _attention_entries(c: DecoderConfig, out: dict, hf: str, me: tuple) -> None:
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    a = me + ("attn",)
    if c.model_type == "phi3":
        q_end, k_end = n * h, n * h + k * h
        out[hf + "qkv_proj.weight"] = Entry(
            (n * h + 2 * k * h, d),
            (
                (a + ("q", "kernel"), cut(0, q_end, then=_proj(n, h))),
                (a + ("k", "kernel"), cut(q_end, k_end, then=_proj(k, h))),
                (a + ("v", "kernel"), cut(k_end, k_end + k * h, then=_proj(k, h))),
            ),
        )
        out[hf + "o_proj.weight"] = entry(a + ("o", "kernel"), (d, n * h), _out(n, h))
        return
    if c.model_type == "gpt_neox":

        def qkv(j, bias=False):  # rows grouped per head as [q, k, v]: [N, 3, H, (D)]
            if bias:
                return lambda b: b.reshape(n, 3, h)[:, j]
            return lambda w: w.reshape(n, 3, h, d)[:, j].transpose(2, 0, 1)

        out[hf + "query_key_value.weight"] = Entry(
            (3 * d, d), tuple((a + (p, "kernel"), qkv(j)) for j, p in enumerate("qkv"))
        )
        out[hf + "dense.weight"] = entry(a + ("o", "kernel"), (d, d), _out(n, h))
        if c.qkv_bias:
            out[hf + "query_key_value.bias"] = Entry(
                (3 * d,), tuple((a + (p, "bias"), qkv(j, True)) for j, p in enumerate("qkv"))
            )
            out[hf + "dense.bias"] = entry(a + ("o", "bias"), (d,))
        return
    if c.model_type == "gpt2":  # Conv1D: [in, out]
        out[hf + "c_attn.weight"] = Entry(
            (d, 3 * d),
            tuple(
                (a + (p, "kernel"), split(j, 3, axis=1, then=lambda w: w.reshape(d, n, h))) for j, p in enumerate("qkv")
            ),
        )
        out[hf + "c_attn.bias"] = Entry(
            (3 * d,), tuple((a + (p, "bias"), split(j, 3, then=_heads(n, h))) for j, p in enumerate("qkv"))
        )
        out[hf + "c_proj.weight"] = entry(a + ("o", "kernel"), (d, d), lambda w: w.reshape(n, h, d))
        out[hf + "c_proj.bias"] = entry(a + ("o", "bias"), (d,))
        return
    for p, heads in (("q", n), ("k", k), ("v", k)):
        out[hf + f"{p}_proj.weight"] = entry(a + (p, "kernel"), (heads * h, d), _proj(heads, h))
        if c.qkv_bias:
            out[hf + f"{p}_proj.bias"] = entry(a + (p, "bias"), (heads * h,), _heads(heads, h))
    out[hf + "o_proj.weight"] = entry(a + ("o", "kernel"), (d, n * h), _out(n, h))
    if c.o_bias:
        out[hf + "o_proj.bias"] = entry(a + ("o", "bias"), (d,))
    if c.qk_norm == "head":
        out[hf + "q_norm.weight"] = entry(a + ("q_norm", "scale"), (h,))
        out[hf + "k_norm.weight"] = entry(a + ("k_norm", "scale"), (h,))
    elif c.qk_norm == "proj":
        out[hf + "q_norm.weight"] = entry(a + ("q_norm", "scale"), (n * h,))
        out[hf + "k_norm.weight"] = entry(a + ("k_norm", "scale"), (k * h,))


def _mlp_entries(c: DecoderConfig, out: dict, hf: str, me: tuple) -> None:
    d, f, m = c.hidden_size, c.intermediate_size, me + ("mlp",)
    if c.model_type == "phi3":
        out[hf + "gate_up_proj.weight"] = Entry(
            (2 * f, d),
            (
                (m + ("gate", "kernel"), split(0, 2, then=transpose)),
                (m + ("up", "kernel"), split(1, 2, then=transpose)),
            ),
        )
        out[hf + "down_proj.weight"] = entry(m + ("down", "kernel"), (d, f), transpose)
        return
    names = {"gpt_neox": ("dense_h_to_4h", "dense_4h_to_h"), "gpt2": ("c_fc", "c_proj")}.get(
        c.model_type, ("up_proj", "down_proj")
    )
    conv1d = c.model_type == "gpt2"
    out[hf + names[0] + ".weight"] = entry(
        m + ("up", "kernel"), (d, f) if conv1d else (f, d), None if conv1d else transpose
    )
    out[hf + names[1] + ".weight"] = entry(
        m + ("down", "kernel"), (f, d) if conv1d else (d, f), None if conv1d else transpose
    )
    if c.mlp == "gated":
        out[hf + "gate_proj.weight"] = entry(m + ("gate", "kernel"), (f, d), transpose)
    if c.mlp_bias:
        out[hf + names[0] + ".bias"] = entry(m + ("up", "bias"), (f,))
        out[hf + names[1] + ".bias"] = entry(m + ("down", "bias"), (d,))
        if c.mlp == "gated":
            out[hf + "gate_proj.bias"] = entry(m + ("gate", "bias"), (f,))


# (prefix of the base model, its layers, final norm, embeddings, position table, output head)
_NAMES = {
    "gpt_neox": ("gpt_neox.", "layers", "final_layer_norm", "embed_in", None, "embed_out"),
    "gpt2": ("transformer.", "h", "ln_f", "wte", "wpe", "lm_head"),
}
# our norm -> HF name, per block layout
_NORMS = {
    "pre": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "parallel": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "sandwich": {
        "attn_norm": "input_layernorm",
        "attn_post_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_post_norm": "post_feedforward_layernorm",
    },
    "post": {"attn_post_norm": "post_attention_layernorm", "ffn_post_norm": "post_feedforward_layernorm"},
}


def layout(c: DecoderConfig) -> dict[str, Entry]:
    """{HF tensor name: Entry} for this config's family (names with the causal-LM class's prefix)."""
    prefix, layers, final, emb, pos, head = _NAMES.get(
        c.model_type, ("model.", "layers", "norm", "embed_tokens", None, "lm_head")
    )
    d, bias = c.hidden_size, c.norm == "layer"
    out = {f"{prefix}{emb}.weight": entry(("embed", "embedding"), (c.vocab_size, d))}
    if pos:
        out[f"{prefix}{pos}.weight"] = entry(("pos_embed", "embedding"), (c.max_position_embeddings, d))
    norms = {"attn_norm": "ln_1", "ffn_norm": "ln_2"} if c.model_type == "gpt2" else _NORMS[c.block]
    for i in range(c.num_layers):
        hf, me = f"{prefix}{layers}.{i}.", (f"layers_{i}",)
        for ours, theirs in norms.items():
            _norm_entries(out, hf + theirs, me + (ours,), d, bias)
        attn = {"gpt_neox": "attention.", "gpt2": "attn."}.get(c.model_type, "self_attn.")
        _attention_entries(c, out, hf + attn, me)
        _mlp_entries(c, out, hf + "mlp.", me)
    _norm_entries(out, f"{prefix}{final}", ("final_norm",), d, bias)
    if c.tie_word_embeddings:  # a tied checkpoint may store the (equal) head: it is not read
        out[f"{head}.weight"] = Entry((c.vocab_size, d), (), optional=True)
    else:
        out[f"{head}.weight"] = entry(("lm_head", "kernel"), (c.vocab_size, d), transpose)
    return out


IGNORED = (
    "*.rotary_emb.inv_freq",
    "*.attn.bias",
    "*.attn.masked_bias",
    "*.attention.bias",
    "*.attention.masked_bias",
    "*.attention.rotary_emb.inv_freq",
)


def state_view(state_dict: Mapping[str, Any], c: DecoderConfig) -> Mapping[str, Any]:
    """The names :func:`layout` expects: checkpoints of the bare base model (without ``model.`` /
    ``gpt_neox.`` ...) get the prefix; GPT-NeoX's head is ``embed_out`` (``lm_head`` in transformers 5)."""
    prefix, *_, head = _NAMES.get(c.model_type, ("model.",) + (None,) * 4 + ("lm_head",))
    bare = not any(k.startswith(prefix) for k in state_dict)
    neox_head = c.model_type == "gpt_neox" and "embed_out.weight" not in state_dict

    def rename(k: str) -> str:
        if neox_head and k == "lm_head.weight":
            return "embed_out.weight"
        return prefix + k if bare and not k.startswith(head + ".") else k

    return RenamedView(state_dict, rename) if bare or neox_head else state_dict


def params_from_hf(
    state_dict: Mapping[str, Any], config: DecoderConfig, *, dtype=np.float32, place=None, source: Any = "state dict"
) -> dict:
    """HF state dict (possibly lazy) -> our param tree, through :func:`layout` and
    :func:`jsteer.convert.layout.apply_layout` (checks, host-side cast to ``dtype``, ``place``)."""
    from jsteer.backbones.decoder_params import stack_layers
    from jsteer.convert.layout import apply_layout

    params = apply_layout(
        state_view(state_dict, config), layout(config), dtype=dtype, place=place, ignore=IGNORED, source=source
    )
    return stack_layers(params, config.num_layers) if config.scan_layers else params


__all__ = ["layout", "params_from_hf", "state_view", "IGNORED"]
