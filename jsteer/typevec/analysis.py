"""Analyses of type embeddings (paper Section 4 / Tables 1, 2, 9, Figures 3-5).

* :func:`neighbours` - type retrieval: nearest vocabulary tokens to a TE by cosine (Table 1).
* :func:`singular_kurtosis` - how stable each singular vector is over random example sets:
  per run the mean of the i-th right-singular vector's entries, kurtosis over runs (Figure 3).
* :func:`adversarial` - adversarial accuracy (AA: share of held-out typed tokens whose
  probability rises when lambda*TE is added) and adversarial sensitivity (AS: d log p / d
  lambda at 0, i.e. the gradient w.r.t. the input-embedding offset dotted with TE, from
  ``jax.grad``), over repeats, with a random-direction control (Table 2).
* :func:`linear_probe` / :func:`layer_probes` / :func:`tcav` - layer-wise linear classifiers
  "is this prompt asking for type T?" on the predicting-position representation, with and
  without TE, and TCAV scores from their concept vectors (Figures 4-5).
* :func:`concept_generation_hooks` - a concept vector (e.g. from toxic words) added with a
  (negative) lambda at every prompt and generated token (Table 9).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.hooks import FiLM, Hooks
from jsteer.train.probe import fit_logistic
from jsteer.typevec import core
from jsteer.typevec.inject import generation_hooks, inject, one_hot_positions

Array = jnp.ndarray

# ----------------------------------------------------------------------------- retrieval


@jax.jit
def cosine_to_vocab(te: Array, embedding: Array) -> Array:
    """te [D], embedding [V, D] -> cosine similarity [V]."""
    en = embedding / jnp.maximum(jnp.linalg.norm(embedding, axis=1, keepdims=True), 1e-12)
    return en @ (te / jnp.maximum(jnp.linalg.norm(te), 1e-12))


def neighbours(
    te: Array, embedding: Array, k: int = 10, exclude_ids: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k vocabulary ids by cosine with ``te`` -> (ids [k], cosines [k]), best first."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    sims = cosine_to_vocab(jnp.asarray(te, jnp.float32), jnp.asarray(embedding, jnp.float32))
    if len(exclude_ids):
        sims = sims.at[jnp.asarray(list(exclude_ids))].set(-jnp.inf)
    vals, ids = jax.lax.top_k(sims, k)
    return np.asarray(ids), np.asarray(vals)


# ----------------------------------------------------------------------------- kurtosis


def excess_kurtosis(x: np.ndarray | Array, axis: int = -1) -> np.ndarray:
    """Fisher (excess) kurtosis, biased estimator (scipy.stats.kurtosis defaults)."""
    x = np.asarray(x, np.float64)
    m = x.mean(axis=axis, keepdims=True)
    m2 = ((x - m) ** 2).mean(axis=axis)
    m4 = ((x - m) ** 4).mean(axis=axis)
    return m4 / np.maximum(m2**2, 1e-300) - 3.0


@jax.jit
def _run_svds(embedding: Array, idx: Array) -> tuple[Array, Array, Array]:
    x = jnp.take(embedding, idx, axis=0).astype(jnp.float32)  # [R, N, D]
    _, s, vt = jax.vmap(lambda a: jnp.linalg.svd(a, full_matrices=False))(x)
    return s, vt, x.mean(axis=1)


def singular_kurtosis(
    embedding: Array,
    pool_ids: Sequence[int],
    n_runs: int = 500,
    n_samples: int = 10,
    components: Sequence[int] = (0, 1, 2, 3),
    seed: int = 0,
) -> dict:
    """Figure 3: for ``n_runs`` random sets of ``n_samples`` examples drawn (uniformly, without
    replacement) from ``pool_ids``, the mean entry of the i-th right-singular vector per run.

    Returned per component: kurtosis of those means with raw LAPACK signs ("raw", as the paper)
    and with each vector oriented towards the set's mean embedding ("oriented", our sign
    convention), plus the mean |cosine| between runs' vectors and a run's first vector
    ("stability"), and the raw values for histograms.
    """
    pool = np.asarray(pool_ids, np.int64)
    if pool.size < n_samples:
        raise ValueError(f"pool has {pool.size} tokens, fewer than n_samples={n_samples}")
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(pool, size=n_samples, replace=False) for _ in range(n_runs)])
    s, vt, means = _run_svds(jnp.asarray(embedding), jnp.asarray(idx))
    vt, means = np.asarray(vt, np.float64), np.asarray(means, np.float64)
    out = {}
    for c in components:
        if c >= vt.shape[1]:
            raise ValueError(f"component {c} does not exist with {n_samples} samples")
        v = vt[:, c, :]  # [R, D]
        sign = np.sign(np.einsum("rd,rd->r", v, means))
        sign[sign == 0] = 1.0
        vo = v * sign[:, None]
        raw_means, or_means = v.mean(axis=1), vo.mean(axis=1)
        ref = vo[0] / np.linalg.norm(vo[0])
        stab = float(np.mean(np.abs(vo @ ref)))
        out[int(c)] = {
            "kurtosis_raw": float(excess_kurtosis(raw_means)),
            "kurtosis_oriented": float(excess_kurtosis(or_means)),
            "stability": stab,
            "values_raw": raw_means.tolist(),
            "values_oriented": or_means.tolist(),
        }
    out["singular_values_mean"] = np.asarray(s).mean(axis=0).tolist()
    return out


# ----------------------------------------------------------------------------- AA / AS


def adversarial(
    logprob_fn: Callable[[Array], Array], te: Array, lam: float, token_sets: np.ndarray, seed: int = 0
) -> dict:
    """Adversarial accuracy and sensitivity of a type vector (Table 2).

    logprob_fn: offset [D] -> log-probabilities [V] at the probed position when ``offset`` is
      added to that position's input embedding (averaged over prompts if the caller wishes);
      must be differentiable (it is called under ``jax.grad``).
    token_sets: [R, M] held-out typed token ids, one row per repeat.
    AA_r = mean_m [log p_m(lam*TE) > log p_m(0)];  AS_r = d/dlam mean_m log p_m(lam*TE) at 0
    = grad_offset(mean_m log p_m)(0) . TE. A random unit direction with TE's norm is the control.
    Returns mean/std over repeats for TE and the control, and the per-repeat values.
    """
    te = jnp.asarray(te, jnp.float32)
    token_sets = np.asarray(token_sets)
    if token_sets.ndim != 2:
        raise ValueError(f"token_sets must be [repeats, tokens], got shape {token_sets.shape}")
    d = te.shape[0]
    zero = jnp.zeros((d,), jnp.float32)

    def mean_lp(offset, toks):
        return jnp.mean(logprob_fn(offset)[toks])

    grad_fn = jax.jit(jax.grad(mean_lp))
    lp_fn = jax.jit(logprob_fn)
    base = lp_fn(zero)
    rng = np.random.default_rng(seed)
    res = {"TE": {"AA": [], "AS": []}, "random": {"AA": [], "AS": []}}
    for r in range(token_sets.shape[0]):
        toks = jnp.asarray(token_sets[r])
        rnd = rng.standard_normal(d).astype(np.float32)
        rnd = jnp.asarray(rnd / np.linalg.norm(rnd)) * jnp.linalg.norm(te)
        g = grad_fn(zero, toks)
        for name, v in (("TE", te), ("random", rnd)):
            lp = lp_fn(lam * v)
            res[name]["AA"].append(float(jnp.mean(lp[toks] > base[toks])))
            res[name]["AS"].append(float(jnp.vdot(g, v)))
    out = {}
    for name, vals in res.items():
        out[name] = {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "runs": v} for k, v in vals.items()}
    out["lambda"] = float(lam)
    out["repeats"] = int(token_sets.shape[0])
    out["tokens_per_repeat"] = int(token_sets.shape[1])
    return out


def prompt_logprob_fn(
    forward: Callable, head: Callable, params, ids: np.ndarray, attn: np.ndarray, pos: np.ndarray
) -> Callable[[Array], Array]:
    """Build ``logprob_fn(offset [D]) -> [V]`` for :func:`adversarial` from a ProbeModel-style
    ``forward`` / ``head``: the offset is added at each row's predicting position ``pos`` and the
    log-softmax is averaged over the rows."""
    ids, attn, pos = jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(pos)
    where = one_hot_positions(pos, ids.shape[1])

    def fn(offset):
        hooks = inject(offset, 1.0, where)
        out = forward(params, ids, attn, hooks)
        h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.log_softmax(head(params, h).astype(jnp.float32), axis=-1), axis=0)

    return fn


# ----------------------------------------------------------------------------- layer-wise probes


@functools.partial(jax.jit, static_argnames=("forward",))
def _position_states(params, ids, attn, pos, hooks, *, forward):
    out = forward(params, ids, attn, hooks, output_hidden_states=True)
    hs = jnp.stack(out.hidden_states)  # [L+1, B, T, D]
    return jnp.take_along_axis(hs, pos[None, :, None, None], axis=2)[:, :, 0]


def position_states(forward: Callable, params, ids, attn, pos, hooks: Optional[Hooks] = None) -> Array:
    """Hidden states of every layer at each row's predicting position -> [L+1, B, D] (jitted)."""
    return _position_states(params, jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(pos), hooks, forward=forward)


