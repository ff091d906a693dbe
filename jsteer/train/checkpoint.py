"""Orbax CheckpointManager wrapper: keep-last-N + keep-best, async save, exact resume.

A checkpoint holds two items:
  * ``state``: the :class:`~jsteer.train.step.TrainState` (trainable fp32 params, optimizer
    state, step, base PRNG key) - restored with the shardings of the running trainer;
  * ``meta``: JSON - the data iterator position, the metrics of that step, free-form extras.
Frozen params are not saved: the method supplies them again when it rebuilds the trainer.

Saves are asynchronous (arrays are copied off the device before ``save`` returns, so the
caller may donate them); a directory only becomes a checkpoint once fully written, so a run
killed mid-save resumes from the previous one.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp

PyTree = Any


class Checkpointer:
    """``Checkpointer(dir, keep=3, best_metric="eval/loss", best_mode="min")``.

    Keeps the last ``keep`` checkpoints plus the ``keep_best`` best ones by ``best_metric``
    (looked up in the metrics passed to :meth:`save`; checkpoints saved without it only count
    as recent).
    """

    def __init__(
        self,
        directory,
        *,
        keep: int = 3,
        best_metric: Optional[str] = None,
        best_mode: str = "min",
        keep_best: int = 1,
        async_save: bool = True,
    ):
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.best_metric = best_metric
        self.best_mode = best_mode
        policies = [ocp.checkpoint_managers.LatestN(n=keep)]
        if best_metric is not None:
            sign = 1.0 if best_mode == "max" else -1.0

            def score(metrics):
                v = metrics.get(best_metric)
                return -math.inf if v is None or not math.isfinite(v) else sign * float(v)

            policies.append(
                ocp.checkpoint_managers.BestN(get_metric_fn=score, n=keep_best, keep_checkpoints_without_metrics=False)
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def best_step(self) -> Optional[int]:
        """Step of the best checkpoint on disk by ``best_metric`` (None without one)."""
        if self.best_metric is None:
            return None
        best, best_v = None, None
        for step in self.all_steps():
            v = (self.metrics(step) or {}).get(self.best_metric)
            if v is None:
                continue
            if best_v is None or (v < best_v if self.best_mode == "min" else v > best_v):
                best, best_v = step, v
        return best

    def metrics(self, step: int) -> Optional[dict]:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        return meta.get("metrics")

    def save(self, step: int, state: PyTree, *, meta: Optional[Mapping] = None, metrics=None, force=True) -> bool:
        """Start saving ``state`` (async). ``metrics``: floats used for keep-best, also stored in meta."""
        metrics = {k: float(v) for k, v in dict(metrics or {}).items()}
        meta = dict(meta or {})
        meta["metrics"] = metrics
        meta["step"] = int(step)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self.manager.save(int(step), args=args, metrics=metrics or None, force=force)

    def restore(self, step: Optional[int], target: PyTree) -> tuple[PyTree, dict]:
        """Restore (state, meta) at ``step`` (None: latest). ``target``: a pytree of arrays or
        ``jax.ShapeDtypeStruct`` with shardings, giving the layout to restore into."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(_abstract, target)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return out.state, dict(out.meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
