"""Directions from residual-stream activations: ActAdd, CAA and repeng-style PCA.

Every method reads ``resid_post.<layer>`` (captured by the decoder's sites, see
:mod:`jsteer.interventions`) for N prompt pairs (positive[i], negative[i]) and reduces each
prompt to one vector a [D] per layer:

- ``"last"``: the activation at the prompt's last token;
- ``"mean"``: the mean over the prompt's real tokens, less a leading start (bos) token the
  tokenizer adds: that token sees only itself, so its activation is the same for every prompt
  and says nothing about it, yet its large norm (attention sinks) would dominate a difference of
  means over prompts of different lengths.

Methods (``a+_i``, ``a-_i`` [D]: the reduced activations of pair i at one layer):

- ``"actadd"`` (Turner et al., "Activation Addition"): one pair; direction = a+ - a-, reduced by
  ``"mean"``. The paper adds the per-token difference h+[t] - h-[t] to the first tokens of the
  prompt only, at one layer; a control vector is one [D] vector per layer added at every
  position, so the per-token differences are collapsed to their token means here.
- ``"caa"`` (Rimsky et al., "Contrastive Activation Addition"): direction = mean_i (a+_i - a-_i),
  reduced by ``"last"`` (the paper reads the answer-letter token, the last token of each prompt).
- ``"pca"`` (repeng's ``pca_diff``): d_i = a+_i - a-_i, centred (d_i - mean_i d_i, as
  ``sklearn.decomposition.PCA`` does); direction = the unit first principal component (first
  right singular vector) of the centred d, reduced by ``"last"`` (repeng reads the last token).
  Sign, as repeng: project every a+_i and a-_i on the direction; if more pairs have the
  positive below the negative than above, flip it (a tie keeps the SVD's sign).

``reduce=`` overrides a method's reduction. Directions are computed in float64 and stored
float32; CAA / ActAdd keep the activation scale (strength 1 adds the mean difference), PCA's
are unit vectors (strength in units of activation norm).
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, Iterable, Optional, Sequence, Union

import numpy as np

from jsteer import progress

METHODS = ("caa", "pca", "actadd")
REDUCE = {"caa": "last", "pca": "last", "actadd": "mean"}


def check_layers(layers: Union[int, Iterable[int]], num_layers: int) -> tuple:
    """An int or ints -> a sorted tuple of distinct 0-based layers, each in range(num_layers)."""
    layers = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
    if not layers:
        raise ValueError("layers: none given (e.g. layers=[10, 12])")
    seen = set()
    for k in layers:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise ValueError(f"layers: {k!r} is not an int layer index")
        if not 0 <= k < num_layers:
            raise ValueError(
                f"layers: layer {k} is out of range (the model has {num_layers} layers: 0..{num_layers - 1})"
            )
        if k in seen:
            raise ValueError(f"layers: layer {k} is given twice")
        seen.add(int(k))
    return tuple(sorted(seen))


def check_pairs(positive, negative, method: str) -> tuple:
    """-> (positive list, negative list), checked: non-empty, equal length, no empty text."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: methods are {', '.join(METHODS)}")
    positive = [positive] if isinstance(positive, str) else list(positive)
    negative = [negative] if isinstance(negative, str) else list(negative)
    for name, texts in (("positive", positive), ("negative", negative)):
        if not texts:
            raise ValueError(f"{name}: no texts (one prompt per pair is needed)")
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t.strip():
                raise ValueError(
                    f"{name}[{i}] is {'empty' if isinstance(t, str) else type(t).__name__}: every prompt needs text"
                )
    if len(positive) != len(negative):
        raise ValueError(
            f"{len(positive)} positive but {len(negative)} negative texts: {method} takes pairs "
            f"(positive[i], negative[i]), so the lists must be equally long"
        )
    if method == "actadd" and len(positive) != 1:
        raise ValueError(f"actadd takes one prompt pair, got {len(positive)} (method='caa' averages several)")
    if method == "pca" and len(positive) < 2:
        raise ValueError(
            "pca needs at least 2 pairs (the principal component of one centred difference is "
            "undefined); use method='caa' or 'actadd' for one pair"
        )
    return positive, negative