def linear_probe(x: Array, y: Array, l2: float = 1e-2, steps: int = 300, lr: float = 0.1) -> tuple[Array, Array]:
    """Logistic regression on standardised features (:func:`jsteer.train.probe.fit_logistic`).
    x [N, D], y [N] in {0,1} -> (w [D], b []), weights in the original feature space (so w is a
    concept direction for TCAV)."""
    return fit_logistic(x, y, l2=l2, steps=steps, lr=lr).direction()


def probe_metrics(w: Array, b: Array, x: Array, y: Array) -> dict:
    pred = (np.asarray(x @ w + b) > 0).astype(int)
    y = np.asarray(y).astype(int)
    tp = int(((pred == 1) & (y == 1)).sum())
    fp = int(((pred == 1) & (y == 0)).sum())
    fn = int(((pred == 0) & (y == 1)).sum())
    f1 = 2 * tp / max(2 * tp + fp + fn, 1)
    return {"acc": float((pred == y).mean()), "f1": float(f1)}


def layer_probes(x_train: Array, y_train: Array, x_test: Array, y_test: Array) -> tuple[list[dict], Array]:
    """One linear probe per layer. x_*: [L+1, N, D] -> (metrics per layer, CAVs [L+1, D] unit)."""
    w, b = jax.vmap(lambda xx: linear_probe(xx, y_train))(jnp.asarray(x_train))
    metrics = [probe_metrics(w[i], b[i], x_test[i], y_test) for i in range(w.shape[0])]
    return metrics, core.normalize(w)


