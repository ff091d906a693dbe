"""Interpretation: the leading directions of a steer and the words they promote / demote.

With W = U S V^T (SVD, column convention c' = c + eps W c), the logit change of token v is
eps * sum_k s_k (e_v . u_k)(v_k . c): direction k reads the context along v_k and writes
along u_k, so the tokens it moves most are the extremes of E u_k. Singular vectors have an
arbitrary sign; given a typical context c_bar (mean final hidden state) each direction is
oriented so that (v_k . c_bar) > 0, i.e. "top" tokens are the ones a *positive* eps promotes.
(In the original's row convention, delta = c P1 P2^T, the output side is its P2; here the
output side is our P1.)
"""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np

from jsteer.steer import head


def directions(params: head.Params, steer: int = 0, k: Optional[int] = None, mean_hidden: Optional[np.ndarray] = None):
    """(s [k], u [k, D] output directions, v [k, D] input directions) of steer ``steer``."""
    w = np.asarray(head.full_matrix(params), np.float64)
    if not 0 <= steer < w.shape[0]:
        raise ValueError(f"steer index {steer} out of range: the artifact holds {w.shape[0]} steers")
    u, s, vt = np.linalg.svd(w[steer])
    k = len(s) if k is None else min(k, len(s))
    u, s, vt = u[:, :k].T, s[:k], vt[:k]
    if mean_hidden is not None:
        sign = np.sign(vt @ np.asarray(mean_hidden, np.float64))
        sign[sign == 0] = 1.0
        u, vt = u * sign[:, None], vt * sign[:, None]
    return s, u, vt


def explain(
    params: head.Params,
    embedding: np.ndarray,
    steer: int = 0,
    n_dirs: int = 5,
    top: int = 10,
    decode: Optional[Callable[[int], str]] = None,
    mean_hidden: Optional[np.ndarray] = None,
) -> List[dict]:
    """Top / bottom tokens of the leading ``n_dirs`` directions.

    embedding: output embedding [V, D]; decode: id -> string (e.g. tokenizer.id_to_token).
    Returns one dict per direction: {"index", "singular_value", "top": [(token, score)],
    "bottom": [(token, score)]} where score = e_v . u_k.
    """
    emb = np.asarray(embedding, np.float32)
    s, u, _ = directions(params, steer, n_dirs, mean_hidden)
    out = []
    for i in range(len(s)):
        score = emb @ u[i].astype(np.float32)
        order = np.argsort(-score)
        name = decode or (lambda t: str(t))
        out.append(
            {
                "index": i,
                "singular_value": float(s[i]),
                "top": [(name(int(t)), float(score[t])) for t in order[:top]],
                "bottom": [(name(int(t)), float(score[t])) for t in order[::-1][:top]],
            }
        )
    return out


def promoted_tokens(
    params: head.Params, embedding: np.ndarray, mean_hidden: np.ndarray, eps: np.ndarray, top: int = 20
) -> np.ndarray:
    """Token ids whose logit a steer with ``eps`` [S] raises most at the context ``mean_hidden``."""
    w = np.asarray(head.full_matrix(params), np.float64)
    delta = np.einsum("s,sde,e->d", np.asarray(eps, np.float64), w, np.asarray(mean_hidden, np.float64))
    return np.argsort(-(np.asarray(embedding, np.float64) @ delta))[:top]
