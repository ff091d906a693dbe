"""Training and evaluation of every registered method on the KALA harness' engine.

The same objective, optimiser (:func:`jsteer.kala.train.optimizer_config`: ``lr`` for the
backbone / head, ``kala_lr`` for ``params["kala"]``), :class:`jsteer.train.Trainer`, batching
(:func:`jsteer.kala.data.batches`) and entity-level scores as :mod:`jsteer.kala.train`, with
two generalisations:

- batches also carry the model's :func:`~jsteer.kala.variants.registry.extra_keys` (K-BERT's
  soft positions and tree ids), passed to the model as ``extras``;
- a model output's ``aux_loss`` (EaE's entity linking) is added to the task loss, and its
  ``aux`` scalars are logged.

For KALA's own models (:class:`jsteer.kala.model.KalaModel`) this computes exactly what
:mod:`jsteer.kala.train` computes.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jsteer.data import ner as ner_lib
from jsteer.kala import data as kdata
from jsteer.kala import train as kala_train
from jsteer.kala.metrics import ner_report
from jsteer.kala.model import KalaModel
from jsteer.kala.train import FitResult, TrainConfig, count_params, optimizer_config, task_keys
from jsteer.kala.variants.registry import extra_keys
from jsteer.train import Trainer, data_mesh

__all__ = ["FitResult", "TrainConfig", "batch_keys", "evaluate_ner", "fit", "forward", "loss_fn", "predict_ner"]


def batch_keys(model, task: str = "ner") -> tuple[str, ...]:
    return tuple(task_keys(task)) + extra_keys(model)


def forward(model, params, batch, deterministic: bool = True, rng=None):
    """Model output on a collated batch (any registered method)."""
    if isinstance(model, KalaModel):
        return kala_train.forward(model, params, batch, deterministic, rng)
    graph, token_node = kala_train.model_inputs(model, batch)
    extras = {k: jnp.asarray(batch[k]) for k in extra_keys(model)} or None
    rngs = None if deterministic else {"dropout": rng}
    return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"),
                       graph, token_node, deterministic=deterministic, extras=extras, rngs=rngs)


def _with_aux(out, loss, aux):
    extra = getattr(out, "aux_loss", None)
    if extra is not None:
        loss = loss + extra
        aux = {**aux, "aux_loss": extra, **(getattr(out, "aux", None) or {})}
    return loss, aux


def loss_fn(model, task: str = "ner") -> Callable:
    """``(params, batch, rng) -> (loss, aux)``: NER token cross-entropy over labelled subwords,
    or QA mean start / end cross-entropy, plus the model's auxiliary loss."""

    def ner(params, batch, rng):
        out = forward(model, params, batch, False, rng)
        labels = batch["labels"]
        valid = labels != ner_lib.IGNORE_INDEX
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, jnp.maximum(labels, 0))
        loss = jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)
        return _with_aux(out, loss, {"labelled_tokens": jnp.sum(valid)})

    def qa(params, batch, rng):
        out = forward(model, params, batch, False, rng)
        lg = jnp.where((batch["attention_mask"] > 0)[..., None], out.logits, -1e9)
        ls = optax.softmax_cross_entropy_with_integer_labels(lg[..., 0], batch["start_positions"])
        le = optax.softmax_cross_entropy_with_integer_labels(lg[..., 1], batch["end_positions"])
        real = batch["example_mask"].astype(jnp.float32)
        loss = jnp.sum((ls + le) / 2 * real) / jnp.maximum(jnp.sum(real), 1)
        return _with_aux(out, loss, {"examples": jnp.sum(real)})

    if task not in ("ner", "qa"):
        raise ValueError(f"task must be 'ner' or 'qa', got {task!r}")
    return ner if task == "ner" else qa


def fit(model, params: dict, examples: Sequence[dict], cfg: TrainConfig, task: str = "ner", *, log_path=None,
        checkpoint_dir=None, eval_fn=None, eval_every=None, progress: bool = False, measure_memory: bool = False,
        mesh=None) -> FitResult:
    """Train ``model`` on encoded examples for ``cfg.epochs`` (or ``cfg.max_steps``); the
    returned :class:`jsteer.kala.train.FitResult` times steps 2..N (compilation excluded)."""
    loss = loss_fn(model, task)
    total = cfg.total_steps(len(examples))
    trainer = Trainer(loss, params, optimizer_config(cfg, total), mesh=mesh or data_mesh(jax.devices()[:1]),
                      checkpoint_dir=checkpoint_dir, log_path=log_path, eval_fn=eval_fn, eval_every=eval_every,
                      log_every=max(total // 20, 1), seed=cfg.seed, progress=progress, exit_on_preempt=False)
    losses, marks = [], []

    def on_step(step, metrics):
        losses.append(float(metrics["loss"]))  # syncs, so the marks time finished steps
        marks.append(time.perf_counter())

    t0 = time.perf_counter()
    stream = kala_train._Endless.for_model(model, examples, cfg, task, batch_keys(model, task))
    summary = trainer.fit(stream, total, on_step=on_step)
    mem = None
    if measure_memory:
        first = next(iter(stream))
        mem = kala_train.step_memory_bytes(loss, trainer.params, first, cfg, total)
    n = len(marks)
    train_s = marks[-1] - marks[0] if n > 1 else float("nan")
    return FitResult(params=trainer.params, losses=losses, train_seconds=train_s,
                     compile_seconds=(marks[0] - t0) if marks else float("nan"), steps=n,
                     examples_per_second=(n - 1) * cfg.batch_size / train_s if n > 1 else float("nan"),
                     step_memory_bytes=mem, trainable_params=count_params(params),
                     median_step_seconds=float(np.median(np.diff(marks))) if n > 1 else float("nan"),
                     preempted=bool(summary["preempted"]))


def predict_ner(model, params: dict, examples: Sequence[dict], batch_size: int = 64) -> list[np.ndarray]:
    """Per-word predicted label ids for each example (words cut by truncation get 0 = 'O')."""
    logits_fn = jax.jit(lambda p, b: forward(model, p, b).logits)
    preds: list = [None] * len(examples)
    keys = batch_keys(model, "ner") + ("word_index",)
    for idx, batch in kdata.batches(examples, batch_size, keys=keys):
        wi = batch["word_index"]
        arg = np.asarray(jnp.argmax(logits_fn(params, kdata.device_batch(batch, model.kala.uses_knowledge)), -1))
        for r, i in enumerate(idx):
            preds[i] = ner_lib.word_predictions(arg[r], wi[r], examples[i]["num_words"], fill=0)
    return preds


def evaluate_ner(model, params: dict, examples: Sequence[dict], gold_tags: Sequence[Sequence[str]],
                 label_names: Sequence[str], batch_size: int = 64, subsets: Optional[dict] = None) -> dict:
    """Entity-level scores in percent (as :func:`jsteer.kala.train.evaluate_ner`), overall and
    on optional {name: example indices} subsets."""
    preds = predict_ner(model, params, examples, batch_size)
    return ner_report(gold_tags, [[label_names[int(p)] for p in ps] for ps in preds], subsets)
