"""HF checkpoints of the BERT-family encoders -> the param tree of :mod:`jsteer.backbones.bert`.

:func:`params_from_hf` reads a state dict (name -> [out, in] arrays, possibly lazy) through one
layout table ({HF tensor name: :class:`~jsteer.convert.layout.Entry`}): the encoder's tensors
under a ``bert.`` / ``roberta.`` / no prefix, and the asked-for head's tensors unprefixed. q / k / v
weights [D, D] land as [D, N, H] pieces and are stacked into the fused qkv kernel [D, 3, N, H]
(biases [3, N, H]); attention output [D, D] becomes [N, H, D]; other linear weights are
transposed to [in, out]. Old spellings (TF LayerNorm ``gamma`` / ``beta``, an MLM head's bias
alias) are read under today's names.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import jax
import jax.numpy as jnp

from jsteer.backbones.bert import BertConfig
from jsteer.backbones.bert_heads import HEADS, init_head
from jsteer.convert.layout import Entry, RenamedView, apply_layout, entry, transpose

_QKV = ("query", "key", "value")
# Expected in HF checkpoints and unused: buffers, the pooler, and heads other than the one asked
# for (a head's own tensors are layout entries, so only the leftovers match these).
_IGNORED = (
    "*position_ids",
    "*embeddings.token_type_ids",
    "*pooler.*",
    "cls.*",
    "lm_head.*",
    "classifier.*",
    "qa_outputs.*",
)


_OLD_NAMES = (
    (".LayerNorm.gamma", ".LayerNorm.weight"),
    (".LayerNorm.beta", ".LayerNorm.bias"),
    ("cls.predictions.bias", "cls.predictions.decoder.bias"),
    ("lm_head.bias", "lm_head.decoder.bias"),
)


def _aliases(state_dict: Mapping[str, Any]) -> RenamedView:
    """``state_dict`` with old spellings read under today's names (reads stay lazy): TF-converted
    checkpoints' LayerNorm ``gamma`` / ``beta``, and an MLM head's ``<base>bias``, the tied alias
    of ``<base>decoder.bias`` and the only copy in some checkpoints (when both exist the decoder's,
    the one HF uses, wins and the alias is left to the ignore list)."""

    def rename(k: str) -> str:
        for old, new in _OLD_NAMES:
            if k.endswith(old) and (canon := k[: -len(old)] + new) not in state_dict:
                return canon
        return k

    return RenamedView(state_dict, rename)


def _detect_prefix(state_dict: Mapping[str, Any], config: BertConfig) -> str:
    order = ("roberta.", "bert.", "") if config.layout == "roberta" else ("bert.", "roberta.", "")
    for p in order:
        if p + "embeddings.word_embeddings.weight" in state_dict:
            return p
    raise KeyError(
        "HF state dict is missing tensor 'embeddings.word_embeddings.weight' (tried prefixes "
        f"{[p for p in order]}); first keys: {list(state_dict)[:5]}"
    )


def _bert_layout(
    config: BertConfig, prefix: str, head: Optional[str], num_labels: Optional[int] = None
) -> Dict[str, Entry]:
    """{HF tensor name: Entry} for the encoder (names under ``prefix``) and ``head`` (unprefixed).

    The q / k / v projections land in ``.../qkv/{kernel,bias}/{query,key,value}`` as [D, N, H] /
    [N, H] pieces, stacked into the fused [D, 3, N, H] / [3, N, H] leaves by :func:`_fuse_qkv`."""
    c = config
    d, f, n, hd, v = c.hidden_size, c.intermediate_size, c.num_heads, c.head_dim, c.vocab_size
    out: Dict[str, Entry] = {}

    def linear(name, path, d_in, d_out, w_fn=transpose, b_fn=None, w_path=("kernel",), b_path=("bias",)):
        out[name + ".weight"] = entry(path + w_path, (d_out, d_in), w_fn)
        out[name + ".bias"] = entry(path + b_path, (d_out,), b_fn)

    def norm(name, path):
        out[name + ".weight"] = entry(path + ("scale",), (d,))
        out[name + ".bias"] = entry(path + ("bias",), (d,))

    p, emb = prefix, ("encoder", "embeddings")
    out[p + "embeddings.word_embeddings.weight"] = entry(emb + ("word", "embedding"), (v, d))
    out[p + "embeddings.position_embeddings.weight"] = entry(
        emb + ("position", "embedding"), (c.max_position_embeddings, d)
    )
    out[p + "embeddings.token_type_embeddings.weight"] = entry(
        emb + ("token_type", "embedding"), (c.type_vocab_size, d)
    )
    norm(p + "embeddings.LayerNorm", emb + ("norm",))
    for i in range(c.num_layers):
        hf, me = f"{p}encoder.layer.{i}.", ("encoder", f"layer_{i}")
        for name in _QKV:
            linear(
                hf + f"attention.self.{name}",
                me + ("attention", "qkv"),
                d,
                d,
                w_fn=lambda w: w.T.reshape(d, n, hd),
                b_fn=lambda b: b.reshape(n, hd),
                w_path=("kernel", name),
                b_path=("bias", name),
            )
        linear(hf + "attention.output.dense", me + ("attention", "out"), d, d, w_fn=lambda w: w.T.reshape(n, hd, d))
        norm(hf + "attention.output.LayerNorm", me + ("attention_norm",))
        linear(hf + "intermediate.dense", me + ("ffn_in",), d, f)
        linear(hf + "output.dense", me + ("ffn_out",), f, d)
        norm(hf + "output.LayerNorm", me + ("ffn_norm",))
    if head == "mlm":
        roberta = c.layout == "roberta"
        base = "lm_head." if roberta else "cls.predictions."
        linear(base + ("dense" if roberta else "transform.dense"), ("head", "transform"), d, d)
        norm(base + ("layer_norm" if roberta else "transform.LayerNorm"), ("head", "norm"))
        out[base + "decoder.bias"] = entry(("head", "bias"), (v,))
        if not c.tie_word_embeddings:
            out[base + "decoder.weight"] = entry(("head", "decoder", "kernel"), (v, d), transpose)
    elif head == "token_classification":
        linear("classifier", ("head", "classifier"), d, c.num_labels if num_labels is None else num_labels)
    elif head == "qa":
        linear("qa_outputs", ("head", "qa"), d, 2)
    elif head is not None:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
    return out


def _fuse_qkv(params: Dict[str, Any], config: BertConfig) -> None:
    """Stack each layer's q / k / v pieces into the fused leaves (in place)."""
    for i in range(config.num_layers):
        qkv = params["encoder"][f"layer_{i}"]["attention"]["qkv"]
        qkv["kernel"] = jnp.stack([qkv["kernel"][k] for k in _QKV], axis=1)
        qkv["bias"] = jnp.stack([qkv["bias"][k] for k in _QKV], axis=0)


