"""Training a steer on a frozen decoder.

Objective (the original's): next-token cross-entropy of labeled texts under the steered head
logits = (c + sum_i eps_i W_i c) E^T, where a text with label y_i in {+1, -1} for steer i
uses eps_i = y_i * eps0, and one extra "dummy" steer (the last one) is fixed at +1 * eps0 for
every text so that it absorbs the shift from the LM's domain to the training domain and
the labeled steer only has to learn the *difference* between the classes.

The backbone is frozen, so the final hidden states c (the unsteered final-norm output,
``ModelOutput.hidden``) never change: :func:`cache_hidden` computes them once for every
training token and training steps only run the head (one [N, D] x [D, V] product and its
backward). :func:`forward_loss_fn` is the original's alternative (full forward every step),
kept for the speed comparison in experiments/bench_steer.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones.base import logsumexp
from jsteer.progress import bar as progress_bar
from jsteer.steer import head

Array = jnp.ndarray


# The steer kinds TrainConfig accepts -> init(key, cfg, hidden_dim, vocab_size, num_steers) of
# their params: the one list of kinds (TrainConfig validates against it, init_params looks up).
_INIT_PARAMS = {
    "steer": lambda key, cfg, d, v, s: head.init(key, d, s, rank=cfg.rank, scale=cfg.init_scale),
    "blacklist": lambda key, cfg, d, v, s: head.init_blacklist(key, v, s, scale=cfg.init_scale),
    "offset": lambda key, cfg, d, v, s: head.init_offset(key, d, s, scale=cfg.init_scale),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Paper defaults (Han et al.; the original's sentiment / detox runs), all overridable."""

    rank: Optional[int] = 1000  # None = full-rank W
    init_scale: float = 1e-3
    eps0: float = 1e-3
    lr: float = 1e-2
    steps: int = 1000
    batch_size: int = 32  # texts per step
    l2: float = 0.0  # weight of sum ||P||^2 (original's --regularization)
    dummy: bool = True
    seed: int = 0
    kind: str = "steer"  # "steer" | "blacklist" | "offset" (baselines)
    tokens_per_batch: Optional[int] = None  # static token budget per step; None: from data
    log_every: int = 50
    # kept so older configs load: both names train on jsteer.train.Trainer ("optax" named a
    # separate minimal Adam loop, the same math, which is gone)
    engine: str = "jsteer"

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eps0", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"TrainConfig.rank must be >= 1 (or None for a full W), got {self.rank}")
        if self.kind not in _INIT_PARAMS:
            *rest, last = _INIT_PARAMS
            raise ValueError(f"unknown steer kind {self.kind!r}: use {', '.join(rest)} or {last}")
        if self.engine not in ("jsteer", "optax"):
            raise ValueError(f"unknown training engine {self.engine!r}: use 'jsteer' or 'optax'")


# The baselines' parameters act on logits / hidden states directly, not through c^T W e_v, so
# the steer's eps0 = 1e-3 would leave them untrainable: Adam moves a parameter ~lr per step,
# i.e. a logit by ~eps0 * lr = 1e-5. They train at this eps0 unless one is given.
BASELINE_EPS0 = 1.0


# ----------------------------------------------------------------------------- data


SST5_POSITIVE = ("3", "4")
SST5_NEGATIVE = ("0", "1")


# --format -> (LabeledText's fmt, its reader's fields / columns, the label set) of raw files
_FORMATS = {
    "sst5": ("jsonl", {"text_field": "sentence", "label_field": "label"}, ("0", "1", "2", "3", "4")),
    "jigsaw": ("csv", {"text_column": 0, "label_column": 1}, ("0", "1")),
    "jsonl": ("jsonl", {"text_field": "text", "label_field": "label"}, ("1", "-1", "0", "+1")),
}


