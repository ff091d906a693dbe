"""Trainer hooks: what runs after a train step, every N steps and at the end of a run.

A hook is a callable ``fn(info: StepInfo)`` added with :meth:`jsteer.train.Trainer.add_hook`::

    trainer.add_hook(lambda info: print(info.step, info.loss, info.step_duration), every=100)

    @trainer.add_hook(every=500)
    def sample(info):
        generate(info.params)

It fires after each step whose number divides by ``every`` and once at the end of the run (the
step ``num_steps``, or the step a stop was requested at: SIGTERM, :meth:`Trainer.request_stop`,
early stopping), never twice for one step; ``at_end=False`` skips the end. A run whose batches
run out before ``num_steps`` has no end step. Subclasses of :class:`Hook` choose their own steps
by overriding :meth:`Hook.fires`.

The Trainer builds its features from the same hooks, run in this order after each step:
:class:`LogHook` (JSONL line, tqdm postfix, finiteness check; ``log_every``), :class:`EvalHook`
(``eval_fn`` every ``eval_every`` steps and at the last step), :class:`EarlyStopping` (with
``patience``), the hooks added by :meth:`~Trainer.add_hook` in the order added, and
:class:`CheckpointHook` last (``save_every``, every evaluation when ``best_metric`` is kept,
the last step), so a hook that requests a stop still has that step saved.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Optional

import jax

EARLY_STOP = "early stop"


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after step ``step`` (1-based: the number of steps done).

    ``metrics``: the step's device arrays (``loss``, ``grad_norm``, ``lr``, the loss's aux);
    ``batch``: the host rows it trained on; ``stream``: the batch iterator of the run (its
    ``state()`` is the data position a checkpoint records); ``step_duration``: host seconds
    from asking for the batch to the step's return (device time when the trainer has
    ``sync_steps``; else the dispatch time, and a step that waits for the device absorbs the
    ones before it); ``eval``: this step's evaluation (``{"eval/<name>": float}``, filled by
    :class:`EvalHook`; empty at steps without one).
    """

    trainer: Any
    step: int
    num_steps: int
    metrics: Mapping[str, jax.Array]
    batch: Mapping[str, Any]
    stream: Optional[Iterable] = None
    step_duration: float = float("nan")
    eval: dict = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float:
        """The step's loss (waits for the device)."""
        return float(self.metrics["loss"])

    @property
    def params(self):
        """Current params (fp32 trainable merged with frozen)."""
        return self.trainer.params

    @property
    def final(self) -> bool:
        """This is step ``num_steps``, the run's last."""
        return self.step >= self.num_steps

    @property
    def stopping(self) -> bool:
        """A stop was requested: the run ends after this step."""
        return self.trainer.stop_reason is not None

    @property
    def end(self) -> bool:
        return self.final or self.stopping


class Hook:
    """Base of the hooks: fires every ``every`` steps (None: never periodically) and at the end."""

    every: Optional[int] = None
    at_end: bool = True

    def fires(self, info: StepInfo) -> bool:
        return bool(self.every) and info.step % self.every == 0 or (self.at_end and info.end)

    def __call__(self, info: StepInfo) -> None:
        raise NotImplementedError


class FnHook(Hook):
    """A plain function as a hook."""

    def __init__(self, fn: Callable[[StepInfo], Any], every: Optional[int] = 1, at_end: bool = True):
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1 (or None: only at the end), got {every}")
        self.fn, self.every, self.at_end = fn, every, at_end

    def __call__(self, info: StepInfo) -> None:
        self.fn(info)


class LogHook(Hook):
    """One JSONL line of the step's metrics and throughput (:meth:`Trainer.log`), the progress
    bar's postfix, then :meth:`Trainer.check_finite` (the line is the sync that makes it cheap).
    ``last``: the latest line."""

    def __init__(self, every: int = 10):
        self.every = max(int(every), 1)
        self.last: dict = {}

    def __call__(self, info: StepInfo) -> None:
        t = info.trainer
        record = {k: jsonable(v) for k, v in jax.device_get(dict(info.metrics)).items()}
        record.update(t.throughput())
        record["step"] = info.step
        t.log(record)
        self.last = record
        if t.bar is not None:
            t.bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.2e}", refresh=False)
        t.check_finite()


class EvalHook(Hook):
    """``eval_fn(params) -> {name: float}`` every ``every`` steps and at the run's last step
    (not at a stop between evaluations: a preempted job has seconds to save). Sets
    ``info.eval`` to ``{prefix + name: float}`` and logs it."""

    def __init__(self, eval_fn: Callable, every: Optional[int] = None, prefix: str = "eval/"):
        self.eval_fn, self.every, self.prefix = eval_fn, every, prefix

    def fires(self, info: StepInfo) -> bool:
        return bool(self.every) and info.step % self.every == 0 or info.final

    def __call__(self, info: StepInfo) -> None:
        out = {f"{self.prefix}{k}": float(v) for k, v in dict(self.eval_fn(info.params)).items()}
        info.eval.update(out)
        info.trainer.log({"step": info.step, **out})


class EarlyStopping(Hook):
    """Stop when ``metric`` (an evaluation's name, e.g. ``"eval/loss"``) has not improved by
    more than ``min_delta`` for ``patience`` evaluations in a row; the stop saves a checkpoint
    (and keeps the best one when the trainer keeps ``best_metric``). Fires at every step whose
    ``info.eval`` holds ``metric``. ``best`` / ``best_step``: the best value and its step (a new
    trainer, e.g. a resumed run, starts counting afresh)."""

    def __init__(self, metric: str, patience: int, mode: str = "min", min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.metric, self.patience, self.mode, self.min_delta = metric, int(patience), mode, float(min_delta)
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.bad = 0  # evaluations since the best

    def fires(self, info: StepInfo) -> bool:
        return self.metric in info.eval

    def __call__(self, info: StepInfo) -> None:
        v = float(info.eval[self.metric])
        sign = 1.0 if self.mode == "max" else -1.0
        if math.isfinite(v) and (self.best is None or sign * (v - self.best) > self.min_delta):
            self.best, self.best_step, self.bad = v, info.step, 0
            return
        self.bad += 1
        if self.bad >= self.patience and not info.final:
            info.trainer.log(
                {
                    "step": info.step,
                    "event": f"{EARLY_STOP}: {self.metric} not improved for "
                    f"{self.bad} evaluations (best {self.best} at step {self.best_step})",
                }
            )
            info.trainer.request_stop(EARLY_STOP)


class CheckpointHook(Hook):
    """Save every ``every`` steps, at each evaluation when ``keep_best`` (so any evaluation can
    become the best checkpoint) and at the run's last step (waiting for it); the step's
    evaluation, if any, is stored with it. A stop's own save is the trainer's."""

    def __init__(self, every: Optional[int] = None, keep_best: bool = False):
        self.every, self.keep_best = every, keep_best

    def fires(self, info: StepInfo) -> bool:
        return bool(self.every) and info.step % self.every == 0 or info.final or (self.keep_best and bool(info.eval))

    def __call__(self, info: StepInfo) -> None:
        info.trainer.save(info.stream, metrics=info.eval or None, wait=info.final)


def jsonable(v):
    """A float where ``v`` converts to one, else its ``str`` (for JSON lines)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)
