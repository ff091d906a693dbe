"""The Trainer: one loop for every jsteer method.

A method supplies ``loss_fn(params, batch, rng) -> (loss, aux)`` (aux: dict of scalars),
the initial params pytree and an :class:`~jsteer.train.optim.OptimizerConfig` whose
``labels`` / ``learning_rate`` name the trainable groups (``None`` lr = frozen)::

    trainer = Trainer(loss_fn, params, OptimizerConfig(learning_rate=1e-3),
                      precision="bf16", checkpoint_dir="runs/x", log_path="runs/x/log.jsonl",
                      eval_fn=lambda p: {"acc": ...}, eval_every=200, best_metric="eval/acc",
                      best_mode="max", patience=5)
    trainer.add_hook(lambda info: print(info.step, info.loss), every=100)
    result = trainer.fit(batches, num_steps=1000)   # resumes from runs/x if it holds a checkpoint
    params = trainer.params                          # trainable (fp32) merged with frozen

``batches`` is any iterator of dicts of host arrays with a leading batch axis (each host
gives its own rows). If it has ``state()`` / ``set_state(state)`` (like
:class:`jsteer.data.batching.Batcher`) its position is checkpointed and restored; resuming
from a checkpoint without a data position restarts the data from its beginning, which
``fit`` warns about (``nonresumable_data``).

After each step the hooks run (:mod:`jsteer.train.hooks`: logging, evaluation, early
stopping, the caller's, checkpoints; each every N steps and at the end), and the step's
duration joins ``step_times``.

A step whose loss or gradient norm is not finite stops the run with ``FloatingPointError``
at the next log line or save, whichever comes first: no checkpoint is written from it.

Logging: a :mod:`jsteer.progress` bar (step rate, ETA, loss) and, with ``log_path``, one JSON line per
``log_every`` steps (``step, loss, lr, grad_norm, examples_per_s, tokens_per_s, ...``; the
token count is the loss's ``aux["tokens"]`` when it has one, else the batch's
``attention_mask`` / ``mask`` sum or ``input_ids`` / ``ids`` size) and
one per evaluation (``eval/<name>``). SIGTERM (preemption) finishes the current step, saves a
checkpoint, waits for it and exits with status 143.
"""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.train import hooks as hooks_lib
from jsteer.train import optim
from jsteer.train import step as step_lib
from jsteer.train.checkpoint import Checkpointer
from jsteer.train.hooks import StepInfo, jsonable

PyTree = Any
EXIT_PREEMPTED = 143  # 128 + SIGTERM
_STEP_CACHE: dict = {}
_STEP_CACHE_SIZE = 8
_FINITE_FOLD = 256  # unchecked per-step finiteness flags kept before folding them into one
NONRESUMABLE_DATA = ("warn", "allow", "raise")


class FitResult(dict):
    """Final summary: ``step``, ``preempted`` (bool: stopped by SIGTERM or :meth:`Trainer.request_stop`),
    ``early_stopped`` (bool), ``last`` (last logged metrics), ``eval`` (last evaluation)."""


