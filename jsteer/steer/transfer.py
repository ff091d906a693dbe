"""Transfer a steer between two models through their output embeddings.

Model A (source, where the steer W was trained): logits_A = e_A^T (I + eps W) c_A.
Model B (target). Fit a linear map H [D_A, D_B] that carries B's embedding space into A's,
``e_A ~= H e_B`` on anchor tokens both vocabularies share (least squares on the anchor rows:
E_B[anchors] H^T ~= E_A[anchors]). Assuming contexts map the same way (c_A ~= H c_B, the
paper's premise: hidden states live in the embedding space they are dotted with),

    e_A^T W c_A ~= e_B^T (H^T W H) c_B,

so the transferred steer is W_B = H^T W H. For low rank W = P1 P2^T this is
(H^T P1)(H^T P2)^T: both factors are multiplied by H^T and the rank is kept.

Check (tests/test_steer_transfer): if B is an exact rotation of A (e_B = R e_A, c_B = R c_A)
the fit gives H = R^T and W_B = R W R^T, which reproduces A's steered logits exactly.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from jsteer.steer import head

_WORD_START = ("\u0120", "\u2581")  # 'Ġ' (byte-level BPE: GPT-2, LLaMA-3, SmolLM2), '▁' (SentencePiece)


def _canonical(token: str) -> str:
    """A token string with its word-start marker written as a space, so that 'Ġthe' (byte-level
    BPE) and '▁the' (SentencePiece) are the same word-initial piece."""
    return " " + token[1:] if token[:1] in _WORD_START else token


def shared_anchors(
    vocab_a: dict, vocab_b: dict, max_anchors: Optional[int] = None, skip: Sequence[int] = ()
) -> Tuple[np.ndarray, np.ndarray]:
    """Token ids of strings present in both vocabularies (token -> id dicts), word-start markers
    matched across tokenizer kinds ('Ġthe' <-> '▁the'; within a vocabulary the lowest id of a
    string wins).

    Ordered by A's id (frequent BPE merges first in most tokenizers), optionally truncated.
    Returns (ids_a [N], ids_b [N]) int32.
    """
    skip = set(skip)
    by_string_b: dict = {}
    for t, ib in sorted(vocab_b.items(), key=lambda kv: kv[1]):
        by_string_b.setdefault(_canonical(t), ib)
    pairs, seen = [], set()
    for t, ia in sorted(vocab_a.items(), key=lambda kv: kv[1]):
        c = _canonical(t)
        if c in by_string_b and c not in seen and ia not in skip:
            seen.add(c)
            pairs.append((ia, by_string_b[c]))
    if max_anchors is not None:
        pairs = pairs[:max_anchors]
    if not pairs:
        raise ValueError("the two vocabularies share no token: cannot fit a transfer map")
    a, b = zip(*pairs)
    return np.asarray(a, np.int32), np.asarray(b, np.int32)


def fit_map(
    emb_a: np.ndarray, emb_b: np.ndarray, ids_a: np.ndarray, ids_b: np.ndarray, ridge: float = 0.0
) -> np.ndarray:
    """Least-squares H [D_A, D_B] with E_B[ids_b] H^T ~= E_A[ids_a].

    emb_a: [V_A, D_A] source output embedding; emb_b: [V_B, D_B] target output embedding.
    ``ridge`` adds ridge * ||H||^2 (useful when there are fewer anchors than D_B).
    """
    ea = np.asarray(emb_a, np.float64)[np.asarray(ids_a)]
    eb = np.asarray(emb_b, np.float64)[np.asarray(ids_b)]
    if ea.shape[0] != eb.shape[0]:
        raise ValueError(f"anchor lists differ in length: {ea.shape[0]} source vs {eb.shape[0]} target")
    if ea.shape[0] < eb.shape[1] and ridge == 0.0:
        raise ValueError(
            f"{ea.shape[0]} anchors cannot determine a map from hidden size {eb.shape[1]}: "
            "give more anchors or a ridge penalty"
        )
    if ridge > 0.0:
        gram = eb.T @ eb + ridge * np.eye(eb.shape[1])
        ht = np.linalg.solve(gram, eb.T @ ea)  # [D_B, D_A]
    else:
        ht, *_ = np.linalg.lstsq(eb, ea, rcond=None)
    return ht.T.astype(np.float32)


BLACKLIST_NOT_TRANSFERABLE = (
    "a word-blacklist steer lives in vocabulary space (one logit offset per token of its "
    "model) and cannot be transferred by H"
)


def transfer(params: head.Params, h_map: np.ndarray) -> dict:
    """Steer params for model B from params for model A and H [D_A, D_B] (see module doc)."""
    h_map = jnp.asarray(h_map, jnp.float32)
    k = head.kind(params)
    if k == "blacklist":
        raise ValueError(BLACKLIST_NOT_TRANSFERABLE)
    d_a = head.dim(params)
    if h_map.ndim != 2 or h_map.shape[0] != d_a:
        raise ValueError(f"transfer map must be [D_A={d_a}, D_B], got {tuple(h_map.shape)}")
    if k == "lowrank":  # H^T P1 (H^T P2)^T
        return {
            "p1": jnp.einsum("ab,sar->sbr", h_map, params["p1"]),
            "p2": jnp.einsum("ab,sar->sbr", h_map, params["p2"]),
        }
    if k == "full":
        return {"w": jnp.einsum("ab,sac,cd->sbd", h_map, params["w"], h_map)}
    return {"vec": jnp.einsum("ab,sa->sb", h_map, params["vec"])}  # offset: e_A^T v ~= e_B^T H^T v


def anchor_fit_error(
    emb_a: np.ndarray, emb_b: np.ndarray, ids_a: np.ndarray, ids_b: np.ndarray, h_map: np.ndarray
) -> float:
    """Relative residual ||E_B H^T - E_A|| / ||E_A|| on the anchors (0 for an exact map)."""
    ea = np.asarray(emb_a, np.float64)[ids_a]
    eb = np.asarray(emb_b, np.float64)[ids_b]
    return float(np.linalg.norm(eb @ np.asarray(h_map, np.float64).T - ea) / np.linalg.norm(ea))
