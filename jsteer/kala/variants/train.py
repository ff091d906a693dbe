"""Training and evaluation of every registered method on the KALA harness' engine.

The same objective, optimiser, :class:`jsteer.train.Trainer`, batching and entity-level scores
as :mod:`jsteer.kala.train` -- its :func:`~jsteer.kala.train.fit`,
:func:`~jsteer.kala.train.task_loss` and :func:`~jsteer.kala.train.predict_ner`, given two
things per model:

- :func:`forward`: any registered model on a collated batch (the batch's
  :func:`~jsteer.kala.variants.registry.extra_keys`, e.g. K-BERT's soft positions and tree ids,
  go to the model as ``extras``);
- :func:`batch_keys`: the task's batch keys plus those extra keys.

A model output's ``aux_loss`` (EaE's entity linking) is added to the task loss and its ``aux``
scalars are logged. For KALA's own models (:class:`jsteer.kala.model.KalaModel`) this is
exactly :mod:`jsteer.kala.train`.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jsteer.kala import train as kala_train
from jsteer.kala.model import KalaModel
from jsteer.kala.train import FitResult, TrainConfig, task_keys
from jsteer.kala.variants.registry import extra_keys

__all__ = ["FitResult", "TrainConfig", "batch_keys", "evaluate_ner", "fit", "forward", "loss_fn", "predict_ner"]


def batch_keys(model, task: str = "ner") -> tuple[str, ...]:
    return tuple(task_keys(task)) + extra_keys(model)


def forward(model, params, batch, deterministic: bool = True, rng=None):
    """Model output on a collated batch (any registered method)."""
    if isinstance(model, KalaModel):
        return kala_train.forward(model, params, batch, deterministic, rng)
    graph, token_node = kala_train.model_inputs(model, batch)
    extras = {k: jnp.asarray(batch[k]) for k in extra_keys(model)} or None
    return kala_train.apply_model(model, params, batch, graph, token_node, deterministic, rng, extras=extras)


def loss_fn(model, task: str = "ner") -> Callable:
    """``(params, batch, rng) -> (loss, aux)``: NER token cross-entropy over labelled subwords,
    or QA mean start / end cross-entropy, plus the model's auxiliary loss."""
    return kala_train.task_loss(functools.partial(forward, model), task)


def fit(model, params: dict, examples: Sequence[dict], cfg: TrainConfig, task: str = "ner", **kw) -> FitResult:
    """:func:`jsteer.kala.train.fit` of ``model`` (any registered method; ``kw``: its keyword
    options, log_path, checkpoint_dir, eval_fn, progress, mesh, ...); the returned
    :class:`jsteer.kala.train.FitResult` times steps 2..N (compilation excluded)."""
    return kala_train.fit(
        model, params, examples, cfg, task, loss_fn=loss_fn(model, task), keys=batch_keys(model, task), **kw
    )


def predict_ner(model, params: dict, examples: Sequence[dict], batch_size: int = 64) -> list[np.ndarray]:
    """Per-word predicted label ids for each example (words cut by truncation get 0 = 'O')."""
    return kala_train.predict_ner(
        model, params, examples, batch_size, forward_fn=functools.partial(forward, model), keys=extra_keys(model)
    )


def evaluate_ner(model, params: dict, *args, **kw) -> dict:
    """Entity-level scores in percent, overall and on optional {name: example indices} subsets:
    :func:`jsteer.kala.train.evaluate_ner` of any registered method (its arguments: examples,
    gold_tags, label_names, batch_size, subsets, ...)."""
    return kala_train.evaluate_ner(
        model, params, *args, forward_fn=functools.partial(forward, model), keys=extra_keys(model), **kw
    )