def activations(
    lm, texts: Sequence[str], layers: Sequence[int], reduce: str, batch_size: int = 16
) -> Dict[int, np.ndarray]:
    """{layer: [N, D] float64}: each text's ``resid_post.<layer>`` reduced by ``reduce`` ("last" |
    "mean", module docstring). Batches of ``batch_size`` rows (the last one repeated to fill),
    left-padded to a length bucket, so that a few compiled forwards serve every text."""
    if reduce not in ("last", "mean"):
        raise ValueError(f"reduce must be 'last' or 'mean', got {reduce!r}")
    sites = tuple(f"resid_post.{k}" for k in layers)
    bos = lm.tokenizer.bos_id
    out = {k: [] for k in layers}
    with progress.bar(desc="actsteer: activations", total=len(texts), unit="text", leave=False) as b:
        for s in range(0, len(texts), batch_size):
            chunk = list(texts[s : s + batch_size])
            n = len(chunk)
            ids, mask = lm.encode_batch(chunk + [chunk[-1]] * (batch_size - n), left_pad=True, bucket=True)
            cap = lm.forward(ids, mask, capture=sites).captured
            ids, mask = ids[:n], mask[:n].astype(np.float64)
            if reduce == "mean":
                first = mask.argmax(axis=1)  # left-padded: the first real token
                starts = (ids[np.arange(n), first] == bos) if bos is not None else np.zeros(n, bool)
                mask[np.arange(n)[starts], first[starts]] = 0.0
                empty = np.flatnonzero(mask.sum(1) == 0)
                if len(empty):
                    raise ValueError(f"text {chunk[empty[0]]!r} has no tokens besides the start token")
            for k, site in zip(layers, sites):
                h = np.asarray(cap[site][:n], np.float64)
                out[k].append(h[:, -1] if reduce == "last" else (h * mask[..., None]).sum(1) / mask.sum(1)[:, None])
            b.update(n)
    return {k: np.concatenate(v) for k, v in out.items()}


def direction(method: str, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """pos, neg [N, D] (pair i = row i) -> the method's direction [D] float64 (module docstring)."""
    diff = pos - neg
    if method in ("caa", "actadd"):
        return diff.mean(0)
    centred = diff - diff.mean(0, keepdims=True)
    _, sv, vt = np.linalg.svd(centred, full_matrices=False)
    if sv[0] <= 1e-12 * max(1.0, np.abs(diff).max()):
        raise ValueError(
            "pca: every pair has the same difference, so the centred differences have no principal "
            "component; use method='caa'"
        )
    v = vt[0]
    above, below = np.sum(pos @ v > neg @ v), np.sum(pos @ v < neg @ v)
    return -v if below > above else v


def recipe(method: str, reduce: str, positive: Sequence[str], negative: Sequence[str], layers) -> dict:
    """What the directions depend on (stored with the vector)."""
    h = hashlib.sha256(json.dumps([list(positive), list(negative)]).encode()).hexdigest()
    out = {
        "method": method,
        "reduce": reduce,
        "pairs": len(positive),
        "layers": list(layers),
        "texts_sha256": h,
        "site": "resid_post",
    }
    if method == "pca":
        out["pca"] = "first principal component of the centred pair differences; sign: positives project higher"
    if len(positive) == 1:
        out["positive"], out["negative"] = positive[0], negative[0]
    return out


def train(lm, positive, negative, layers, method: str = "caa", *, reduce: Optional[str] = None, batch_size: int = 16):
    """Directions for ``lm`` at ``layers`` (an int or ints, 0-based ``resid_post`` layers) from
    prompt pairs (positive[i], negative[i]) -> :class:`jsteer.actsteer.ControlVector`.
    ``method``: "caa" | "pca" | "actadd"; ``reduce``: "last" | "mean" (default: the method's own,
    module docstring)."""
    from jsteer.actsteer.vector import ControlVector

    if not lm.is_decoder:
        raise ValueError(f"activation steering needs a decoder; this model is {lm.family!r}")
    positive, negative = check_pairs(positive, negative, method)
    layers = check_layers(layers, lm.config.num_layers)
    reduce = reduce or REDUCE[method]
    acts = activations(lm, positive + negative, layers, reduce, batch_size)
    n = len(positive)
    dirs = {k: direction(method, a[:n], a[n:]).astype(np.float32) for k, a in acts.items()}
    return ControlVector(
        dirs,
        lm.identity,
        lm.config.hidden_size,
        method,
        lm.config.model_type,
        recipe(method, reduce, positive, negative, layers),
    )