class Trainer:
    """Sharded, mixed-precision, checkpointed training of ``loss_fn`` over ``params``.

    Args:
      loss_fn: ``(params, batch, rng) -> (loss [], aux dict of scalars)``; jit-able.
      params: initial params pytree (all groups, frozen included).
      optimizer: :class:`OptimizerConfig`.
      mesh: device mesh with a ``"data"`` axis (and optionally ``"fsdp"`` / ``"tensor"``:
        :func:`jsteer.sharding.make_mesh`); None = every device on "data".
      rules / axes: shard the params over the mesh (:mod:`jsteer.sharding`): ``axes`` is a tree of
        logical axis names matching ``params`` (None leaves replicated), or "auto" for every
        backbone found in ``params`` (:func:`jsteer.sharding.infer_axes`); ``rules`` a preset
        ("dp", "fsdp", "tp", "fsdp_tp") or a dict. Optimizer state follows the params. None
        (default): every param replicated.
      precision: "fp32" or "bf16" (bf16 compute, fp32 master params; frozen params are
        stored in bf16 once).
      checkpoint_dir: Orbax directory; a later ``fit`` resumes from its latest checkpoint.
      keep / best_metric / best_mode: keep the last ``keep`` checkpoints and the best one by
        ``best_metric`` (a logged name such as ``"eval/loss"``); with ``best_metric`` every
        evaluation step is also saved, so each evaluation can become the best checkpoint.
      patience: early stopping: stop (saving a checkpoint) after ``patience`` evaluations
        without a better ``best_metric`` (:class:`~jsteer.train.hooks.EarlyStopping`).
      save_every: save every N steps (default: ``eval_every``); a final save always happens.
      log_path: JSONL metrics file (appended; only process 0 writes).
      eval_fn: ``params -> {name: float}``, run every ``eval_every`` steps and at the end.
      log_every: steps between metric lines (each costs a device sync).
      sync_steps: wait for each step's loss, so ``step_times`` are device times (a step's
        host work then no longer overlaps the previous step's device work).
      shard_opt_state: split optimizer state over the data axis.
      seed: base PRNG seed (step s gets ``fold_in(key(seed), s)``).
      progress: show the :mod:`jsteer.progress` bar (off under ``jsteer --quiet`` / ``JSTEER_QUIET=1``).
      exit_on_preempt: on SIGTERM save then ``sys.exit(143)`` (else ``fit`` returns
        ``preempted=True``).
    """

    def __init__(
        self,
        loss_fn: Callable,
        params: PyTree,
        optimizer: optim.OptimizerConfig,
        *,
        mesh=None,
        precision: str = "fp32",
        checkpoint_dir=None,
        keep: int = 3,
        best_metric: Optional[str] = None,
        best_mode: str = "min",
        patience: Optional[int] = None,
        save_every: Optional[int] = None,
        async_save: bool = True,
        log_path=None,
        eval_fn: Optional[Callable[[PyTree], Mapping[str, float]]] = None,
        eval_every: Optional[int] = None,
        log_every: int = 10,
        shard_opt_state: bool = False,
        rules: Any = "dp",
        axes: Any = None,
        seed: int = 0,
        progress: bool = True,
        exit_on_preempt: bool = True,
        sync_steps: bool = False,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh if mesh is not None else step_lib.data_mesh()
        if step_lib.DATA_AXIS not in self.mesh.axis_names:
            raise ValueError(f"mesh needs an axis named {step_lib.DATA_AXIS!r}, has {self.mesh.axis_names}")
        self.dtype = step_lib.compute_dtype(precision)
        self.precision = precision
        self.eval_fn = eval_fn
        self.eval_every = eval_every
        self.save_every = save_every if save_every is not None else eval_every
        self.log_every = max(int(log_every), 1)
        self.log_path = pathlib.Path(log_path) if log_path is not None else None
        self.progress = progress
        self.exit_on_preempt = exit_on_preempt
        self.best_metric = best_metric
        self.sync_steps = sync_steps
        self.stop_reason: Optional[str] = None
        self.step_times: list[float] = []  # seconds of each step of the latest fit (see StepInfo.step_duration)
        self.bar = None  # the progress bar during fit
        self._window = _Window()
        self._log_hook = hooks_lib.LogHook(self.log_every)
        self.hooks: list[hooks_lib.Hook] = [self._log_hook]
        if eval_fn is not None:
            self.hooks.append(hooks_lib.EvalHook(eval_fn, eval_every))
        if patience is not None:
            if best_metric is None:
                raise ValueError("patience (early stopping) needs a best_metric to watch")
            self.hooks.append(hooks_lib.EarlyStopping(best_metric, patience, best_mode))
        self._checkpoint_hook = hooks_lib.CheckpointHook(self.save_every, keep_best=best_metric is not None)

        labels = optim.resolve_labels(params, optimizer)
        self.mask = optim.trainable_mask(labels, optimizer, params)
        self.labels = labels
        trainable, frozen = optim.partition(params, self.mask)
        self._trainable_labels, _ = optim.partition(labels, self.mask)
        # Fresh copies: the step donates the state, which must never free the caller's arrays.
        trainable = jax.tree.map(lambda x: jnp.array(x, jnp.float32 if _is_float(x) else None, copy=True), trainable)
        frozen = step_lib.cast_floating(jax.tree.map(jnp.asarray, frozen), self.dtype)

        rep = step_lib.replicated(self.mesh)
        if axes is None:
            param_shardings = jax.tree.map(lambda _: rep, params)
        else:
            from jsteer import sharding

            axes = sharding.infer_axes(params) if isinstance(axes, str) and axes == "auto" else axes
            param_shardings = sharding.shardings(params, axes, self.mesh, rules)
        trainable_shardings, self._frozen_shardings = optim.partition(param_shardings, self.mask)
        self.frozen = jax.device_put(frozen, self._frozen_shardings)

        tx, _ = optim.make_optimizer(optimizer, self._trainable_labels, optimizer.total_steps or 1)
        if axes is None:
            opt_state = tx.init(trainable)
        else:  # initialised on the mesh: XLA gives each moment its param's sharding, counters replicated
            trainable = jax.device_put(trainable, trainable_shardings)
            opt_state = jax.jit(tx.init)(trainable)
        state = step_lib.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=trainable,
            opt_state=opt_state,
            rng=jax.random.key_data(jax.random.key(seed)),
        )
        if axes is None:
            opt_shardings = step_lib.opt_state_shardings(opt_state, self.mesh, shard_opt_state)
        else:  # moments as XLA placed them (with their params); counters made without an input: replicated

            def placed(x):
                s = x.sharding
                return s if isinstance(s, jax.sharding.NamedSharding) and s.mesh == self.mesh else rep

            opt_shardings = jax.tree.map(placed, opt_state)
        self._state_shardings = step_lib.TrainState(
            step=rep,
            params=trainable_shardings,
            opt_state=opt_shardings,
            rng=rep,
        )
        self.state = jax.device_put(state, self._state_shardings)
        self._step_fn = None
        self._step_total = None
        # (finite flag [] on device, steps it covers) of the steps not yet checked on the host
        self._unchecked: list[tuple[jax.Array, int]] = []

        self.checkpointer = (
            Checkpointer(checkpoint_dir, keep=keep, best_metric=best_metric, best_mode=best_mode, async_save=async_save)
            if checkpoint_dir is not None
            else None
        )

    # ------------------------------------------------------------------ accessors

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    @property
    def params(self) -> PyTree:
        """Current params: fp32 trainable merged with frozen."""
        return optim.combine(self.mask, self.state.params, self.frozen)

    @property
    def num_compilations(self) -> int:
        """Distinct programs compiled for the train step (one per batch shape; shared by
        trainers built from the same loss_fn and optimizer objects)."""
        return 0 if self._step_fn is None else self._step_fn._cache_size()

    def num_trainable(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))

    def request_stop(self, reason: str = "requested") -> None:
        """Stop after the current step, saving a checkpoint (what SIGTERM does)."""
        self.stop_reason = reason

    def add_hook(self, fn=None, *, every: Optional[int] = 1, at_end: bool = True):
        """Run ``fn(info: StepInfo)`` after every ``every``-th step and at the run's end (see
        :mod:`jsteer.train.hooks`); a :class:`~jsteer.train.hooks.Hook` instance is added as
        it is. Returns ``fn``, so it also decorates: ``@trainer.add_hook(every=100)``."""
        if fn is None:
            return lambda f: self.add_hook(f, every=every, at_end=at_end)
        self.hooks.append(fn if isinstance(fn, hooks_lib.Hook) else hooks_lib.FnHook(fn, every, at_end))
        return fn

    # ------------------------------------------------------------------ step

    def step_fn(self, total_steps: Optional[int] = None):
        """The jitted train step ``(state, frozen, batch) -> (state, metrics)`` (``state``
        donated; ``batch``: global arrays, :func:`~jsteer.train.step.global_batch`), for a run
        of ``total_steps`` (the lr schedule's length unless the optimizer names one)."""
        total = self.optimizer.total_steps or total_steps or 1
        if self._step_fn is None or self._step_total != total:
            # Trainers built from the same loss_fn / optimizer objects and layout share one
            # jitted step (and its compiled programs), e.g. a resumed run in the same process.
            key = (
                id(self.loss_fn),
                id(self.optimizer),
                total,
                str(self.dtype),
                self.mesh,
                jax.tree.structure(self.labels),
                tuple(jax.tree.leaves(self.labels)),
                jax.tree.structure(self._state_shardings),
                tuple(jax.tree.leaves(self._state_shardings)),
                tuple(jax.tree.leaves(self._frozen_shardings)),
            )
            hit = _STEP_CACHE.get(key)
            if hit is not None and hit[0] is self.loss_fn and hit[1] is self.optimizer:
                self._step_fn = hit[2]
            else:
                tx, schedules = optim.make_optimizer(self.optimizer, self._trainable_labels, total)
                self._step_fn = step_lib.make_train_step(
                    self.loss_fn,
                    tx,
                    self.mask,
                    schedules,
                    mesh=self.mesh,
                    state_shardings=self._state_shardings,
                    frozen_shardings=self._frozen_shardings,
                    dtype=self.dtype,
                )
                if len(_STEP_CACHE) >= _STEP_CACHE_SIZE:
                    _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
                _STEP_CACHE[key] = (self.loss_fn, self.optimizer, self._step_fn)
            self._step_total = total
        return self._step_fn

    _get_step_fn = step_fn  # the former name (tests/test_export.py)

    def compile_step(self, batch: Mapping[str, np.ndarray], total_steps: Optional[int] = None):
        """The train step compiled ahead of time for host rows shaped like ``batch`` (a
        ``jax.stages.Compiled``: ``memory_analysis()``, ``cost_analysis()``, ``as_text()``)."""
        fn = self.step_fn(total_steps)
        return fn.lower(self.state, self.frozen, step_lib.global_batch(batch, self.mesh)).compile()

    def step_memory_bytes(self, batch: Mapping[str, np.ndarray], total_steps: Optional[int] = None) -> Optional[int]:
        """Bytes XLA plans for one train step on ``batch``'s shapes (arguments + outputs +
        temporaries - donated aliases), without running it; None where the backend does not say."""
        try:
            ma = self.compile_step(batch, total_steps).memory_analysis()
            return int(
                ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
            )
        except Exception:  # noqa: BLE001 - not every backend reports it
            return None

    def train_step(self, batch: Mapping[str, np.ndarray], total_steps: int) -> dict:
        """One step on host rows ``batch``; returns the metrics (device arrays).

        The step's finiteness flag is kept (not synced) for :meth:`check_finite`.
        """
        fn = self.step_fn(total_steps)
        self.state, metrics = fn(self.state, self.frozen, step_lib.global_batch(batch, self.mesh))
        metrics = dict(metrics)
        self._unchecked.append((metrics.pop("finite"), 1))
        if len(self._unchecked) >= _FINITE_FOLD:
            flags, counts = zip(*self._unchecked)
            self._unchecked = [(jnp.all(jnp.stack(flags)), sum(counts))]
        return metrics

    def check_finite(self) -> None:
        """Raise ``FloatingPointError`` if a step since the last check had a non-finite loss or
        gradient norm (one host sync; a no-op when every step was checked already)."""
        if not self._unchecked:
            return
        flags = np.asarray(jax.device_get([f for f, _ in self._unchecked]))
        counts = [n for _, n in self._unchecked]
        self._unchecked = []
        if flags.all():
            return
        first = self.step - sum(counts) + 1  # first step the flags cover
        bad = int(np.argmin(flags))
        lo = first + sum(counts[:bad])
        hi = lo + counts[bad] - 1
        where = f"step {lo}" if lo == hi else f"one of steps {lo}..{hi}"
        raise FloatingPointError(
            f"non-finite loss or gradient norm at {where}; training stopped and no checkpoint was saved "
            f"from that step on (the latest checkpoint, if any, predates it)"
        )

    # ------------------------------------------------------------------ checkpoints

    def save(self, batches=None, metrics=None, wait: bool = False) -> None:
        """Checkpoint the current step (after :meth:`check_finite`: never a non-finite state)."""
        if self.checkpointer is None:
            return
        self.check_finite()
        if self.step in self.checkpointer.all_steps():
            return
        meta = {"data": _iter_state(batches), "precision": self.precision}
        self.checkpointer.save(self.step, self.state, meta=meta, metrics=metrics)
        if wait:
            self.checkpointer.wait()

    def restore(self, batches=None, step: Optional[int] = None) -> bool:
        """Load the latest (or given) checkpoint into the trainer and the iterator position."""
        return self._restore(batches, step) is not None

    def _restore(self, batches, step: Optional[int]) -> Optional[dict]:
        """:meth:`restore`; returns the checkpoint's meta (None: nothing restored)."""
        if self.checkpointer is None or (step is None and self.checkpointer.latest_step() is None):
            return None
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state, self._state_shardings
        )
        state, meta = self.checkpointer.restore(step, target)
        self.state = state
        self._unchecked = []
        data = meta.get("data")
        if data is not None and batches is not None:
            if not hasattr(batches, "set_state"):
                raise ValueError("checkpoint has a data position but the batch iterator has no set_state()")
            batches.set_state(data)
        return meta

    def _check_data_position(self, meta: Optional[dict], num_steps: int, policy: str) -> None:
        """Resuming from a checkpoint that holds no data position replays data from its start:
        warn (``policy="warn"``), accept silently (``"allow"``) or refuse (``"raise"``)."""
        if meta is None or meta.get("data") is not None or self.step >= num_steps or policy == "allow":
            return
        msg = (
            f"resuming from the checkpoint at step {self.step} in {self.checkpointer.directory}, which holds no "
            f"data position (the batch iterator that wrote it had no state()): the data restarts from its "
            f"beginning, so steps {self.step + 1}.. train again on examples already seen. Use an iterator with "
            f"state()/set_state() (e.g. jsteer.data.batching.Batcher), or pass nonresumable_data='allow' to "
            f"accept the replay."
        )
        if policy == "raise":
            raise ValueError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self.log({"step": self.step, "event": f"warning: {msg}"})

    # ------------------------------------------------------------------ fit

    def evaluate(self) -> dict:
        """``eval_fn`` on the current params -> ``{"eval/<name>": float}`` ({} without one)."""
        if self.eval_fn is None:
            return {}
        return {f"eval/{k}": float(v) for k, v in dict(self.eval_fn(self.params)).items()}

    def throughput(self) -> dict:
        """``examples_per_s``, ``tokens_per_s`` and ``interval_s`` over the steps since the last
        call (or the start of the fit), then restart the count."""
        return self._window.rates()

    def fit(
        self,
        batches: Iterator[Mapping[str, np.ndarray]],
        num_steps: int,
        *,
        resume: bool = True,
        on_step: Optional[Callable[[int, dict], None]] = None,
        nonresumable_data: str = "warn",
    ) -> FitResult:
        """Train until ``state.step == num_steps`` (a total, so a resumed run stops at the same step).

        ``on_step(step, metrics)`` is called after each step, before the hooks (metrics are
        device arrays). ``nonresumable_data``: what a resume from a checkpoint without a data
        position (written from an iterator with no ``state()``) does, since ``batches`` then
        starts from its beginning: ``"warn"`` (RuntimeWarning and a log line), ``"allow"`` or
        ``"raise"`` (ValueError).
        """
        if nonresumable_data not in NONRESUMABLE_DATA:
            raise ValueError(f"nonresumable_data must be one of {NONRESUMABLE_DATA}, got {nonresumable_data!r}")
        if resume:
            self._check_data_position(self._restore(batches, None), num_steps, nonresumable_data)
        start = self.step
        it = iter(batches)
        self.stop_reason = None
        self.step_times = []
        self._window = _Window()
        self._log_hook.last = {}
        old_handler = self._install_sigterm()
        self.bar = self._make_bar(num_steps, start)
        result = FitResult(step=start, preempted=False, early_stopped=False, last={}, eval={})
        try:
            step = start
            while step < num_steps:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                metrics = self.train_step(batch, num_steps)
                if self.sync_steps:
                    jax.block_until_ready(metrics["loss"])
                step += 1
                info = StepInfo(self, step, num_steps, metrics, batch, batches, time.perf_counter() - t0)
                self.step_times.append(info.step_duration)
                self._window.add(batch, metrics)
                if on_step is not None:
                    on_step(step, metrics)
                if self.bar is not None:
                    self.bar.update(1)
                for hook in self.hooks + [self._checkpoint_hook]:
                    if hook.fires(info):
                        hook(info)
                if info.eval:
                    result["eval"] = info.eval
                if self.stop_reason:
                    self.save(batches, metrics=info.eval or None, wait=True)
                    result["early_stopped"] = self.stop_reason == hooks_lib.EARLY_STOP
                    result["preempted"] = not result["early_stopped"]
                    self.log({"step": step, "event": f"stopped ({self.stop_reason}); checkpoint saved"})
                    break
            result["step"] = step
            result["last"] = self._log_hook.last
        finally:
            if self.bar is not None:
                self.bar.close()
            self.bar = None
            if self.checkpointer is not None:
                self.checkpointer.wait()
            self._restore_sigterm(old_handler)
        if result["preempted"] and self.stop_reason == "SIGTERM" and self.exit_on_preempt:
            sys.exit(EXIT_PREEMPTED)
        return result

    # ------------------------------------------------------------------ helpers

    def _install_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self.request_stop("SIGTERM")

        return signal.signal(signal.SIGTERM, handler)

    @staticmethod
    def _restore_sigterm(old) -> None:
        if old is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, old)

    def _make_bar(self, total: int, initial: int):
        if not self.progress or jax.process_index() != 0:
            return None
        from jsteer import progress

        return progress.bar(total=total, initial=initial, desc="train", unit="step")

    def log(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` (with the time) to the JSONL log (process 0; no-op without ``log_path``)."""
        if self.log_path is None or jax.process_index() != 0:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rec = {"time": time.time(), **record}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec, default=jsonable) + "\n")


class _Window:
    """Throughput over the steps since the last log line.

    Examples are counted on the host. Tokens come from the loss's ``aux["tokens"]`` (a
    global count, kept on device and summed at :meth:`rates`, which runs at a log line
    that syncs anyway), else from the host batch: the sum of ``attention_mask`` / ``mask``
    or the size of ``input_ids`` / ``ids``.
    """

    MASKS = ("attention_mask", "mask")
    IDS = ("input_ids", "ids")

    def __init__(self):
        self.t0 = time.perf_counter()
        self.examples = 0
        self.tokens = 0
        self.device_tokens: list = []

    def add(self, batch, metrics: Mapping[str, Any]) -> None:
        """Count one step: host rows ``batch`` and the step's ``metrics`` (device arrays)."""
        if "example_mask" in batch:
            n = int(np.sum(batch["example_mask"]))
        else:
            n = int(np.shape(next(iter(batch.values())))[0])
        self.examples += n * jax.process_count()
        if "tokens" in metrics:
            self.device_tokens.append(metrics["tokens"])
            return
        mask = next((k for k in self.MASKS if k in batch), None)
        ids = next((k for k in self.IDS if k in batch), None)
        if mask is not None:
            self.tokens += int(np.sum(batch[mask])) * jax.process_count()
        elif ids is not None:
            self.tokens += int(np.size(batch[ids])) * jax.process_count()

    def rates(self) -> dict:
        tokens = self.tokens
        if self.device_tokens:
            tokens += float(np.sum(jax.device_get(self.device_tokens)))
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"examples_per_s": self.examples / dt, "tokens_per_s": tokens / dt, "interval_s": dt}
        self.t0, self.examples, self.tokens, self.device_tokens = time.perf_counter(), 0, 0, []
        return out


def _iter_state(batches):
    if batches is not None and hasattr(batches, "state"):
        return batches.state()
    return None


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)