def _sniff(path: str) -> str:
    """ "auto" for a file: by extension / content."""
    from jsteer.data import readers

    if path.endswith(".csv"):
        return "jigsaw"
    first = readers.read_text(path).split("\n", 1)[0]
    return "sst5" if '"sentence"' in first else "jsonl"


def _split_format(split, fmt: str, labels) -> str:
    """ "auto" for a TFDS split: by its label names (SST-5's 0..4; +1 / -1); 0 / 1 names no sign."""
    if fmt != "auto":
        return fmt
    names = set(labels)
    if names and names <= set(_FORMATS["sst5"][2]) and names - {"0", "1"}:
        return "sst5"
    if names & {"-1", "+1"} and names <= set(_FORMATS["jsonl"][2]):
        return "jsonl"
    raise ValueError(
        f"{split.describe()}: labels {sorted(names)} do not say which texts are positive: give --format "
        f"sst5 (3, 4 -> +1; 0, 1 -> -1), jigsaw (0 non-toxic -> +1, 1 toxic -> -1) or jsonl (1 -> +1, 0 / -1 -> -1)"
    )


def labeled_records(source, fmt: str = "auto", data_dir=None):
    """Labeled texts as :class:`jsteer.data.readers.LabeledText` records, and the format that maps
    their labels: a file (prepared once through the TFDS builder
    :class:`~jsteer.data.tfds_builders.LabeledText` into ``data_dir``, read with
    ``tfds.data_source``) or a :class:`~jsteer.data.sources.Split` with ``text`` and ``label``."""
    from jsteer.data import readers, sources, tfds_builders

    if fmt not in ("auto", *_FORMATS):
        raise ValueError(f"unknown labeled-data format {fmt!r}: use sst5, jigsaw, jsonl or auto")
    if isinstance(source, sources.Split):
        recs = sources.labeled_texts(source)
        fmt = _split_format(source, fmt, source.class_names("label") or {r.label for r in recs})
        allowed = _FORMATS[fmt][2]
        for r in recs:
            if r.label not in allowed:
                raise readers.DataError(r.source, r.line, f"label {r.label!r} not in label set {sorted(allowed)}")
        return recs, fmt
    path = str(source)
    if fmt == "auto":
        fmt = _sniff(path)
    kind, fields, labels = _FORMATS[fmt]
    split = sources.prepared(
        tfds_builders.LabeledText, path, data_dir, fmt=kind, label_names=labels, reader_kwargs=fields
    )
    return sources.labeled_texts(split), fmt


