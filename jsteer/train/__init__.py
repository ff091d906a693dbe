"""jsteer.train: one training engine for every method.

A method supplies ``loss_fn(params, batch, rng) -> (loss, aux)``, its initial params and an
:class:`OptimizerConfig` naming its parameter groups; :class:`Trainer` does the rest
(sharding over a device mesh, bf16 compute with fp32 masters, Orbax checkpoints with exact
resume, progress bar, JSONL metrics, periodic evaluation, early stopping, SIGTERM-safe saving),
each feature a hook (:mod:`jsteer.train.hooks`) beside the caller's own (``trainer.add_hook``).
:func:`fit_logistic` is the full-batch logistic probe (:mod:`jsteer.train.probe`).
"""

from jsteer.train.checkpoint import Checkpointer
from jsteer.train.hooks import CheckpointHook, EarlyStopping, EvalHook, Hook, LogHook, StepInfo
from jsteer.train.loop import FitResult, Trainer
from jsteer.train.optim import OptimizerConfig, combine, make_optimizer, make_schedule, partition, resolve_labels
from jsteer.train.step import TrainState, cast_floating, data_mesh, global_batch, make_train_step

__all__ = [
    "CheckpointHook",
    "Checkpointer",
    "EarlyStopping",
    "EvalHook",
    "FitResult",
    "Hook",
    "LogHook",
    "OptimizerConfig",
    "StepInfo",
    "TrainState",
    "Trainer",
    "cast_floating",
    "combine",
    "data_mesh",
    "global_batch",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "partition",
    "resolve_labels",
]
