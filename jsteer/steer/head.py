"""LM-Steer heads: pure functions of a small params pytree.

A steer transforms the final hidden state c [.., D] of a frozen decoder before the output
embedding E [V, D]:

    c' = c + sum_i eps_i W_i c,        logits = c' E^T

which equals c^T (I + sum_i eps_i W_i)^T E^T, i.e. a linear transform of the output word
embeddings, without ever materialising a steered copy of E (so tied embeddings are fine).

Steer params (S steers, D hidden, R rank):

- low rank:  ``{"p1": [S, D, R], "p2": [S, D, R]}``  with W_i = P1_i P2_i^T
- full rank: ``{"w": [S, D, D]}``

``eps`` is [S] (shared by every row) or [B, S] (one value per batch row). It is always a
traced array: changing it never recompiles. The math itself is :func:`jsteer.hooks.steer_delta`,
the same code the backbones run under ``Hooks(steer=...)`` during generation.

Two baselines share the calling convention ``fn(params, hidden, embedding, eps) -> logits``:

- soft word blacklist: a learned logit offset per steer, ``{"offset": [S, V]}``:
  logits = c E^T + sum_i eps_i b_i
- context-vector offset: a learned hidden offset per steer, ``{"vec": [S, D]}``:
  logits = (c + sum_i eps_i v_i) E^T

Both decode like a steer: :func:`to_hooks` / :func:`to_steer` carry them in the backbones'
``Hooks(steer=...)`` (``Steer.bias`` / ``Steer.vec``), so ``generate`` compares them with
LM-Steer under the same sampling.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.hooks import Hooks, Steer, apply_steer_logits, steer_delta

Array = jnp.ndarray
Params = Mapping[str, Array]

KINDS = ("lowrank", "full", "blacklist", "offset")


# ----------------------------------------------------------------------------- init


def init(
    key: Array, dim: int, num_steers: int = 1, rank: Optional[int] = 1000, scale: float = 1e-3, dtype=jnp.float32
) -> dict:
    """Random steer params: low rank when ``rank`` is an int, full rank when ``rank`` is None.

    Entries are N(0, scale^2), like the original (``randn * init_var``). Both factors are
    random, so W_i = P1_i P2_i^T starts tiny but not at zero and both factors get gradients.
    """
    if dim <= 0 or num_steers <= 0:
        raise ValueError(f"steer init needs dim > 0 and num_steers > 0, got dim={dim}, num_steers={num_steers}")
    if rank is None:
        return {"w": scale * jax.random.normal(key, (num_steers, dim, dim), dtype)}
    if rank <= 0:
        raise ValueError(f"steer rank must be a positive int (or None for full rank), got {rank}")
    k1, k2 = jax.random.split(key)
    return {
        "p1": scale * jax.random.normal(k1, (num_steers, dim, rank), dtype),
        "p2": scale * jax.random.normal(k2, (num_steers, dim, rank), dtype),
    }


def init_blacklist(key: Array, vocab_size: int, num_steers: int = 1, scale: float = 1e-3, dtype=jnp.float32) -> dict:
    """Soft word blacklist baseline: a logit offset b_i [V] per steer."""
    return {"offset": scale * jax.random.normal(key, (num_steers, vocab_size), dtype)}


def init_offset(key: Array, dim: int, num_steers: int = 1, scale: float = 1e-3, dtype=jnp.float32) -> dict:
    """Context-vector offset baseline: a hidden offset v_i [D] per steer."""
    return {"vec": scale * jax.random.normal(key, (num_steers, dim), dtype)}


# ----------------------------------------------------------------------------- inspection


def kind(params: Params) -> str:
    """'lowrank' | 'full' | 'blacklist' | 'offset' from the keys of a params tree."""
    keys = set(params)
    if keys == {"p1", "p2"}:
        return "lowrank"
    if keys == {"w"}:
        return "full"
    if keys == {"offset"}:
        return "blacklist"
    if keys == {"vec"}:
        return "offset"
    raise ValueError(f"not a steer params tree: keys {sorted(keys)}; expected {{p1, p2}}, {{w}}, {{offset}} or {{vec}}")


def num_steers(params: Params) -> int:
    return int(next(iter(params.values())).shape[0])


def dim(params: Params) -> int:
    """Hidden size D the steer acts on (raises for the blacklist baseline, which has none)."""
    k = kind(params)
    if k == "blacklist":
        raise ValueError("a word-blacklist steer acts on logits and has no hidden size")
    return int({"lowrank": params.get("p1"), "full": params.get("w"), "offset": params.get("vec")}[k].shape[1])


def validate(params: Params, hidden_dim: Optional[int] = None, vocab_size: Optional[int] = None) -> str:
    """Check shapes; return the kind. Raises ValueError naming the offending tensor."""
    k = kind(params)
    if k == "lowrank":
        p1, p2 = params["p1"], params["p2"]
        if p1.ndim != 3 or p1.shape != p2.shape:
            raise ValueError(f"steer p1 {tuple(p1.shape)} and p2 {tuple(p2.shape)} must both be [S, D, R]")
        d = p1.shape[1]
    elif k == "full":
        w = params["w"]
        if w.ndim != 3 or w.shape[1] != w.shape[2]:
            raise ValueError(f"steer w must be [S, D, D], got {tuple(w.shape)}")
        d = w.shape[1]
    elif k == "offset":
        if params["vec"].ndim != 2:
            raise ValueError(f"steer vec must be [S, D], got {tuple(params['vec'].shape)}")
        d = params["vec"].shape[1]
    else:
        if params["offset"].ndim != 2:
            raise ValueError(f"steer offset must be [S, V], got {tuple(params['offset'].shape)}")
        if vocab_size is not None and params["offset"].shape[1] != vocab_size:
            raise ValueError(f"steer offset covers {params['offset'].shape[1]} tokens, the model has {vocab_size}")
        return k
    if hidden_dim is not None and d != hidden_dim:
        raise ValueError(f"steer acts on hidden size {d}, but the model's hidden size is {hidden_dim}")
    return k


def check_eps(eps: Array, n_steers: int, batch: Optional[int] = None) -> Array:
    """eps as an array [S] or [B, S]; shape errors are raised here, before tracing deeper."""
    eps = jnp.asarray(eps)
    ok = (eps.ndim == 1 and eps.shape[0] == n_steers) or (
        eps.ndim == 2 and eps.shape[1] == n_steers and (batch is None or eps.shape[0] == batch)
    )
    if not ok:
        want = f"[{n_steers}]" + (f" or [{batch}, {n_steers}]" if batch is not None else f" or [B, {n_steers}]")
        raise ValueError(f"steer eps has shape {tuple(eps.shape)}, expected {want} (one value per steer)")
    return eps


def full_matrix(params: Params) -> Array:
    """W [S, D, D] (P1 P2^T for low rank)."""
    k = kind(params)
    if k == "full":
        return params["w"]
    if k == "lowrank":
        return jnp.einsum("sdr,ser->sde", params["p1"], params["p2"])
    raise ValueError(f"the {k} baseline has no steer matrix W")


# ----------------------------------------------------------------------------- apply


def to_steer(params: Params, eps: Array) -> Steer:
    """The hook value the backbones understand: ``Hooks(steer=to_steer(params, eps))``. eps is
    cast to a (non-weak) float32 array, so that a Python-scalar product, a weak-typed or a bf16
    eps reuses the compiled decode loop instead of tracing a new one."""
    k = kind(params)
    eps = jnp.asarray(eps, jnp.float32)
    if k == "lowrank":
        return Steer(eps=eps, p1=params["p1"], p2=params["p2"])
    if k == "full":
        return Steer(eps=eps, w=params["w"])
    if k == "offset":
        return Steer(eps=eps, vec=params["vec"])
    return Steer(eps=eps, bias=params["offset"])  # blacklist: a logit offset


def to_hooks(params: Params, eps: Array, cheapest: bool = True) -> Hooks:
    """Hooks for decoding. With ``cheapest`` (default) the steer is first put in its cheapest
    exact form (:func:`for_inference`: rank R >= D / 2 is expanded to W = P1 P2^T once, here,
    not per token), so generation pays D^2 instead of 2 D R per token and steer."""
    return Hooks(steer=to_steer(for_inference(params) if cheapest else params, eps))


def for_inference(params: Params) -> dict:
    """The cheapest exact form for decoding: a low-rank steer costs 2 D R multiply-adds per
    token and steer, a full one D^2, so rank R >= D / 2 (e.g. the paper's R = 1000 on a
    D = 576 model) is expanded to W = P1 P2^T once. Same math, different rounding."""
    if kind(params) == "lowrank" and 2 * params["p1"].shape[-1] >= params["p1"].shape[1]:
        return {"w": full_matrix({k: jnp.asarray(v) for k, v in params.items()})}
    return dict(params)


def steer_hidden(params: Params, hidden: Array, eps: Array) -> Array:
    """hidden [..., D] (leading B when eps is [B, S]) -> c + sum_i eps_i W_i c (or + sum eps_i v_i)."""
    k = validate(params, hidden_dim=hidden.shape[-1])
    eps = check_eps(eps, num_steers(params), hidden.shape[0] if hidden.ndim >= 2 else None)
    if k == "blacklist":
        return hidden
    return hidden + steer_delta(hidden, to_steer(params, eps))


def apply(params: Params, hidden: Array, embedding: Array, eps: Array) -> Array:
    """Steered logits.

    params: a steer (or baseline) tree; hidden: [B, T, D] or [B, D] or [D]; embedding: the
    output embedding [V, D]; eps: [S] or [B, S]. Returns [..., V].
    """
    if embedding.ndim != 2 or embedding.shape[1] != hidden.shape[-1]:
        raise ValueError(f"embedding must be [V, {hidden.shape[-1]}], got {tuple(embedding.shape)}")
    k = validate(params, hidden_dim=None, vocab_size=embedding.shape[0])
    # at least float32, as the backbones' logits: log-prob differences (highlighting) of bf16
    # logits are multiples of 1/64 and can flip sign
    dtype = jnp.promote_types(jnp.result_type(hidden, embedding), jnp.float32)
    hidden, embedding = jnp.asarray(hidden, dtype), jnp.asarray(embedding, dtype)
    h = steer_hidden(params, hidden, eps)
    logits = jnp.einsum("...d,vd->...v", h, embedding.astype(h.dtype))
    if k == "blacklist":
        logits = apply_steer_logits(logits, Hooks(steer=to_steer(params, eps)))
    return logits


def logit_bias(params: Params, embedding: Array, eps: Array) -> Array:
    """Baselines as a logit offset: blacklist -> sum eps_i b_i; offset -> (sum eps_i v_i) E^T.
    eps [S] -> [V]; eps [B, S] -> [B, V]."""
    k = kind(params)
    eps = jnp.asarray(eps)
    if k == "blacklist":
        return jnp.einsum("...s,sv->...v", eps, params["offset"])
    if k == "offset":
        return jnp.einsum("...s,sd,vd->...v", eps, params["vec"], embedding)
    raise ValueError("logit_bias is only defined for the blacklist and offset baselines")


def l2(params: Params) -> Array:
    """Sum of squares of every steer tensor (the original's regularization term)."""
    return sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------- eps helpers


def make_eps(values: Union[float, Sequence[float], np.ndarray], eps0: float = 1e-3, dummy: bool = True) -> Array:
    """Steer values (in units of eps0, the original's ``--steer_values``) -> eps for the hook.

    values: scalar, [S_user] or [B, S_user]. With ``dummy`` a value 1 is appended for the
    domain-shift steer trained at +1 (the original decodes with ``--steer_values 5 1``).
    Returns float32 [S] or [B, S] with S = S_user + dummy.
    """
    v = jnp.asarray(values, jnp.float32)  # jnp throughout: callable under jit with traced values
    if v.ndim == 0:
        v = v[None]
    if v.ndim > 2:
        raise ValueError(f"steer values must be a scalar, [S] or [B, S], got shape {v.shape}")
    if dummy:
        v = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), jnp.float32)], axis=-1)
    return v * eps0


