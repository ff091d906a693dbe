"""Every knowledge-integration method of the KALA harness, selectable by name.

    METHODS = ("finetune", "more_params", "pointwise", "relational",   # jsteer.kala.model
               "ernie", "kbert", "eae", "adapter")                     # jsteer.kala.variants

    model  = build_model("ernie", bert_config, task="ner", num_labels=9, num_entities=len(vocab))
    params = init_params(model, rng, encoder_params=..., head_params=..., memory=...)
    enc    = encode_ner("kbert", words, tags, mentions, tokenizer, labels, vocab, kg)   # per method
    keys   = extra_keys(model)        # batch keys a method needs beyond the harness' own

Training / evaluation for all of them: :mod:`jsteer.kala.variants.train`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones.bert import BertConfig
from jsteer.kala import data as kdata
from jsteer.kala.model import METHODS as KALA_METHODS
from jsteer.kala.model import KalaConfig, KalaModel
from jsteer.kala.model import init_params as kala_init_params
from jsteer.kala.variants import kbert
from jsteer.kala.variants.adapter import AdapterModel
from jsteer.kala.variants.common import VARIANT_METHODS, VariantConfig
from jsteer.kala.variants.eae import EaeModel
from jsteer.kala.variants.ernie import ErnieModel
from jsteer.kala.variants.kbert import KBertModel

VARIANTS = {"ernie": ErnieModel, "kbert": KBertModel, "eae": EaeModel, "adapter": AdapterModel}
METHODS = tuple(KALA_METHODS) + VARIANT_METHODS
EXTRA_KEYS = {"kbert": kbert.TREE_KEYS}
_KALA_FIELDS = {f.name for f in dataclasses.fields(KalaConfig)}
_VARIANT_FIELDS = {f.name for f in dataclasses.fields(VariantConfig)}


def build_model(
    method: str,
    config: BertConfig,
    *,
    task: str = "ner",
    num_labels: int = 2,
    num_entities: int = 1,
    layers: Optional[Sequence[int]] = None,
    **options,
):
    """The task model of ``method``. ``options`` are :class:`KalaConfig` fields for KALA's own
    methods and :class:`VariantConfig` fields for the variants; others are an error."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    lay = None if layers is None else tuple(layers)
    if method in KALA_METHODS:
        bad = sorted(set(options) - _KALA_FIELDS)
        if bad:
            raise ValueError(f"method {method!r} does not take options {bad}")
        return KalaModel(
            config,
            KalaConfig(method=method, layers=lay, num_entities=num_entities, **options),
            task=task,
            num_labels=num_labels,
        )
    bad = sorted(set(options) - _VARIANT_FIELDS)
    if bad:
        raise ValueError(f"method {method!r} does not take options {bad}")
    cfg = VariantConfig(method=method, layers=lay, num_entities=num_entities, **options)
    return VARIANTS[method](config, cfg, task=task, num_labels=num_labels)


def method_of(model) -> str:
    return model.kala.method


def extra_keys(model) -> tuple[str, ...]:
    """Per-token batch keys the model reads beyond the harness' (collated like input_ids)."""
    return tuple(EXTRA_KEYS.get(method_of(model), ()))


def encode_ner(
    method: str,
    words,
    tags,
    mentions,
    tokenizer,
    label_names,
    vocab,
    kg=None,
    max_len: int = 128,
    max_neighbors: int = 8,
    **options,
) -> dict:
    """One sentence encoded for ``method``: the harness' encoding, plus the sentence tree for
    K-BERT (``options``: :func:`jsteer.kala.variants.kbert.encode_ner` keywords)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    if method == "kbert":
        return kbert.encode_ner(
            words, tags, mentions, tokenizer, label_names, vocab, kg, max_len, max_neighbors, **options
        )
    if options:
        raise ValueError(f"method {method!r} takes no encoding options, got {sorted(options)}")
    return kdata.encode_ner(words, tags, mentions, tokenizer, label_names, vocab, kg, max_len, max_neighbors)


def init_params(
    model,
    rng: jax.Array,
    encoder_params: Optional[dict] = None,
    head_params: Optional[dict] = None,
    memory=None,
    seq_len: int = 8,
) -> dict:
    """Fresh params; optionally overwrite the encoder / head with pretrained trees and the
    entity memory (``params["kala"]["memory"]``) with e.g. :func:`jsteer.kala.entities.init_memory`."""
    if isinstance(model, KalaModel):
        return kala_init_params(model, rng, encoder_params, head_params, memory, seq_len)
    from jsteer.kala.graph import ExampleGraph, batch_graphs

    ids = jnp.zeros((1, seq_len), jnp.int32)
    graph, tn = batch_graphs([ExampleGraph.empty()], np.full((1, seq_len), -1, np.int32))
    extras = {k: jnp.zeros((1, seq_len), jnp.int32) for k in extra_keys(model)} or None
    params = model.init(
        {"params": rng, "dropout": rng}, ids, jnp.ones_like(ids), None, graph, jnp.asarray(tn), extras=extras
    )["params"]
    params = dict(params)
    if encoder_params is not None:
        if jax.tree.map(jnp.shape, params["encoder"]) != jax.tree.map(jnp.shape, encoder_params):
            raise ValueError("encoder params do not match the model's BertEncoder tree (shapes/names differ)")
        params["encoder"] = jax.tree.map(jnp.asarray, encoder_params)
    if head_params is not None:
        if jax.tree.map(jnp.shape, params["head"]) != jax.tree.map(jnp.shape, head_params):
            raise ValueError("head params do not match the model's head tree (shapes/names differ)")
        params["head"] = jax.tree.map(jnp.asarray, head_params)
    if memory is not None:
        if "kala" not in params or "memory" not in params["kala"]:
            raise ValueError(f"method {method_of(model)!r} has no entity memory")
        kala = dict(params["kala"])
        if tuple(np.shape(memory)) != tuple(kala["memory"].shape):
            raise ValueError(f"memory has shape {tuple(np.shape(memory))}, expected {tuple(kala['memory'].shape)}")
        kala["memory"] = jnp.asarray(memory)
        params["kala"] = kala
    return params
