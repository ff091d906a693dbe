"""Training and evaluation for KALA NER / QA (and the baselines, same harness).

Training is a loss plus a batch stream on the shared engine :class:`jsteer.train.Trainer`
(checkpoints, JSONL metrics, resume, step times). Optimiser: AdamW with linear warmup + decay
and global-norm clipping; the knowledge module (``params["kala"]``) gets its own learning rate
(``kala_lr``), everything else ``lr`` (the paper's setup). Losses (:func:`task_loss`): NER token
cross-entropy over labelled subwords (first piece of each word); QA the mean of the start and
end cross-entropies; plus the model output's ``aux_loss`` where it has one. The variants harness
(:mod:`jsteer.kala.variants.train`) runs this same :func:`fit` / :func:`predict_ner` with its
models' forward and extra batch keys.

Everything heavy is one jitted step; batches come padded to static [B, T] buckets and graph
buckets (:mod:`jsteer.kala.data`), so the number of compiled shapes stays small.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jsteer.data import ner as ner_lib
from jsteer.kala import data as kdata
from jsteer.kala.graph import flatten_graphs, last_layer_edges
from jsteer.kala.metrics import ner_report
from jsteer.kala.model import KalaModel
from jsteer.progress import bar as progress_bar
from jsteer.train import OptimizerConfig, Trainer, data_mesh


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Defaults follow the paper (lr 5e-5, batch 32, length 128); ``kala_lr`` is separate."""

    lr: float = 5e-5
    kala_lr: float = 1e-4
    batch_size: int = 32
    max_len: int = 128
    epochs: float = 3.0
    max_steps: Optional[int] = None
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_norm: Optional[float] = 1.0
    seed: int = 0
    # smaller graph buckets training batches may take (stack_graphs' ``smaller``): less padding per
    # step, one more compiled shape per rung and length bucket -- worth it for long runs only
    graph_rungs: int = 0

    def total_steps(self, n_examples: int) -> int:
        per_epoch = -(-n_examples // self.batch_size)
        return self.max_steps or max(int(round(self.epochs * per_epoch)), 1)


def group_of(path, leaf) -> str:
    return "kala" if path and path[0] == "kala" else "backbone"


def optimizer_config(cfg: TrainConfig, total_steps: int) -> OptimizerConfig:
    """AdamW, linear warmup + linear decay, lr for the backbone / heads and kala_lr for KALA."""
    return OptimizerConfig(
        learning_rate={"backbone": cfg.lr, "kala": cfg.kala_lr},
        labels=group_of,
        schedule="linear",
        warmup_steps=int(cfg.warmup_ratio * total_steps),
        total_steps=total_steps,
        weight_decay=cfg.weight_decay,
        clip_norm=cfg.clip_norm,
    )


def model_inputs(model: KalaModel, batch) -> tuple:
    """(graph, token_node) for the model from a collated batch; (None, None) without KALA."""
    if not model.kala.uses_knowledge:
        return None, None
    return flatten_graphs(batch)


def apply_model(model, params, batch, graph, token_node, deterministic: bool, rng, **kw):
    """``model.apply`` on a collated batch's input_ids, attention_mask and token_type_ids with
    (``graph``, ``token_node``); ``rng`` the dropout key when not ``deterministic``; ``kw``: the
    model's own keywords."""
    rngs = None if deterministic else {"dropout": rng}
    return model.apply(
        {"params": params},
        batch["input_ids"],
        batch["attention_mask"],
        batch.get("token_type_ids"),
        graph,
        token_node,
        deterministic=deterministic,
        rngs=rngs,
        **kw,
    )


def forward(model: KalaModel, params, batch, deterministic: bool = True, rng=None):
    graph, token_node = model_inputs(model, batch)
    mention = batch.get("graph_mention") if graph is not None else None
    mention = None if mention is None else jnp.asarray(mention).reshape(-1)
    last = last_layer_edges(batch) if mention is not None else None
    return apply_model(model, params, batch, graph, token_node, deterministic, rng, mention=mention, last_edges=last)


def task_loss(forward_fn: Callable, task: str = "ner") -> Callable:
    """``loss_fn(params, batch, rng) -> (loss, aux)`` of ``task`` for the model run by
    ``forward_fn(params, batch, deterministic, rng)`` (an output with ``logits``: [B, T, labels]
    for NER, [B, T, 2] span logits for QA). NER: mean token cross-entropy over labelled subwords,
    aux ``labelled_tokens``; QA: mean of the start / end cross-entropies over real rows, aux
    ``examples``. An output's ``aux_loss`` (EaE's entity linking) is added to the loss and logged
    with its ``aux`` scalars."""
    if task not in ("ner", "qa"):
        raise ValueError(f"task must be 'ner' or 'qa', got {task!r}")

    def with_aux(out, loss, aux):
        extra = getattr(out, "aux_loss", None)
        if extra is None:
            return loss, aux
        return loss + extra, {**aux, "aux_loss": extra, **(getattr(out, "aux", None) or {})}

    def ner(params, batch, rng):
        out = forward_fn(params, batch, False, rng)
        labels = batch["labels"]
        valid = labels != ner_lib.IGNORE_INDEX
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, jnp.maximum(labels, 0))
        loss = jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)
        return with_aux(out, loss, {"labelled_tokens": jnp.sum(valid)})

    def qa(params, batch, rng):
        out = forward_fn(params, batch, False, rng)
        lg = jnp.where((batch["attention_mask"] > 0)[..., None], out.logits, -1e9)
        ls = optax.softmax_cross_entropy_with_integer_labels(lg[..., 0], batch["start_positions"])
        le = optax.softmax_cross_entropy_with_integer_labels(lg[..., 1], batch["end_positions"])
        real = batch["example_mask"].astype(jnp.float32)
        loss = jnp.sum((ls + le) / 2 * real) / jnp.maximum(jnp.sum(real), 1)
        return with_aux(out, loss, {"examples": jnp.sum(real)})

    return ner if task == "ner" else qa