def stack(params_list: Sequence[Params]) -> dict:
    """Several steers in one head (composition): concatenate along S. Low-rank steers of
    equal rank stay low rank; otherwise every steer is expanded to full W. Baselines stack
    with baselines of their own kind; to mix kinds, compose their hooks
    (``jsteer.hooks.compose(Hooks(steer=to_steer(a, eps_a)), Hooks(steer=to_steer(b, eps_b)))``)."""
    if not params_list:
        raise ValueError("stack needs at least one steer")
    kinds = {kind(p) for p in params_list}
    if kinds == {"blacklist"}:
        sizes = {p["offset"].shape[1] for p in params_list}
        if len(sizes) != 1:
            raise ValueError(f"cannot stack word blacklists over different vocabularies {sorted(sizes)}")
        return {"offset": jnp.concatenate([jnp.asarray(p["offset"]) for p in params_list])}
    dims = {dim(p) for p in params_list if kind(p) != "blacklist"}
    if len(dims) != 1:
        raise ValueError(f"cannot stack steers of different hidden sizes {sorted(dims)}")
    if kinds == {"offset"}:
        return {"vec": jnp.concatenate([jnp.asarray(p["vec"]) for p in params_list])}
    if kinds == {"lowrank"} and len({p["p1"].shape[-1] for p in params_list}) == 1:
        return {
            "p1": jnp.concatenate([jnp.asarray(p["p1"]) for p in params_list]),
            "p2": jnp.concatenate([jnp.asarray(p["p2"]) for p in params_list]),
        }
    if kinds <= {"lowrank", "full"}:
        return {"w": jnp.concatenate([full_matrix({k: jnp.asarray(v) for k, v in p.items()}) for p in params_list])}
    raise ValueError(
        f"stack takes steers of one family (bilinear, blacklist or offset), got kinds {sorted(kinds)}: "
        "compose mixed kinds as hooks with jsteer.hooks.compose"
    )
