"""LAMA probing choices that ``experiments/typevec_lama.py`` and ``jsteer typevec probe`` share.

- :func:`lambda_unit`: the absolute size of one unit of the lambda grid. ``abs``: 1 (lambda
  multiplies the unit TE, as the paper); ``row_norm``: the mean input-embedding row norm
  (:func:`jsteer.typevec.inject.row_norm_unit`; 3.20 for SmolLM2-135M); ``resid``: the mean
  residual-stream norm after decoder layer ``layer`` at the predicting position, measured on hold-out
  prompts only (never on reported ones), for TE added in the residual stream (``mode="layer"``).
- :func:`select_layer`: the decoder layer for ``mode="layer"``, chosen on the hold-out: lambda
  tuned per relation as in the main run, the best macro hold-out P@1 wins.

``groups``: {"<Type>/<relation>": [Prompt]} (:func:`jsteer.typevec.probe.load_typed_dataset`);
``tes``: {group: TE [D]}; ``pm``: a :class:`jsteer.typevec.probe.ProbeModel`.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

LAMBDA_UNITS = ("abs", "row_norm", "resid")
HOLDOUT = 0.05  # the share of each relation's prompts that tunes lambda (and measures ``resid``)


def lambda_unit(
    pm, kind: str, layer: Optional[int], groups: Mapping[str, Sequence], seed: int, holdout: float = HOLDOUT
) -> float:
    """The absolute size of one lambda unit of ``kind`` (see the module docstring); ``resid`` is
    measured on the first 4 hold-out prompts of each relation (the split :func:`probe.evaluate`
    tunes on), right-padded, at each prompt's last token."""
    from jsteer.typevec import probe
    from jsteer.typevec.inject import row_norm_unit

    if kind == "abs":
        return 1.0
    if kind == "row_norm":
        return float(row_norm_unit(pm.embedding()))
    if kind != "resid" or layer is None:
        raise ValueError("--lambda-unit resid needs --mode layer")
    seqs = []
    for name, prompts in groups.items():
        exs, _ = probe.encode_prompts(prompts, pm.tokenizer, pm.kind)
        hold, _ = probe.split_holdout(len(exs), holdout, seed, name)
        seqs += [exs[i].ids for i in hold[:4]]
    t = max(len(q) for q in seqs)
    ids = np.zeros((len(seqs), t), np.int32)
    attn = np.zeros((len(seqs), t), np.int32)
    for b, q in enumerate(seqs):  # right padding: the last real token sees no padding
        ids[b, : len(q)], attn[b, : len(q)] = q, 1
    hs = pm.forward(pm.params, jnp.asarray(ids), jnp.asarray(attn), None, output_hidden_states=True).hidden_states
    last = np.array([len(q) - 1 for q in seqs])
    return float(np.mean(np.linalg.norm(np.asarray(hs[layer + 1])[np.arange(len(seqs)), last], axis=-1)))


def select_layer(
    pm,
    groups: Mapping[str, Sequence],
    tes: Mapping,
    candidates: Sequence[int],
    lams: Sequence[float],
    *,
    seed: int,
    batch_size: int,
    max_holdout: Optional[int] = None,
    holdout: float = HOLDOUT,
    log: Optional[Callable[..., None]] = None,
) -> dict:
    """Choose the decoder layer for ``mode="layer"`` on the hold-out only: per candidate, lambda
    (in ``resid`` units of that layer) is tuned per relation exactly as in the main run, and the
    layer with the best macro hold-out P@1 at the tuned lambdas wins (ties: mean P@10/50/100,
    then the earlier layer). -> {"candidates", "chosen", "per_layer", "rule"}."""
    from jsteer.typevec import probe

    table, best, best_key = {}, None, None
    for layer in candidates:
        unit = lambda_unit(pm, "resid", layer, groups, seed, holdout)
        rep = probe.evaluate(
            pm,
            groups,
            tes,
            mode="layer",
            lam_grid=lams,
            holdout=holdout,
            max_test=0,
            max_holdout=max_holdout,
            seed=seed,
            batch_size=batch_size,
            methods=("B", "TE"),
            layer=layer,
            lam_unit=unit,
        )
        tuned = {g: t["lambda_table"][str(t["lambda"])] for g, t in rep["tuning"].items()}
        m = probe.macro(tuned)
        table[str(layer)] = {
            "holdout_macro": m,
            "lambda_unit_value": unit,
            "lambda": {g: t["lambda"] for g, t in rep["tuning"].items()},
        }
        key = (m["P@1"], (m["P@10"] + m["P@50"] + m["P@100"]) / 3.0)
        if log is not None:
            log(f"layer {layer}: hold-out macro P@1 {m['P@1']:.3f} (lambda unit {unit:.1f})")
        if best_key is None or key > best_key:
            best, best_key = layer, key
    return {
        "candidates": list(candidates),
        "chosen": best,
        "per_layer": table,
        "rule": "best macro hold-out P@1 at per-relation tuned lambda (ties: mean P@10/50/100, then earlier)",
    }