def _type_logprob(forward, head, params, ids, attn, pos, tgt, betas, layer, hooks):
    film = {layer: FiLM(beta_out=betas)}
    hk = Hooks(film=film) if hooks is None else hooks.replace(film=film)
    out = forward(params, ids, attn, hk)
    h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]
    lp = jax.nn.log_softmax(head(params, h).astype(jnp.float32), axis=-1)
    return jax.scipy.special.logsumexp(lp[:, tgt], axis=1)  # [B]


@functools.partial(jax.jit, static_argnames=("forward", "head", "layer", "d"))
def _layer_grad(params, ids, attn, pos, tgt, hooks, *, forward, head, layer, d):
    b, t = ids.shape

    def f(betas):
        return jnp.sum(_type_logprob(forward, head, params, ids, attn, pos, tgt, betas, layer, hooks))

    g = jax.grad(f)(jnp.zeros((b, t, d), jnp.float32))
    return jnp.take_along_axis(g, pos[:, None, None], axis=1)[:, 0]


def layer_gradient(
    forward: Callable,
    head: Callable,
    params,
    ids,
    attn,
    pos,
    target_ids: Sequence[int],
    layer: int,
    hooks: Optional[Hooks] = None,
) -> Array:
    """Gradient of each row's type log-probability (logsumexp over ``target_ids`` of the
    log-softmax at its predicting position) w.r.t. the output of backbone layer ``layer``
    (0-based) at that position -> [B, D].

    Taken through a zero FiLM ``beta_out`` on that layer, which adds to exactly the
    representation ``hidden_states[layer + 1]``; rows are independent, so the gradient of the
    sum gives every row's gradient at once. Compiled once per (model, layer, shapes).
    """
    ids, attn, pos = jnp.asarray(ids), jnp.asarray(attn), jnp.asarray(pos)
    d = params_hidden_size(forward, params, ids, attn)
    return _layer_grad(
        params, ids, attn, pos, jnp.asarray(list(target_ids)), hooks, forward=forward, head=head, layer=int(layer), d=d
    )


def params_hidden_size(forward: Callable, params, ids, attn) -> int:
    """Hidden size D of a backbone, from an abstract evaluation (no compute)."""
    out = jax.eval_shape(lambda p, i, m: forward(p, i, m, None), params, ids, attn)
    return int(out.hidden.shape[-1])


def tcav(
    forward: Callable,
    head: Callable,
    params,
    ids,
    attn,
    pos,
    target_ids: Sequence[int],
    cavs: Array,
    layers: Sequence[int],
    hooks: Optional[Hooks] = None,
) -> dict:
    """TCAV score per layer: the share of prompts whose type log-probability increases along the
    layer's concept vector, i.e. ``layer_gradient . CAV > 0``. ``cavs`` [L+1, D] is indexed like
    ``hidden_states`` (``cavs[l + 1]`` belongs to backbone layer l)."""
    scores = {}
    for layer in layers:
        g = layer_gradient(forward, head, params, ids, attn, pos, target_ids, int(layer), hooks)
        scores[int(layer)] = float(jnp.mean((g @ jnp.asarray(cavs)[int(layer) + 1]) > 0))
    return scores


# ----------------------------------------------------------------------------- concepts in generation


def concept_generation_hooks(te: Array, lam: float, attention_mask: np.ndarray) -> Hooks:
    """Concept vector at every prompt token (embed_offset, prompt-shaped [B, T0, D]) and every
    generated token (step_offset) - the paper's generation mode (Table 9 uses lam < 0 with a
    toxic-word concept to detoxify)."""
    return generation_hooks(te, lam, jnp.asarray(attention_mask))