def params_from_hf(
    state_dict: Mapping[str, Any],
    config: BertConfig,
    head: Optional[str] = None,
    *,
    num_labels: Optional[int] = None,
    allow_missing_head: bool = False,
    rng: Optional[jax.Array] = None,
    dtype: Any = jnp.float32,
) -> Dict[str, Any]:
    """HF PyTorch / safetensors state dict (name -> array) -> ``{"encoder": ..., ["head": ...]}``.

    Keys may carry a ``bert.`` / ``roberta.`` prefix or none (MiniLM). ``position_ids``
    buffers, pooler and unrelated head weights are ignored; any other tensor the config does not
    explain is a ValueError naming it. Every tensor's shape is checked against ``config``
    (ValueError naming the tensor); a missing tensor is a KeyError naming it. With
    ``allow_missing_head`` a head absent from the state dict is initialised from ``rng``
    (default PRNGKey(0)) instead. Tensors are read one at a time (``state_dict`` may be lazy),
    cast to ``dtype`` on the host and placed as jax arrays.
    """
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
    sd = _aliases(state_dict)
    prefix = _detect_prefix(sd, config)
    if config.num_layers and f"{prefix}encoder.layer.{config.num_layers}.attention.self.query.weight" in sd:
        raise ValueError(
            f"HF state dict has more layers than config.num_layers={config.num_layers} "
            f"(found '{prefix}encoder.layer.{config.num_layers}.*')"
        )
    layout = _bert_layout(config, prefix, head, num_labels)
    missing = [name for name in layout if name not in sd]
    fresh_head = False
    if missing:
        in_head = layout[missing[0]].outputs[0][0][0] == "head"
        if not (in_head and allow_missing_head):
            raise KeyError(f"HF state dict is missing tensor {missing[0]!r}")
        layout = {k: e for k, e in layout.items() if e.outputs[0][0][0] != "head"}
        fresh_head = True
    params = apply_layout(sd, layout, dtype=dtype, ignore=_IGNORED, source="HF state dict")
    _fuse_qkv(params, config)
    if fresh_head:
        rng = jax.random.PRNGKey(0) if rng is None else rng
        params["head"] = jax.tree.map(lambda x: x.astype(dtype), init_head(rng, config, head, num_labels))
    return params
