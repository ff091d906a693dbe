"""Batched, jitted scoring of encoded LAMA examples with type vectors (the probe's computation).

:class:`ProbeModel` is what probing needs from a backbone (:func:`from_lm`, :func:`for_bert_mlm`,
:func:`for_decoder`): forward, the head at the predicting positions (h [B, D] -> logits [B, V])
and the input embedding [V, D] type vectors live in.

Scoring
  Rows (example, lambda, type vector) are bucketed by length (multiples of 8), padded to a
  fixed batch, and scored by one jitted function per bucket shape: lambda and the type
  vector are traced per row, so a whole lambda grid, several relations and several types
  share batches and compile once. Output per row: the gold's rank among non-special tokens
  (P@k = rank < k), the PostTE ranks for a grid of weights, and the top-1 id.

:func:`score_rows` returns per row ranks [R] (the gold's), PostTE ranks [R, len(post_grid)] and
top-1 ids [R] (:class:`RowResult`); :func:`score_grid` (decoders, one KV-cached prompt pass per
example for a whole lambda grid) returns them per lambda (:class:`GridResult`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.data import buckets
from jsteer.hooks import FiLM, Hooks
from jsteer.typevec.inject import inject, one_hot_positions, residual_hooks
from jsteer.typevec.lama import Example

Array = jnp.ndarray

POST_GRID = (0.0, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)

# ----------------------------------------------------------------------------- model adapter


@dataclasses.dataclass(frozen=True, eq=False)
class ProbeModel:
    """What probing needs from a backbone.

    forward(params, ids [B,T], attention_mask [B,T], hooks) -> ModelOutput;
    head(params, h [B,D]) -> logits [B,V] at the predicting positions;
    input_embedding(params) -> [V,D] (type vectors are built from and injected into this space).
    """

    kind: str  # "mlm" | "decoder"
    forward: Callable
    head: Callable
    input_embedding: Callable
    params: Any
    tokenizer: Any
    identity: str = ""
    excluded_ids: tuple[int, ...] = ()
    init_cache: Optional[Callable] = None  # decoders: (batch, slots) -> KVCache

    @functools.cached_property
    def score_fn(self):
        return jax.jit(
            functools.partial(_score_rows, self.forward, self.head, self.input_embedding),
            static_argnames=("mode", "layer"),
        )

    @functools.cached_property
    def grid_fn(self):
        if self.init_cache is None:
            raise ValueError("this model has no KV cache: use score_rows")
        return jax.jit(
            functools.partial(_score_grid, self.forward, self.head, self.input_embedding, self.init_cache),
            static_argnames=("layer",),
        )

    def embedding(self) -> Array:
        return self.input_embedding(self.params)


def _special_ids(tokenizer) -> tuple[int, ...]:
    ids = []
    for role in ("pad", "bos", "eos", "unk", "mask", "cls", "sep"):
        i = getattr(tokenizer, f"{role}_id", None)
        if i is not None:
            ids.append(int(i))
    return tuple(sorted(set(ids)))


def for_bert_mlm(module, params, tokenizer, identity: str = "") -> ProbeModel:
    """ProbeModel for a :class:`jsteer.backbones.bert_heads.BertForMaskedLM` (params with "head")."""
    from jsteer.backbones import bert, bert_heads

    if "head" not in params:
        raise ValueError(
            "MLM probing needs a BERT with an MLM head (params['head'] missing); "
            "MiniLM has none - use it for retrieval / analysis only"
        )
    cfg = module.config
    head_mod = bert_heads.MLMHead(cfg)

    def forward(p, ids, mask, hooks, **kw):
        return module.apply({"params": p}, ids, attention_mask=mask, hooks=hooks, **kw)

    def head(p, h):
        emb = p["encoder"]["embeddings"]["word"]["embedding"] if cfg.tie_word_embeddings else None
        return head_mod.apply({"params": p["head"]}, h[:, None, :], emb)[:, 0]

    return ProbeModel("mlm", forward, head, bert.input_embeddings, params, tokenizer, identity, _special_ids(tokenizer))


def for_decoder(module, params, tokenizer, family: str, config, identity: str = "") -> ProbeModel:
    """ProbeModel for a decoder (``family`` "decoder"): logits = h @ E_out^T at the
    predicting position only (the full [B,T,V] logits are never needed, and XLA drops them)."""
    from jsteer.backbones import get_family

    fam = get_family(family)

    def forward(p, ids, mask, hooks, **kw):
        return module.apply({"params": p}, ids, attention_mask=mask, hooks=hooks, **kw)

    def head(p, h):
        return jnp.einsum("bd,vd->bv", h, fam.output_embeddings(p, config).astype(h.dtype))

    return ProbeModel(
        "decoder",
        forward,
        head,
        fam.input_embeddings,
        params,
        tokenizer,
        identity,
        _special_ids(tokenizer),
        init_cache=lambda b, s: config.init_cache(b, s),
    )


def from_lm(lm) -> ProbeModel:
    """ProbeModel from a :func:`jsteer.load` result."""
    if lm.family == "bert":
        return for_bert_mlm(lm.module, lm.params, lm.tokenizer, lm.identity)
    return for_decoder(lm.module, lm.params, lm.tokenizer, lm.family, lm.config, lm.identity)


# ----------------------------------------------------------------------------- jitted scoring


def _score_rows(
    forward,
    head,
    input_embedding,
    params,
    ids,
    attn,
    pos,
    gold,
    te,
    lam,
    post_w,
    excluded,
    *,
    mode: str,
    layer: Optional[int] = None,
):
    """One padded batch.

    ids/attn [B,T]; pos, gold [B]; te [B,D]; lam [B]; post_w [W]; excluded [V] bool.
    mode: "pos" (offset at the predicting position) | "all" (every real prompt token) |
    "layer" (residual stream after decoder layer ``layer``, predicting position).
    Returns rank [B] (number of allowed tokens scoring above the gold), post_rank [W,B], top1 [B].
    """
    t = ids.shape[1]
    where = attn.astype(jnp.float32) if mode == "all" else one_hot_positions(pos, t)
    hooks = residual_hooks(te, lam, where, layer) if mode == "layer" else inject(te, lam, where)
    out = forward(params, ids, attn, hooks)
    h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]  # [B, D]
    return _rank_and_post(head, input_embedding, params, h, gold, te, post_w, excluded)


def _rank_and_post(head, input_embedding, params, h, gold, te, post_w, excluded):
    logits = head(params, h).astype(jnp.float32)  # [R, V]
    logits = jnp.where(excluded[None, :], -jnp.inf, logits)
    g = jnp.take_along_axis(logits, gold[:, None], axis=1)
    rank = jnp.sum(logits > g, axis=1)
    emb = input_embedding(params).astype(jnp.float32)
    en = emb / jnp.maximum(jnp.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    tn = te / jnp.maximum(jnp.linalg.norm(te, axis=1, keepdims=True), 1e-12)
    cos = jnp.einsum("vd,rd->rv", en, tn.astype(jnp.float32))
    post = logits[None] + post_w[:, None, None] * cos[None]  # [W, R, V]
    pg = jnp.take_along_axis(post, jnp.broadcast_to(gold[None, :, None], post.shape[:2] + (1,)), axis=2)
    return rank, jnp.sum(post > pg, axis=2), jnp.argmax(logits, axis=1)


def _score_grid(
    forward,
    head,
    input_embedding,
    init_cache,
    params,
    ids,
    attn,
    gold,
    te,
    lam,
    post_w,
    excluded,
    *,
    layer: Optional[int] = None,
):
    """Decoders, TE at the predicting position (input embedding, or the residual stream after
    decoder layer ``layer`` when given), a grid of L lambdas per prompt.

    ids/attn [B,T] left-padded (the predicting position is column T-1); gold [B]; te [B,D];
    lam [B,L]. The prefix (columns 0..T-2) does not depend on lambda, so it runs once into a KV
    cache; only the last token runs for each of the B*L (prompt, lambda) rows.
    Returns rank [B,L], post_rank [W,B,L], top1 [B,L].
    """
    b, t = ids.shape
    n_l = lam.shape[1]
    cache = init_cache(b, t)
    cache = forward(params, ids[:, :-1], attn[:, :-1], None, cache=cache).cache

    def rep(x):
        return jnp.repeat(x, n_l, axis=0)

    cache = cache.replace(
        k=jax.tree.map(rep, cache.k), v=jax.tree.map(rep, cache.v), mask=rep(cache.mask), pos=rep(cache.pos)
    )
    te_r = rep(te)
    off = (lam.reshape(-1)[:, None] * te_r)[:, None, :]  # [B*L, 1, D]
    hooks = Hooks(embed_offset=off) if layer is None else Hooks(film={layer: FiLM(beta_out=off)})
    out = forward(params, rep(ids[:, -1:]), jnp.ones((b * n_l, 1), jnp.int32), hooks, cache=cache)
    rank, post_rank, top1 = _rank_and_post(
        head, input_embedding, params, out.hidden[:, 0], rep(gold), te_r, post_w, excluded
    )
    return rank.reshape(b, n_l), post_rank.reshape(-1, b, n_l), top1.reshape(b, n_l)


def _length_batches(lengths: Sequence[int], multiple: int, batch_size: int):
    """Yield (T, chunk, idx): rows grouped by length T rounded up to a multiple of ``multiple``
    (:data:`jsteer.data.buckets.PROBE` for 8; shortest first, stable), in chunks of <=
    ``batch_size``; ``idx`` is ``chunk`` padded to ``batch_size`` with its first row."""
    groups = collections.defaultdict(list)
    for j in np.argsort(np.asarray(lengths, np.int64), kind="stable"):
        groups[buckets.bucket(int(lengths[j]), (multiple,), "multiple")].append(int(j))
    for t, rows in sorted(groups.items()):
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            yield t, chunk, chunk + [chunk[0]] * (batch_size - len(chunk))


@dataclasses.dataclass
class RowResult:
    rank: np.ndarray  # [R]
    post_rank: np.ndarray  # [W, R]
    top1: np.ndarray  # [R]
    n_batches: int
    n_padded_rows: int


def _store_batch(out, chunk: np.ndarray, rank: np.ndarray, post_rank: np.ndarray, top1: np.ndarray) -> int:
    """Writes the real rows of one batch's (rank, post_rank, top1) output (padded to the batch
    size) into the result arrays at rows ``chunk`` (post_rank [W, ...]: at [:, chunk]);
    -> the number of real rows."""
    rk, prk, tp = (np.asarray(o) for o in out)
    k = len(chunk)
    rank[chunk], post_rank[:, chunk], top1[chunk] = rk[:k], prk[:, :k], tp[:k]
    return k


def _run_batches(examples, row_example, bucket, batch_size, pad_id, left_pad, call, results, progress) -> int:
    """Runs ``call(ids [B, T], attn [B, T], pos [B], gold [B], idx)`` on the rows' examples
    (row j asks ``examples[row_example[j]]``) in length-bucketed batches of ``batch_size`` rows
    (:func:`_length_batches`; ``idx`` the batch's rows, padded with its first), padded right (or
    left) with ``pad_id``, and stores each call's (rank, post_rank, top1) in ``results`` at the
    batch's rows; ``progress(done, rows)`` after each. -> the number of batches."""
    rows = len(row_example)
    lengths = [len(examples[i].ids) for i in row_example]
    n_batches = done = 0
    for t, chunk, idx in _length_batches(lengths, bucket, batch_size):
        ids = np.full((batch_size, t), pad_id, np.int32)
        attn = np.zeros((batch_size, t), np.int32)
        pos = np.zeros((batch_size,), np.int32)
        gold = np.zeros((batch_size,), np.int32)
        for b, j in enumerate(idx):
            ex = examples[row_example[j]]
            span = slice(t - len(ex.ids), t) if left_pad else slice(0, len(ex.ids))
            ids[b, span] = ex.ids
            attn[b, span] = 1
            pos[b], gold[b] = ex.pos, ex.gold
        out = call(jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(pos), jnp.asarray(gold), idx)
        done += _store_batch(out, chunk, *results)
        n_batches += 1
        if progress is not None:
            progress(done, rows)
    return n_batches