def load_labeled(
    path, fmt: str = "auto", limit: Optional[int] = None, seed: int = 0, data_dir=None
) -> Tuple[List[str], np.ndarray]:
    """Labeled texts -> (texts, values [N] float32 in {+1, -1}).

    ``path``: a file or a :class:`~jsteer.data.sources.Split` (see :func:`labeled_records`).
    fmt: "sst5" (JSON lines ``{sentence, label}``, labels 3-4 -> +1, 0-1 -> -1, 2 dropped),
    "jigsaw" (CSV ``text,label`` no header, 0 non-toxic -> +1, 1 toxic -> -1),
    "jsonl" (``{text, label}`` with label +1/-1 or 1/0), or "auto" (by extension / content; a
    split: by its label names). ``limit`` keeps a class-balanced random subset. Empty files
    raise a clear error.
    """
    recs, fmt = labeled_records(path, fmt, data_dir)
    if hasattr(path, "describe"):
        path = path.describe()
    if fmt == "sst5":
        pairs = [
            (r.text, 1.0 if r.label in SST5_POSITIVE else -1.0)
            for r in recs
            if r.label in SST5_POSITIVE + SST5_NEGATIVE
        ]
    elif fmt == "jigsaw":
        pairs = [(r.text, 1.0 if r.label == "0" else -1.0) for r in recs]
    else:
        pairs = [(r.text, -1.0 if r.label in ("-1", "0") else 1.0) for r in recs]
    if not pairs:
        raise ValueError(f"{path}: no usable labeled texts (after dropping neutral labels)")
    texts = [t for t, _ in pairs]
    values = np.asarray([v for _, v in pairs], np.float32)
    if limit is not None and limit < len(texts):
        rng = np.random.default_rng(seed)
        pos, neg = np.flatnonzero(values > 0), np.flatnonzero(values < 0)
        npos = min(len(pos), limit // 2)
        keep = np.concatenate(
            [rng.choice(pos, npos, replace=False), rng.choice(neg, min(len(neg), limit - npos), replace=False)]
        )
        keep = np.sort(keep)
        texts, values = [texts[i] for i in keep], values[keep]
    if (values > 0).all() or (values < 0).all():
        raise ValueError(
            f"{path}: training a steer needs both positive and negative texts, "
            f"got {int((values > 0).sum())} positive / {int((values < 0).sum())} negative"
        )
    return texts, values


# ----------------------------------------------------------------------------- hidden cache


@dataclasses.dataclass
class HiddenCache:
    """Final hidden states of every training token, packed (no padding).

    hidden [N_tok, D] (position t, predicting targets[t] = token t+1), targets [N_tok] int32,
    seq [N_tok] int32 (text index), values [N_seq, S_user] float32 steer values per text,
    offsets [N_seq + 1] (text i owns rows offsets[i]:offsets[i+1]).
    """

    hidden: np.ndarray
    targets: np.ndarray
    seq: np.ndarray
    values: np.ndarray
    offsets: np.ndarray

    @property
    def num_texts(self) -> int:
        return int(self.values.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])

    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.hidden, self.targets, self.seq, self.values, self.offsets))

    def subset(self, texts: np.ndarray) -> "HiddenCache":
        """The cache restricted to the given text indices (e.g. one class)."""
        texts = np.asarray(texts)
        counts = np.diff(self.offsets)[texts]
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in texts])
        return HiddenCache(
            hidden=self.hidden[rows],
            targets=self.targets[rows],
            seq=np.repeat(np.arange(len(texts), dtype=np.int32), counts),
            values=self.values[texts],
            offsets=np.concatenate([[0], np.cumsum(counts)]),
        )

    @classmethod
    def concat(cls, caches: Sequence["HiddenCache"]) -> "HiddenCache":
        """One cache holding the texts of ``caches`` in order (e.g. another class's texts cached
        separately). Every cache needs the same hidden size and number of steer-value columns."""
        if not caches:
            raise ValueError("HiddenCache.concat: no caches given")
        for c in caches[1:]:
            for what, a, b in (
                ("hidden size", c.hidden.shape[1], caches[0].hidden.shape[1]),
                ("steer-value columns", c.values.shape[1], caches[0].values.shape[1]),
            ):
                if a != b:
                    raise ValueError(f"HiddenCache.concat: {what} {a} != {b}")
        starts = np.cumsum([0] + [c.num_texts for c in caches[:-1]])
        rows = np.cumsum([0] + [c.num_tokens for c in caches[:-1]])
        return cls(
            hidden=np.concatenate([c.hidden for c in caches]),
            targets=np.concatenate([c.targets for c in caches]),
            seq=np.concatenate([c.seq + s for c, s in zip(caches, starts)]).astype(np.int32),
            values=np.concatenate([c.values for c in caches]),
            offsets=np.concatenate([caches[0].offsets[:1]] + [c.offsets[1:] + r for c, r in zip(caches, rows)]),
        )

    def save(self, path: str, key: Optional[dict] = None) -> str:
        """Write an ``.npz`` (the suffix is added when missing, as NumPy does) atomically, with
        ``key``: what the states were computed from (model identity, data file, ...), which
        :meth:`load` checks. Returns the path written."""
        path = npz_path(path)
        tmp = f"{path}.tmp-{os.getpid()}.npz"
        try:
            np.savez(
                tmp,
                hidden=self.hidden,
                targets=self.targets,
                seq=self.seq,
                values=self.values,
                offsets=self.offsets,
                key=np.asarray(json.dumps(key or {}, sort_keys=True)),
            )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    @classmethod
    def load(cls, path: str, key: Optional[dict] = None) -> "HiddenCache":
        """Read :meth:`save`'s file. With ``key``, every entry of it must equal the one saved:
        hidden states of another model, data file or truncation are refused, naming the field."""
        path = npz_path(path)
        with np.load(path) as z:
            saved = json.loads(str(z["key"])) if "key" in z.files else {}
            if key is not None:
                diff = sorted(k for k in key if saved.get(k) != key[k])
                if diff:
                    raise ValueError(
                        f"{path}: these cached hidden states do not match this run ("
                        + "; ".join(f"{k}: cached {saved.get(k)!r}, now {key[k]!r}" for k in diff)
                        + "); delete the file or give another cache path"
                    )
            return cls(**{k: z[k] for k in ("hidden", "targets", "seq", "values", "offsets")})


