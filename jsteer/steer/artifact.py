"""Steer artifacts: one portable ``.safetensors`` file each (via :func:`jsteer.checkpoints.save_artifact`,
:mod:`jsteer.artifacts`; older Orbax folders still load) that records which base model the steer
belongs to.

meta keys: ``format`` ("jsteer.steer/1"), ``kind`` (lowrank | full | blacklist | offset),
``base_model`` (``LM.identity`` of the model it acts on), ``hidden_size``, ``vocab_size``,
``eps0``, ``dummy`` (bool: the last steer is the domain-shift steer, decoded at +1),
``steer_names`` (one per user steer), ``transferred_from`` (source identity, when the steer
was carried over with :mod:`jsteer.steer.transfer`), and free-form ``train`` info.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from jsteer.steer import head

FORMAT = "jsteer.steer/1"


class WrongModelError(ValueError):
    """A steer artifact was loaded onto a model it was not trained (or transferred) for."""


def save(
    path: str,
    params: head.Params,
    *,
    base_model: str,
    hidden_size: int,
    vocab_size: int,
    eps0: float = 1e-3,
    dummy: bool = True,
    steer_names: Optional[Sequence[str]] = None,
    transferred_from: Optional[str] = None,
    extra: Optional[dict] = None,
) -> None:
    from jsteer import checkpoints

    k = head.validate(
        params, hidden_dim=None if head.kind(params) == "blacklist" else hidden_size, vocab_size=vocab_size
    )
    n_user = head.num_steers(params) - int(dummy)
    names = list(steer_names) if steer_names is not None else [f"steer{i}" for i in range(n_user)]
    if len(names) != n_user:
        raise ValueError(f"{len(names)} steer names for {n_user} user steers")
    meta = {
        "format": FORMAT,
        "kind": k,
        "base_model": str(base_model),
        "hidden_size": int(hidden_size),
        "vocab_size": int(vocab_size),
        "eps0": float(eps0),
        "dummy": bool(dummy),
        "steer_names": names,
        "transferred_from": transferred_from,
        "train": extra or {},
    }
    tree = {k2: np.asarray(v, np.float32) for k2, v in params.items()}
    checkpoints.save_artifact(path, tree, meta)


def save_trained(path, params: head.Params, lm, emb, cfg, steer_names: Sequence[str], extra: Optional[dict] = None):
    """:func:`save` for a steer trained on ``lm`` with ``cfg`` (a
    :class:`jsteer.steer.train.TrainConfig`: its eps0 and dummy), ``emb`` [V, D] the output
    embeddings it was trained against."""
    save(
        str(path),
        params,
        base_model=lm.identity,
        hidden_size=emb.shape[1],
        vocab_size=emb.shape[0],
        eps0=cfg.eps0,
        dummy=cfg.dummy,
        steer_names=steer_names,
        extra=extra,
    )


def load(path: str, model_identity: Optional[str] = None) -> Tuple[dict, dict]:
    """(params, meta). With ``model_identity`` (``LM.identity``) the artifact must belong to
    that model: a steer trained for another model is refused (transfer it first)."""
    from jsteer import checkpoints

    tree, meta = checkpoints.load_artifact(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a jsteer steer artifact (format {meta.get('format')!r}, expected {FORMAT!r})")
    params = {k: np.asarray(v) for k, v in tree.items()}
    head.validate(params)
    if model_identity is not None:
        check_model(meta, model_identity, path)
    return params, meta


def check_model(meta: dict, model_identity: str, path: str = "steer artifact") -> None:
    if meta["base_model"] != model_identity:
        how = (
            f" (it was transferred from {meta['transferred_from']} to {meta['base_model']})"
            if meta.get("transferred_from")
            else ""
        )
        raise WrongModelError(
            f"{path}: this steer belongs to base model {meta['base_model']}{how}, but the loaded model is "
            f"{model_identity}; steers are not portable as-is: run `jsteer steer transfer` to map it "
            "onto this model first"
        )