def score_rows(
    model: ProbeModel,
    examples: Sequence[Example],
    row_example: Sequence[int],
    row_lam: Sequence[float],
    row_te: Sequence[int],
    tes: Array,
    *,
    mode: str = "pos",
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    bucket: int = buckets.PROBE.sizes[0],
    progress: Optional[Callable[[int, int], None]] = None,
    layer: Optional[int] = None,
) -> RowResult:
    """Score R rows: row r asks ``examples[row_example[r]]`` with ``row_lam[r] * tes[row_te[r]]``.

    tes: [K, D] type vectors. mode: "pos" | "all" | "layer" (decoders; MLM uses "pos" = the
    [MASK]); ``layer``: the decoder layer for mode "layer".
    """
    check_mode(mode, layer, model.kind)
    row_example = np.asarray(row_example, np.int64)
    row_lam = np.asarray(row_lam, np.float32)
    row_te = np.asarray(row_te, np.int64)
    r = len(row_example)
    if not (len(row_lam) == len(row_te) == r):
        raise ValueError("row_example, row_lam and row_te must have the same length")
    tes = jnp.asarray(tes, jnp.float32)
    if tes.ndim != 2:
        raise ValueError(f"tes must be [K, D], got shape {tes.shape}")
    excluded, post_w, pad_id = score_constants(model, post_grid)

    rank = np.zeros((r,), np.int64)
    post_rank = np.zeros((len(post_grid), r), np.int64)
    top1 = np.zeros((r,), np.int64)

    def call(ids, attn, pos, gold, idx):
        te, lam = tes[jnp.asarray(row_te[idx])], jnp.asarray(row_lam[idx])
        return model.score_fn(model.params, ids, attn, pos, gold, te, lam, post_w, excluded, mode=mode, layer=layer)

    n_batches = _run_batches(
        examples, row_example, bucket, batch_size, pad_id, False, call, (rank, post_rank, top1), progress
    )
    return RowResult(rank, post_rank, top1, n_batches, n_batches * batch_size - r)