def npz_path(path: str) -> str:
    """``path`` with the ``.npz`` suffix :func:`numpy.savez` would give it."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else path + ".npz"


def cache_hidden(
    hidden_fn: Callable[[Array, Array], Array],
    encodings: Sequence[Sequence[int]],
    values: np.ndarray,
    batch_size: int = 16,
    pad_id: int = 0,
    bucket: int = 16,
    dtype=np.float32,
    progress: bool = False,
) -> HiddenCache:
    """Run the frozen backbone once over every text; keep each token's final hidden state.

    hidden_fn(ids [b, T], mask [b, T]) -> [b, T, D] unsteered final hidden states (right
    padding). encodings: token ids per text (each >= 2 tokens: a text needs a next-token
    target). values: [N] or [N, S_user] steer values (+1 / -1) per text. Texts are batched
    in length order with T rounded up to a multiple of ``bucket`` (few compiled shapes, little
    padding); the cache keeps the original text order.
    """
    values = np.asarray(values, np.float32)
    if values.ndim == 1:
        values = values[:, None]
    n = len(encodings)
    if n == 0:
        raise ValueError("cache_hidden: no training texts")
    if values.shape[0] != n:
        raise ValueError(f"cache_hidden: {n} texts but {values.shape[0]} label rows")
    lens = np.asarray([len(e) for e in encodings])
    if (lens < 2).any():
        bad = int(np.flatnonzero(lens < 2)[0])
        raise ValueError(f"cache_hidden: text {bad} has {int(lens[bad])} token(s); a text needs >= 2")
    order = np.argsort(lens, kind="stable")
    per_text: List[Optional[np.ndarray]] = [None] * n
    n_batches = (n + batch_size - 1) // batch_size
    with progress_bar(total=n, desc="cache hidden states", unit="text", enabled=progress) as bar:
        _cache_batches(hidden_fn, encodings, lens, order, per_text, n_batches, batch_size, pad_id, bucket, dtype, bar)
    counts = lens - 1
    return HiddenCache(
        hidden=np.concatenate(per_text),
        targets=np.concatenate([np.asarray(e[1:], np.int32) for e in encodings]),
        seq=np.repeat(np.arange(n, dtype=np.int32), counts),
        values=values,
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
    )


def _cache_batches(hidden_fn, encodings, lens, order, per_text, n_batches, batch_size, pad_id, bucket, dtype, bar):
    for b in range(n_batches):
        idx = order[b * batch_size : (b + 1) * batch_size]
        t = int(-(-lens[idx].max() // bucket) * bucket)
        ids = np.full((batch_size, t), pad_id, np.int32)
        mask = np.zeros((batch_size, t), np.int32)
        for r, i in enumerate(idx):
            ids[r, : lens[i]] = encodings[i]
            mask[r, : lens[i]] = 1
        ids[len(idx) :], mask[len(idx) :] = ids[0], mask[0]  # filler rows keep one compiled shape
        h = np.asarray(hidden_fn(jnp.asarray(ids), jnp.asarray(mask)))
        for r, i in enumerate(idx):
            per_text[i] = h[r, : lens[i] - 1].astype(dtype)
        bar.update(len(idx))


def encode_texts(tokenizer, texts: Sequence[str], values: np.ndarray, max_len: int = 128):
    """Tokenize; drop texts shorter than 2 tokens. -> (encodings, values, n_dropped)."""
    values = np.asarray(values, np.float32)
    encs = [e[:max_len] for e in (tokenizer.encode(t) for t in texts)]
    keep = [i for i, e in enumerate(encs) if len(e) >= 2]
    return [encs[i] for i in keep], values[keep], len(texts) - len(keep)


def cache_lm(
    lm, texts: Sequence[str], values: np.ndarray, max_len: int = 128, batch_size: int = 16, progress: bool = False
) -> HiddenCache:
    """:func:`cache_hidden` for a ``jsteer.lm.LM`` (final-norm output of ``lm.forward``)."""
    table = getattr(lm.config, "position_table_size", None)  # learned positions (GPT-2); RoPE has no table
    if table is not None and max_len > table:
        raise ValueError(
            f"max_len {max_len} (--max-len) exceeds the model's {table} learned positions: use max_len <= {table}"
        )
    encs, values, dropped = encode_texts(lm.tokenizer, texts, values, max_len)
    if not encs:
        raise ValueError(f"none of the {len(texts)} training texts has 2 or more tokens")
    if progress and dropped:
        print(f"  dropped {dropped} texts shorter than 2 tokens")
    pad = lm.tokenizer.pad_id if lm.tokenizer.pad_id is not None else 0
    return cache_hidden(
        lambda i, m: lm.forward(i, m).hidden, encs, values, batch_size=batch_size, pad_id=pad, progress=progress
    )


def sample_batch(cache: HiddenCache, rng: np.random.Generator, batch_size: int, budget: int) -> dict:
    """``batch_size`` random texts packed into ``budget`` token rows (static shape).

    Rows beyond the budget are dropped (the texts' tails); unused rows get weight 0.
    Returns numpy {"hidden" [budget, D], "targets" [budget], "values" [budget, S_user], "weight" [budget]}.
    """
    pick = rng.choice(cache.num_texts, size=min(batch_size, cache.num_texts), replace=False)
    rows = np.concatenate([np.arange(cache.offsets[i], cache.offsets[i + 1]) for i in pick])[:budget]
    n = rows.shape[0]
    pad = budget - n
    rows = np.concatenate([rows, np.zeros(pad, rows.dtype)])
    weight = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
    return {
        "hidden": cache.hidden[rows].astype(np.float32),
        "targets": cache.targets[rows],
        "values": cache.values[cache.seq[rows]],
        "weight": weight,
    }


def default_budget(cache: HiddenCache, batch_size: int) -> int:
    """Token rows per step: batch_size x the 90th-percentile text length, rounded up to 64."""
    lens = np.diff(cache.offsets)
    b = int(np.ceil(batch_size * np.percentile(lens, 90) / 64.0) * 64)
    return max(64, min(b, int(np.sort(lens)[-batch_size:].sum())))


# ----------------------------------------------------------------------------- objective


def step_eps(values: Array, eps0: float, dummy: bool) -> Array:
    """Per-row steer values [N, S_user] -> eps [N, S_user + dummy]."""
    if dummy:
        values = jnp.concatenate([values, jnp.ones(values.shape[:-1] + (1,), values.dtype)], -1)
    return values * eps0


def nll(params: head.Params, hidden: Array, targets: Array, weight: Array, eps: Array, embedding: Array) -> Array:
    """Weighted mean next-token cross-entropy of steered logits; hidden [N, D], eps [N, S]."""
    logits = head.apply(params, hidden, embedding, eps)  # [N, V]
    lse = logsumexp(logits)
    tgt = jnp.take_along_axis(logits, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return jnp.sum((lse - tgt) * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def cached_loss_fn(cfg: TrainConfig):
    """loss_fn(params, batch, rng) -> (loss, aux) for the training engine.

    params: {"steer": steer params (trained), "embedding": E [V, D] (frozen)}; batch from
    :func:`sample_batch`. The frozen embedding travels as an argument, never as a constant
    baked into the compiled program.
    """

    def loss_fn(params, batch, rng=None):
        eps = step_eps(batch["values"], cfg.eps0, cfg.dummy)
        ce = nll(params["steer"], batch["hidden"], batch["targets"], batch["weight"], eps, params["embedding"])
        loss = ce + cfg.l2 * head.l2(params["steer"]) if cfg.l2 else ce
        return loss, {"ce": ce}

    return loss_fn


def forward_loss_fn(hidden_fn: Callable[[Any, Array, Array], Array], cfg: TrainConfig):
    """The original's per-step cost: run the frozen backbone on every batch.

    hidden_fn(backbone_params, ids, mask) -> [B, T, D]. params: {"steer", "embedding",
    "backbone"}; batch: {"ids" [B, T], "mask" [B, T] right-padded, "values" [B, S_user]}.
    """

    def loss_fn(params, batch, rng=None):
        h = jax.lax.stop_gradient(hidden_fn(params["backbone"], batch["ids"], batch["mask"]))  # [B, T, D]
        b, t, d = h.shape
        eps = step_eps(batch["values"], cfg.eps0, cfg.dummy)  # [B, S]
        eps_tok = jnp.broadcast_to(eps[:, None, :], (b, t - 1, eps.shape[-1])).reshape(-1, eps.shape[-1])
        weight = (batch["mask"][:, 1:] * batch["mask"][:, :-1]).reshape(-1).astype(jnp.float32)
        ce = nll(
            params["steer"],
            h[:, :-1].reshape(-1, d),
            batch["ids"][:, 1:].reshape(-1),
            weight,
            eps_tok,
            params["embedding"],
        )
        loss = ce + cfg.l2 * head.l2(params["steer"]) if cfg.l2 else ce
        return loss, {"ce": ce}

    return loss_fn


# ----------------------------------------------------------------------------- loop


def init_params(cfg: TrainConfig, hidden_dim: int, vocab_size: int, num_user_steers: int = 1) -> dict:
    init = _INIT_PARAMS[cfg.kind]  # a kind TrainConfig accepted
    return init(jax.random.PRNGKey(cfg.seed), cfg, hidden_dim, vocab_size, num_user_steers + int(cfg.dummy))


def make_trainer(cfg: TrainConfig, params: dict, loss_fn: Optional[Callable] = None, **kw):
    """The :class:`jsteer.train.Trainer` a steer trains on: ``params["steer"]`` trained with plain
    Adam at ``cfg.lr`` (constant, no clipping, no weight decay: the paper's), every other entry
    of ``params`` (the embedding, a backbone) frozen; ``loss_fn`` default
    :func:`cached_loss_fn`; ``kw``: further Trainer options."""
    from jsteer.train import OptimizerConfig, Trainer

    opt = OptimizerConfig(
        learning_rate={"steer": cfg.lr, "frozen": None},
        labels=lambda path, leaf: "steer" if path[0] == "steer" else "frozen",
        schedule="constant",
        clip_norm=None,
        weight_decay=0.0,
    )
    kw = {"progress": False, "log_every": cfg.log_every, "seed": cfg.seed, **kw}
    return Trainer(loss_fn or cached_loss_fn(cfg), params, opt, **kw)


def train(
    cache: HiddenCache,
    embedding: np.ndarray,
    cfg: TrainConfig = TrainConfig(),
    params: Optional[dict] = None,
    progress: bool = False,
) -> Tuple[dict, dict]:
    """Train steer params on cached hidden states with :func:`make_trainer`'s
    :class:`jsteer.train.Trainer` (the project's engine: device mesh, JSONL-able metrics).

    Returns (params, history) with history {"step": [...], "loss": [...], "seconds",
    "steps_per_s", "tokens_per_batch", "final_loss"} (seconds exclude compilation; losses of
    the 0-based steps 0, log_every, 2 log_every, ... and the last).
    A SIGTERM stops training after the current step with ``sys.exit(143)`` (the engine's
    preemption exit; nothing to checkpoint), so no caller mistakes a cut run for a steer.
    """
    if cache.num_texts == 0:
        raise ValueError("no training texts in the hidden cache")
    v, d = embedding.shape
    if cache.hidden.shape[1] != d:
        raise ValueError(f"cached hidden size {cache.hidden.shape[1]} != embedding hidden size {d}")
    if params is None:
        params = init_params(cfg, d, v, cache.values.shape[1])
    budget = cfg.tokens_per_batch or default_budget(cache, cfg.batch_size)
    rng = np.random.default_rng(cfg.seed)
    batches = (sample_batch(cache, rng, cfg.batch_size, budget) for _ in range(cfg.steps))
    trainer = make_trainer(cfg, {"steer": params, "embedding": jnp.asarray(embedding, jnp.float32)}, progress=progress)
    hist: Dict[str, Any] = {"step": [], "loss": []}
    timer = {"t0": None}

    @trainer.add_hook
    def record(info):
        i0 = info.step - 1
        if i0 == 0:
            jax.block_until_ready(info.metrics["loss"])
            timer["t0"] = time.time()  # exclude compilation
        if i0 % cfg.log_every == 0 or info.final:
            hist["step"].append(i0)
            hist["loss"].append(info.loss)
            if trainer.bar is not None:
                trainer.bar.set_postfix(loss=f"{info.loss:.4f}", refresh=False)

    trainer.fit(batches, cfg.steps, resume=False)
    # host copies: the engine's arrays live on its device mesh, which would clash with a
    # model pinned to one device (e.g. restored from a checkpoint) in one jitted call
    params = {k: jnp.asarray(np.asarray(x)) for k, x in trainer.params["steer"].items()}
    jax.block_until_ready(params)
    secs = time.time() - timer["t0"] if timer["t0"] is not None else 0.0
    hist["seconds"] = secs
    hist["steps_per_s"] = (cfg.steps - 1) / secs if cfg.steps > 1 and secs > 0 else float("nan")
    hist["tokens_per_batch"] = budget
    hist["final_loss"] = hist["loss"][-1] if hist["loss"] else None
    return params, hist


def eval_nll(
    params: dict,
    cache: HiddenCache,
    embedding: np.ndarray,
    values: Sequence[float],
    eps0: float = 1e-3,
    dummy: bool = True,
    chunk: int = 1024,
) -> float:
    """Mean per-token NLL of every cached token under fixed steer values (e.g. [+1] or [-1])."""
    emb = jnp.asarray(embedding)
    eps = head.make_eps(values, eps0, dummy)

    @jax.jit
    def f(h, t, w):
        e = jnp.broadcast_to(eps, (h.shape[0], eps.shape[-1]))
        return nll(params, h, t, w, e, emb) * jnp.sum(w)

    tot, n = 0.0, 0
    for s in range(0, cache.num_tokens, chunk):
        h = cache.hidden[s : s + chunk].astype(np.float32)
        t = cache.targets[s : s + chunk]
        w = np.ones(len(t), np.float32)
        if len(t) < chunk:
            pad = chunk - len(t)
            h = np.concatenate([h, np.zeros((pad, h.shape[1]), np.float32)])
            t = np.concatenate([t, np.zeros(pad, t.dtype)])
            w = np.concatenate([w, np.zeros(pad, np.float32)])
        tot += float(f(h, t, w))
        n += int(min(chunk, cache.num_tokens - s))
    return tot / n
