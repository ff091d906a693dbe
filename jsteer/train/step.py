"""The jitted train step: sharding, mixed precision, donated state.

Layout on a device mesh with a ``"data"`` axis (and optionally ``"fsdp"`` / ``"tensor"``, see
:mod:`jsteer.sharding`):
  * batch leaves are split on their leading (batch) axis over ``"data"`` (x ``"fsdp"``);
  * trainable params (fp32 masters) and frozen params are replicated, or placed by their
    logical axes and the sharding rules (FSDP / tensor parallel); optimizer state follows them;
  * with replicated params, ``shard_opt_state`` splits each optimizer-state leaf over
    ``"data"`` along its first axis divisible by the mesh size (ZeRO-1 style; leaves with no
    such axis stay replicated).
The same program runs on 1 CPU, many GPUs, a TPU slice or several hosts (after
``jax.distributed.initialize``): XLA inserts the gradient all-reduce.

Mixed precision: with ``compute_dtype=bfloat16`` the loss sees every floating param cast to
bf16 (trainable ones cast inside the step, so gradients flow back to the fp32 masters);
the loss is returned in fp32.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jsteer.train import optim

PyTree = Any
LossFn = Callable[[PyTree, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, Mapping[str, jax.Array]]]
DATA_AXIS = "data"

PRECISIONS = {"fp32": None, "float32": None, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training (and is checkpointed).

    step: int32 []; params: trainable params, fp32 masters (None at frozen leaves);
    opt_state: optax state of the trainable params; rng: uint32 raw key data of the base key
    (step ``s`` uses ``fold_in(base, s)``, so resuming needs no extra PRNG state).
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array


def compute_dtype(precision: str):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def cast_floating(tree: PyTree, dtype) -> PyTree:
    """Cast floating-point leaves to ``dtype`` (ints, bools and None untouched)."""
    if dtype is None:
        return tree

    def cast(x):
        if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def data_mesh(devices=None) -> Mesh:
    """1-D mesh over ``devices`` (default: every device of every host) with axis ``"data"``."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the mesh's batch axes ("data", and "fsdp" if present)."""
    from jsteer.sharding import batch_spec

    return NamedSharding(mesh, batch_spec(mesh))


def opt_state_shardings(opt_state: PyTree, mesh: Mesh, shard: bool) -> PyTree:
    """Per-leaf sharding: replicated, or split on the first axis divisible by the mesh size."""
    n = mesh.shape[DATA_AXIS]

    def one(x):
        if not shard or x is None:
            return replicated(mesh)
        for axis, size in enumerate(np.shape(x)):
            if size % n == 0 and size >= n:
                spec = [None] * np.ndim(x)
                spec[axis] = DATA_AXIS
                return NamedSharding(mesh, P(*spec))
        return replicated(mesh)

    return jax.tree.map(one, opt_state)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mask: PyTree,
    schedules: Mapping[str, optax.Schedule],
    *,
    mesh: Mesh,
    state_shardings: TrainState,
    frozen_shardings: PyTree,
    dtype=None,
):
    """Jitted ``(state, frozen, batch) -> (state, metrics)``; ``state`` is donated.

    ``frozen`` holds the non-trainable params (None at trainable leaves); they are inputs,
    never differentiated. ``metrics``: ``loss``, ``grad_norm``, ``lr`` (first group) and
    ``lr/<group>``, ``finite`` (bool []: loss and grad_norm are both finite), plus the loss
    function's aux values.
    """

    def step_fn(state: TrainState, frozen: PyTree, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def objective(trainable):
            params = optim.combine(mask, cast_floating(trainable, dtype), frozen)
            loss, aux = loss_fn(params, batch, key)
            return loss.astype(jnp.float32), aux

        (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
        lrs = {f"lr/{g}": s(state.step) for g, s in schedules.items()}
        metrics["lr"] = next(iter(lrs.values()))
        if len(lrs) > 1:
            metrics.update(lrs)
        for k, v in dict(aux or {}).items():
            metrics[k] = jnp.asarray(v, jnp.float32)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new, metrics

    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, frozen_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated(mesh)),
        donate_argnums=(0,),
    )


def global_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Host-local rows -> global arrays split over ``"data"`` (each host passes its own rows)."""
    from jsteer.sharding import batch_size_multiple

    sh = batch_sharding(mesh)
    n = batch_size_multiple(mesh)
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if v.ndim == 0:
            raise ValueError(f"batch field {k!r} is a scalar; every field needs a leading batch axis")
        rows = v.shape[0] * jax.process_count()
        if rows % n:
            raise ValueError(f"global batch {rows} (field {k!r}) is not divisible by the {n} devices of the mesh")
        out[k] = jax.make_array_from_process_local_data(sh, v, (rows,) + v.shape[1:])
    return out