@dataclasses.dataclass
class GridResult:
    rank: np.ndarray  # [N, L]
    post_rank: np.ndarray  # [W, N, L]
    top1: np.ndarray  # [N, L]
    n_batches: int
    n_padded_rows: int


def score_grid(
    model: ProbeModel,
    examples: Sequence[Example],
    ex_idx: Sequence[int],
    lams,
    te_idx: Sequence[int],
    tes: Array,
    *,
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    bucket: int = buckets.PROBE.sizes[0],
    progress: Optional[Callable[[int, int], None]] = None,
    layer: Optional[int] = None,
) -> GridResult:
    """Decoders, TE at the predicting position (``layer``: in the residual stream after that
    layer): prompt n is asked with each of ``lams[n]`` ([N, L], or [L] for all) times
    ``tes[te_idx[n]]``. The lambda-independent prefix runs once per prompt (KV cache), then the
    last token for every lambda. ``batch_size`` prompts per call."""
    ex_idx = np.asarray(ex_idx, np.int64)
    n = len(ex_idx)
    lams = np.asarray(lams, np.float32)
    if lams.ndim == 1:
        lams = np.broadcast_to(lams, (n, lams.shape[0]))
    if lams.shape[0] != n or len(te_idx) != n:
        raise ValueError(f"lams {lams.shape} and te_idx ({len(te_idx)}) must have one row per prompt ({n})")
    te_idx = np.asarray(te_idx, np.int64)
    tes = jnp.asarray(tes, jnp.float32)
    n_l = lams.shape[1]
    excluded, post_w, pad_id = score_constants(model, post_grid)
    if any(examples[i].pos != len(examples[i].ids) - 1 for i in ex_idx):
        raise ValueError("score_grid needs decoder examples (predicting position = last token)")
    rank = np.zeros((n, n_l), np.int64)
    post_rank = np.zeros((len(post_grid), n, n_l), np.int64)
    top1 = np.zeros((n, n_l), np.int64)

    def call(ids, attn, pos, gold, idx):  # pos: the last token, where the grid always predicts
        te, lam = tes[jnp.asarray(te_idx[idx])], jnp.asarray(lams[idx])
        return model.grid_fn(model.params, ids, attn, gold, te, lam, post_w, excluded, layer=layer)

    results = (rank, post_rank, top1)
    n_batches = _run_batches(examples, ex_idx, bucket, batch_size, pad_id, True, call, results, progress)
    return GridResult(rank, post_rank, top1, n_batches, n_batches * batch_size - n)


