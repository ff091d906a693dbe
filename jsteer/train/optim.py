"""Parameter groups, learning-rate schedules and the optax optimizer.

Every leaf of the params pytree gets a *group* label. Each group has its own peak learning
rate, or ``None`` for a frozen group: frozen leaves are split off before differentiation,
so they get no gradient, no update and no optimizer state (a frozen 135M backbone costs
nothing in the optimizer).

    cfg = OptimizerConfig(
        learning_rate={"backbone": 2e-5, "kala": 1e-3, "frozen": None},
        labels=lambda path, leaf: "kala" if path[0] == "kala" else "backbone",
        warmup_steps=100, schedule="linear", weight_decay=0.01, clip_norm=1.0)

``labels`` is a function ``(path: tuple[str, ...], leaf) -> group`` or a pytree of group
names with the params' structure; None puts every leaf in the single group ``"default"``
(then ``learning_rate`` may be a float).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import optax

PyTree = Any
DEFAULT_GROUP = "default"
SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup + decay, global-norm clipping and per-group learning rates.

    learning_rate: peak lr (float, single group) or ``{group: lr | None}``; None = frozen.
    labels: ``(path, leaf) -> group`` or a pytree of group names; None -> one group.
    schedule: "constant" | "linear" | "cosine" decay after ``warmup_steps`` linear warmup
      (from 0) down to ``end_lr_ratio * peak`` at ``total_steps`` (None: the run's length).
    weight_decay: decoupled (AdamW) decay, applied to leaves with ndim >= 2 only (not to
      biases and norm scales) unless ``decay_all``; ``group_weight_decay`` overrides per group.
    clip_norm: clip the global gradient norm (over all trainable leaves) to this; None = off.
    """

    learning_rate: Union[float, Mapping[str, Optional[float]]] = 1e-3
    labels: Union[None, Callable[[tuple, Any], str], PyTree] = None
    schedule: str = "linear"
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    group_weight_decay: Optional[Mapping[str, float]] = None
    decay_all: bool = False
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: Optional[float] = 1.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def group_lrs(self) -> dict[str, Optional[float]]:
        if isinstance(self.learning_rate, Mapping):
            return dict(self.learning_rate)
        return {DEFAULT_GROUP: float(self.learning_rate)}


def path_names(path) -> tuple[str, ...]:
    """A jax key path -> tuple of plain names (dict keys, attribute names, indices as str)."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def resolve_labels(params: PyTree, cfg: OptimizerConfig) -> PyTree:
    """Group name for every leaf (same structure as ``params``); checks every group has an lr."""
    lrs = cfg.group_lrs()
    if cfg.labels is None:
        if set(lrs) != {DEFAULT_GROUP}:
            raise ValueError(f"learning_rate has groups {sorted(lrs)} but no `labels` to assign them")
        labels = jax.tree.map(lambda _: DEFAULT_GROUP, params)
    elif callable(cfg.labels):
        labels = jax.tree_util.tree_map_with_path(lambda p, x: cfg.labels(path_names(p), x), params)
    else:
        try:
            labels = jax.tree.map(lambda _, lab: lab, params, cfg.labels)
        except ValueError as e:
            raise ValueError(f"`labels` pytree does not match the params structure: {e}") from None
    flat, _ = jax.tree_util.tree_flatten_with_path(labels)
    for path, lab in flat:
        if not isinstance(lab, str):
            raise ValueError(f"param {'/'.join(path_names(path))}: group label must be a str, got {lab!r}")
        if lab not in lrs:
            raise ValueError(
                f"param {'/'.join(path_names(path))} has group {lab!r}, which has no learning rate "
                f"(groups: {sorted(lrs)}; use None to freeze)"
            )
    return labels


def trainable_mask(labels: PyTree, cfg: OptimizerConfig, params: Optional[PyTree] = None) -> PyTree:
    """True where the leaf's group has a learning rate (and, given ``params``, the leaf is
    floating point: integer / bool leaves are always frozen)."""
    lrs = cfg.group_lrs()
    if params is None:
        return jax.tree.map(lambda lab: lrs[lab] is not None, labels)
    return jax.tree.map(
        lambda lab, x: lrs[lab] is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact), labels, params
    )


def _is_none(x) -> bool:
    return x is None


def partition(params: PyTree, mask: PyTree) -> tuple[PyTree, PyTree]:
    """Split into (trainable, frozen); each keeps the structure with None at the other's leaves."""
    trainable = jax.tree.map(lambda m, x: x if m else None, mask, params)
    frozen = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return trainable, frozen


def combine(mask: PyTree, trainable: PyTree, frozen: PyTree) -> PyTree:
    """Inverse of :func:`partition`."""
    return jax.tree.map(lambda m, a, b: a if m else b, mask, trainable, frozen, is_leaf=_is_none)


def make_schedule(peak: float, cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup 0 -> peak over ``warmup_steps``, then constant / linear / cosine decay
    to ``end_lr_ratio * peak`` at ``total_steps``."""
    warm = cfg.warmup_steps
    end = peak * cfg.end_lr_ratio
    decay_steps = max(total_steps - warm, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_lr_ratio)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _decay_mask(tree: PyTree, all_leaves: bool) -> PyTree:
    return jax.tree.map(lambda x: all_leaves or jnp.ndim(x) >= 2, tree)


def make_optimizer(
    cfg: OptimizerConfig, trainable_labels: PyTree, total_steps: int
) -> tuple[optax.GradientTransformation, dict[str, optax.Schedule]]:
    """Optimizer over the *trainable* leaves only (frozen leaves are None in ``trainable_labels``).

    Returns (transformation, {group: schedule}) - schedules for logging the lr.
    """
    lrs = {g: lr for g, lr in cfg.group_lrs().items() if lr is not None}
    used = set(jax.tree.leaves(trainable_labels))
    schedules = {g: make_schedule(lr, cfg, total_steps) for g, lr in lrs.items() if g in used}
    if not schedules:
        raise ValueError("no trainable parameters: every group has learning rate None")
    wd = dict(cfg.group_weight_decay or {})
    transforms = {
        g: optax.adamw(
            s,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=wd.get(g, cfg.weight_decay),
            mask=lambda t: _decay_mask(t, cfg.decay_all),
        )
        for g, s in schedules.items()
    }
    tx = optax.multi_transform(transforms, trainable_labels)
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    return tx, schedules