def ner_loss(model: KalaModel) -> Callable:
    """loss_fn(params, batch, rng) -> (mean token CE over labelled subwords, aux)."""
    return task_loss(functools.partial(forward, model), "ner")


def qa_loss(model: KalaModel) -> Callable:
    """loss_fn for span QA: mean of start / end cross-entropies over real rows."""
    return task_loss(functools.partial(forward, model), "qa")


def make_trainer(
    model: KalaModel,
    params: dict,
    cfg: TrainConfig,
    total_steps: int,
    task: str = "ner",
    *,
    loss_fn: Optional[Callable] = None,
    mesh=None,
    rules=None,
    **kw,
) -> Trainer:
    """The :class:`jsteer.train.Trainer` :func:`fit` trains on: ``loss_fn`` (default the task's
    loss of a KALA model) with :func:`optimizer_config`'s AdamW over ``total_steps``, on one
    device unless ``mesh``; ``rules`` shards the encoder's params (logical axes inferred);
    ``kw``: further Trainer options (checkpoint_dir, log_path, eval_fn, ...)."""
    loss_fn = loss_fn or task_loss(functools.partial(forward, model), task)
    kw.setdefault("log_every", max(total_steps // 20, 1))
    return Trainer(
        loss_fn,
        params,
        optimizer_config(cfg, total_steps),
        mesh=mesh or data_mesh(jax.devices()[:1]),
        rules=rules or "dp",
        axes="auto" if rules else None,
        seed=cfg.seed,
        **kw,
    )


def measure_step_memory(
    model: KalaModel,
    params: dict,
    examples: Sequence[dict],
    cfg: TrainConfig,
    task: str = "ner",
    *,
    loss_fn: Optional[Callable] = None,
    keys=None,
) -> Optional[int]:
    """Bytes XLA plans for one train step of :func:`fit` (:meth:`Trainer.step_memory_bytes`) on
    the first batch it would train on, without training (same seed -> same examples and shapes
    for every method); None where the backend does not say."""
    total = cfg.total_steps(len(examples))
    trainer = make_trainer(model, params, cfg, total, task, loss_fn=loss_fn, progress=False)
    first = next(iter(_Endless.for_model(model, examples, cfg, task, keys)))
    return trainer.step_memory_bytes(first, total)


class _Endless:
    """Epoch after epoch of shuffled, length-grouped, collated batches. Its position
    (:meth:`state` / :meth:`set_state`) is checkpointed by the trainer, so a resumed run
    continues with the batch an uninterrupted one would have taken (each epoch's order is a
    function of the seed and the epoch)."""

    def __init__(self, examples, batch_size, keys, seed, graph_rungs=0, graph=True):
        if len(examples) == 0:
            raise ValueError("no training examples: an empty batch stream has no batch to train on")
        self.examples, self.batch_size, self.keys, self.seed = examples, batch_size, keys, seed
        self.graph_rungs, self.graph = graph_rungs, graph
        self._epoch, self._index = 0, 0  # the next batch: batch _index of epoch _epoch

    def state(self) -> dict:
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "num_examples": len(self.examples)}

    def set_state(self, state) -> None:
        if int(state["seed"]) != self.seed or int(state["num_examples"]) != len(self.examples):
            raise ValueError(
                f"data position is for seed {state['seed']} / {state['num_examples']} examples, "
                f"this run has seed {self.seed} / {len(self.examples)} examples"
            )
        self._epoch, self._index = int(state["epoch"]), int(state["index"])

    @classmethod
    def for_model(cls, model, examples, cfg: TrainConfig, task: str, keys=None) -> "_Endless":
        """Graph arrays only for models that read them (``model.kala.uses_knowledge``; and only for
        those the smaller graph buckets). ``keys``: the per-token batch keys (default
        :func:`task_keys`; the variants harness adds its models' extra keys)."""
        graph = model.kala.uses_knowledge
        return cls(examples, cfg.batch_size, keys or task_keys(task), cfg.seed, cfg.graph_rungs if graph else 0, graph)

    def __iter__(self):
        while True:
            batches = kdata.batches(
                self.examples,
                self.batch_size,
                shuffle=True,
                group_by_length=True,
                seed=self.seed * 1000 + self._epoch,
                keys=self.keys,
                graph_rungs=self.graph_rungs,
                graph=self.graph,
            )
            n = 0
            for i, (_, batch) in enumerate(batches):
                n = i + 1
                if i < self._index:  # already trained on (a resumed run)
                    continue
                self._index = i + 1
                yield kdata.device_batch(batch, self.graph)
            if n == 0:  # never spin on an epoch without batches
                raise ValueError(f"epoch {self._epoch} of {len(self.examples)} training examples has no batch")
            self._epoch, self._index = self._epoch + 1, 0


@dataclasses.dataclass
class FitResult:
    params: dict
    losses: list
    train_seconds: float  # seconds of steps 2..N (the first, compiling step excluded; so are evaluations)
    compile_seconds: float  # seconds of step 1
    steps: int  # optimiser steps this call ran (0 when a resumed run was already complete)
    examples_per_second: float
    step_memory_bytes: Optional[int]
    trainable_params: int
    median_step_seconds: float = float("nan")  # robust to the steps that compiled a new shape
    preempted: bool = False  # stopped early by SIGTERM (after saving a checkpoint when it has a directory)
    last_step: int = 0  # the optimiser step reached: ``steps`` plus any restored from a checkpoint


def task_keys(task: str) -> tuple[str, ...]:
    return (
        ("input_ids", "labels")
        if task == "ner"
        else ("input_ids", "token_type_ids", "start_positions", "end_positions")
    )


def fit(
    model: KalaModel,
    params: dict,
    examples: Sequence[dict],
    cfg: TrainConfig,
    task: str = "ner",
    *,
    log_path=None,
    checkpoint_dir=None,
    eval_fn=None,
    eval_every=None,
    progress: bool = False,
    measure_memory: bool = False,
    mesh=None,
    rules=None,
    nonresumable_data: str = "warn",
    loss_fn: Optional[Callable] = None,
    keys: Optional[Sequence[str]] = None,
) -> FitResult:
    """Train on encoded examples for ``cfg.epochs`` (or ``cfg.max_steps``) with the shared
    :class:`jsteer.train.Trainer` (:func:`make_trainer`; one device by default: graphs are per
    example, so the data axis may be widened with ``mesh`` when the batch divides it). ``rules``
    (a :mod:`jsteer.sharding` preset or dict) also shards the encoder's params over ``mesh``.
    ``loss_fn`` / ``keys``: another model's loss and per-token batch keys (the variants
    harness'); default the task's KALA loss and :func:`task_keys`.

    With ``checkpoint_dir`` holding a checkpoint the run resumes from it, the batch stream at the
    recorded position (same params as an uninterrupted run). ``nonresumable_data``: what a
    checkpoint without a data position (written before streams were checkpointed) does, see
    :meth:`jsteer.train.Trainer.fit`. A SIGTERM stops after the current step and saves a
    checkpoint: the result then has ``preempted=True``. Raises ValueError without examples."""
    if len(examples) == 0:
        raise ValueError("fit: no training examples (an empty training file, or a train size of 0?)")
    total = cfg.total_steps(len(examples))
    # sync_steps: each step's loss is read anyway, and the step times are then device times
    trainer = make_trainer(
        model,
        params,
        cfg,
        total,
        task,
        loss_fn=loss_fn,
        mesh=mesh,
        rules=rules,
        checkpoint_dir=checkpoint_dir,
        log_path=log_path,
        eval_fn=eval_fn,
        eval_every=eval_every,
        progress=progress,
        exit_on_preempt=False,
        sync_steps=True,
    )
    losses = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    stream = _Endless.for_model(model, examples, cfg, task, keys)
    # the stream itself, not iter(stream): the trainer checkpoints its state() and restores it
    # with set_state(), so a resumed run continues at the batch an uninterrupted one would take
    summary = trainer.fit(stream, total, nonresumable_data=nonresumable_data)
    mem = trainer.step_memory_bytes(next(iter(stream)), total) if measure_memory else None
    times = trainer.step_times
    n = len(times)
    train_s = float(np.sum(times[1:])) if n > 1 else float("nan")
    return FitResult(
        params=trainer.params,
        losses=losses,
        train_seconds=train_s,
        compile_seconds=times[0] if n else float("nan"),
        steps=n,
        examples_per_second=(n - 1) * cfg.batch_size / train_s if n > 1 else float("nan"),
        step_memory_bytes=mem,
        trainable_params=count_params(params),
        median_step_seconds=float(np.median(times[1:])) if n > 1 else float("nan"),
        preempted=bool(summary["preempted"]),
        last_step=int(summary["step"]),
    )


def predict_ner(
    model: KalaModel,
    params: dict,
    examples: Sequence[dict],
    batch_size: int = 64,
    *,
    forward_fn: Optional[Callable] = None,
    keys: Sequence[str] = (),
    progress: bool = False,
) -> list[np.ndarray]:
    """Per-word predicted label ids for each example (words cut by truncation get 0 = 'O').
    ``forward_fn(params, batch)`` / ``keys``: another model's forward and extra batch keys;
    ``progress``: a :mod:`jsteer.progress` bar over the examples."""
    fwd = forward_fn or functools.partial(forward, model)
    preds: list = [None] * len(examples)
    keys = task_keys("ner") + tuple(keys) + ("word_index",)
    for idx, batch, logits in _logit_batches(model, params, examples, batch_size, keys, fwd, "sentence", progress):
        arg = np.asarray(jnp.argmax(logits, -1))
        for r, i in enumerate(idx):
            preds[i] = ner_lib.word_predictions(arg[r], batch["word_index"][r], examples[i]["num_words"], fill=0)
    return preds


def _logit_batches(model: KalaModel, params: dict, items, batch_size: int, keys, fwd, unit: str, progress: bool):
    """Yields (item indices, the host batch, its logits on device) over ``items`` in batches of
    ``keys``, through ``fwd(params, batch)`` jitted (``progress``: a bar counting ``unit``)."""
    logits_fn = jax.jit(lambda p, b: fwd(p, b).logits)
    graph = model.kala.uses_knowledge
    with progress_bar(total=len(items), desc="eval", unit=unit, enabled=progress) as bar:
        for idx, batch in kdata.batches(items, batch_size, keys=keys, graph=graph):
            yield idx, batch, logits_fn(params, kdata.device_batch(batch, graph))
            bar.update(len(idx))


def evaluate_ner(
    model: KalaModel,
    params: dict,
    examples: Sequence[dict],
    gold_tags: Sequence[Sequence[str]],
    label_names: Sequence[str],
    batch_size: int = 64,
    subsets: Optional[dict] = None,
    *,
    forward_fn: Optional[Callable] = None,
    keys: Sequence[str] = (),
    progress: bool = False,
    per_type: bool = False,
) -> dict:
    """Entity-level scores (percent) overall and on optional {name: example indices} subsets
    (``forward_fn`` / ``keys`` / ``progress``: as :func:`predict_ner`; ``per_type``: add
    ``per_type`` {entity type: F1 percent})."""
    preds = predict_ner(model, params, examples, batch_size, forward_fn=forward_fn, keys=keys, progress=progress)
    return ner_report(gold_tags, [[label_names[int(p)] for p in ps] for ps in preds], subsets, per_type=per_type)


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def predict_qa_logits(
    model: KalaModel, params: dict, features: Sequence[dict], batch_size: int = 64, progress: bool = False
) -> list[np.ndarray]:
    """Span logits [L, 2] of each QA feature (window), unpadded (``progress``: a bar)."""
    fwd = functools.partial(forward, model)
    out: list = [None] * len(features)
    for idx, _, logits in _logit_batches(model, params, features, batch_size, task_keys("qa"), fwd, "window", progress):
        lg = np.asarray(logits)
        for r, i in enumerate(idx):
            out[i] = lg[r, : len(features[i]["input_ids"])]
    return out


def predict_qa(
    model: KalaModel,
    params: dict,
    features: Sequence[dict],
    examples: Sequence,
    batch_size: int = 64,
    max_answer_len: int = 30,
    progress: bool = False,
) -> dict[str, str]:
    """{question id: answer text}: the best span over each question's windows (the predictions
    file the SQuAD evaluation script reads)."""
    from jsteer.kala import qa as qa_lib

    logits = predict_qa_logits(model, params, features, batch_size, progress=progress)
    return qa_lib.predict_answers(features, logits, {e.qid: e.context for e in examples}, max_answer_len=max_answer_len)


def evaluate_qa(model: KalaModel, params: dict, features: Sequence[dict], examples: Sequence, *args, **kw) -> dict:
    """SQuAD EM / F1 (percent) of the best span over each question's windows (further arguments:
    :func:`predict_qa`'s batch_size, max_answer_len)."""
    from jsteer.kala import qa as qa_lib
    from jsteer.kala.metrics import squad_scores

    preds = predict_qa(model, params, features, examples, *args, **kw)
    return squad_scores(preds, qa_lib.gold_answers(examples))