def score(
    model: ProbeModel,
    examples: Sequence[Example],
    ex_idx: Sequence[int],
    lams,
    te_idx: Sequence[int],
    tes: Array,
    *,
    mode: str = "pos",
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    layer: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> GridResult:
    """Prompt x lambda grid, by the fastest exact route: :func:`score_grid` for decoders with TE
    at the predicting position, else :func:`score_rows` on the flattened (prompt, lambda) rows."""
    check_mode(mode, layer, model.kind)
    if model.kind == "decoder" and mode in ("pos", "layer") and model.init_cache is not None:
        return score_grid(
            model,
            examples,
            ex_idx,
            lams,
            te_idx,
            tes,
            post_grid=post_grid,
            batch_size=batch_size,
            layer=layer if mode == "layer" else None,
            progress=progress,
        )
    ex_idx = np.asarray(ex_idx, np.int64)
    n = len(ex_idx)
    lams = np.asarray(lams, np.float32)
    if lams.ndim == 1:
        lams = np.broadcast_to(lams, (n, lams.shape[0]))
    n_l = lams.shape[1]
    res = score_rows(
        model,
        examples,
        np.repeat(ex_idx, n_l),
        lams.reshape(-1),
        np.repeat(np.asarray(te_idx), n_l),
        tes,
        mode=mode,
        post_grid=post_grid,
        batch_size=batch_size,
        layer=layer,
        progress=progress,
    )
    return GridResult(
        res.rank.reshape(n, n_l),
        res.post_rank.reshape(len(post_grid), n, n_l),
        res.top1.reshape(n, n_l),
        res.n_batches,
        res.n_padded_rows,
    )


def check_mode(mode: str, layer: Optional[int], kind: str) -> None:
    if mode not in ("pos", "all", "layer"):
        raise ValueError(f"mode must be 'pos', 'all' or 'layer', got {mode!r}")
    if mode == "all" and kind == "mlm":
        # every attended token of an MLM prompt includes [CLS] / [SEP]; the paper puts TE at [MASK]
        raise ValueError("mode 'all' is for decoders only; an MLM takes the TE at its [MASK] (mode 'pos')")
    if mode == "layer":
        if kind != "decoder":
            raise ValueError("mode 'layer' (residual-stream TE) is for decoders only")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"mode 'layer' needs a non-negative int layer, got {layer!r}")
    elif layer is not None:
        raise ValueError(f"layer={layer} is only used with mode 'layer' (got mode {mode!r})")


def score_constants(model: ProbeModel, post_grid: Sequence[float]):
    vocab = model.embedding().shape[0]
    excluded = np.zeros((vocab,), bool)
    excluded[[i for i in model.excluded_ids if i < vocab]] = True
    pad_id = getattr(model.tokenizer, "pad_id", None)
    return jnp.asarray(excluded), jnp.asarray(post_grid, jnp.float32), 0 if pad_id is None else int(pad_id)
