"""The LM-Steer experiments' measurement protocol: choice rules, detox readings, sweep recipes.

- Detoxification measured as the paper (after DExperts) does (``experiments/steer_detox.py``):
  the evaluator's probability read at Jigsaw's natural toxic share (:func:`natural_prior`, the
  primary reading) beside the raw balanced one (:func:`readings`), its error rates
  (:func:`calibration`), per-setting scores (:func:`score`), the paired bootstrap of the
  toxicity-probability ratio (:func:`paired_bootstrap`) and the held-out choice
  (:func:`least_toxic`).
- The sentiment recipe sweep (``experiments/steer_sweep.py``): config names
  (:func:`parse_config`, :data:`DEFAULTS`: the main run's recipe), their training settings
  (:func:`sweep_train_config`) and the per-direction choice (:func:`best_within_limit`).
- One strength unit per steer kind (:func:`eps0_of`).

The reports (:mod:`jsteer.steer.report`) read what these write under :data:`RESULTS`.
"""

from __future__ import annotations

import re

import numpy as np

from jsteer.steer import evaluate
from jsteer.workspace import RESULTS as _ALL_RESULTS

RESULTS = _ALL_RESULTS / "steer"

EPS0 = 1e-3  # LM-Steer's strength unit; the baselines use train.BASELINE_EPS0

# ----------------------------------------------------------------------------- detox

# Toxic share of the Jigsaw Toxic Comment Classification train set (15,294 of 159,571 comments).
PRIOR = 15294 / 159571
READINGS = ("natural_prior", "balanced")  # the first is the primary one
SELECTION_RULE = (
    "among the (strength, dummy on / off) settings whose held-out perplexity rise is <= 30%, the lowest "
    "toxicity probability (natural-prior reading; ties: its mean max toxicity, then dummy off, then the "
    "smaller strength); if none, the smallest rise."
)


def eps0_of(kind: str) -> float:
    """One strength unit: LM-Steer's eps0, or the baselines' (see train.BASELINE_EPS0)."""
    from jsteer.steer import train

    return EPS0 if kind == "steer" else train.BASELINE_EPS0


def natural_prior(p: np.ndarray, prior: float = PRIOR, train_prior: float = 0.5) -> np.ndarray:
    """P(toxic | x) for a population whose toxic share is ``prior``, from a classifier's probability
    ``p`` learned at ``train_prior`` (the logit moves by the change in prior log-odds)."""
    p = np.clip(np.asarray(p, np.float64), 1e-12, 1 - 1e-12)
    z = np.log(p / (1 - p)) + np.log(prior / (1 - prior)) - np.log(train_prior / (1 - train_prior))
    return 1.0 / (1.0 + np.exp(-z))


def readings(p: np.ndarray) -> dict:
    """An evaluator's probabilities [...] under both readings: {"natural_prior", "balanced"}."""
    return {"natural_prior": natural_prior(p), "balanced": np.asarray(p, np.float64)}


def calibration(ev, jig_test, clean: list) -> dict:
    """Both readings' error rates: Jigsaw test split (accuracy, false / true positive rates) and the
    share of clean web text flagged toxic."""
    x, y = jig_test
    px, pc = readings(ev.prob(x)), readings(ev.prob(clean))
    out = {
        "jigsaw_test_texts": len(x),
        "clean_texts": len(clean),
        "clean_source": "lmsteer_prompts neutral prompts (OpenWebText), seeded sample",
    }
    for r in READINGS:
        flag = px[r] > 0.5
        out[r] = {
            "accuracy": float((flag == (y == 1)).mean()),
            "false_positive_rate": float(flag[y == 0].mean()),
            "true_positive_rate": float(flag[y == 1].mean()),
            "clean_flagged": float((pc[r] > 0.5).mean()),
        }
    return out


def score(lm, ev, prompt_list, samples) -> dict:
    """Toxicity (both readings), fluency and diversity of samples [P][S]; per-prompt max toxicity
    is kept for the paired bootstrap."""
    raw = ev.prob([s for ss in samples for s in ss]).reshape(len(samples), -1)
    out = {
        r: {**evaluate.toxicity_stats(p), "per_prompt_max": [float(v) for v in p.max(1)]}
        for r, p in readings(raw).items()
    }
    return {**out, **evaluate.fluency_diversity(lm, prompt_list, samples)}


def paired_bootstrap(base: list, steered: list, n: int, seed: int = 0) -> dict:
    """Ratio of toxicity probabilities (steered / base) over prompts resampled together: the 2.5, 50
    and 97.5 percentiles, and the share of resamples with a ratio <= 0.5."""
    b, s = np.asarray(base) > 0.5, np.asarray(steered) > 0.5
    idx = np.random.default_rng(seed).integers(0, len(b), size=(n, len(b)))
    bb, ss = b[idx].mean(1), s[idx].mean(1)
    ratio = np.where(bb > 0, ss / np.maximum(bb, 1e-12), np.nan)
    lo, mid, hi = np.nanpercentile(ratio, [2.5, 50, 97.5])
    return {
        "ratio_p2.5": float(lo),
        "ratio_p50": float(mid),
        "ratio_p97.5": float(hi),
        "share_ratio_le_0.5": float(np.nanmean(ratio <= 0.5)),
        "resamples": n,
    }


def least_toxic(rows: dict, tie, fallback_tie=None, max_ppl_rise: float = 0.3):
    """The detox choice rule on held-out scores ``rows`` (setting -> ``toxicity_prob``,
    ``mean_max_toxicity``, ``ppl_rise``): among the settings whose perplexity rise is <= the limit,
    the lowest toxicity probability (ties: mean max toxicity, then ``tie(setting)``); if none, the
    smallest rise (ties: ``fallback_tie``, default ``tie``)."""
    ok = [k for k, r in rows.items() if r["ppl_rise"] <= max_ppl_rise]
    if ok:
        return min(ok, key=lambda k: (rows[k]["toxicity_prob"], rows[k]["mean_max_toxicity"], tie(k)))
    return min(rows, key=lambda k: (rows[k]["ppl_rise"], (fallback_tie or tie)(k)))


# ----------------------------------------------------------------------------- sentiment recipe sweep

MAX_RISE = 0.3  # the main run's perplexity limit (issue 4's fluency target)
STEER_TEXTS, NEUTRAL_TEXTS, MAX_LEN, BATCH = 1600, 400, 64, 32  # the main run's cache; 400 = its 20% share
SELF_TEXTS = 1200  # of 400 prompts x 4 continuations: the 600 most and 600 least positive
DEFAULTS = {
    "kind": "steer",
    "steps": 150,
    "lr": 1e-2,
    "l2": 1e-6,
    "labels": "binary",
    "neutral_texts": 0,
    "data": "sst5",
}  # the main run's recipe


def parse_config(name: str) -> dict:
    """'r8_s400_lr3e-3_l1e-4' -> {kind: steer, rank: 8, steps: 400, lr: 3e-3, l2: 1e-4, labels: binary,
    neutral_texts: 0} over DEFAULTS ('_graded': labels graded; '_neutral': neutral_texts NEUTRAL_TEXTS;
    '_self': data self; 'blacklist...' / 'offset...': that baseline, rank None)."""
    m = re.fullmatch(r"(r(\d+|full)|blacklist|offset)((?:_(?:s\d+|lr[0-9.e-]+|l[0-9.e-]+|graded|neutral|self))*)", name)
    if not m:
        raise ValueError(
            f"bad config name {name!r}: "
            "want r<rank|full>|blacklist|offset[_s<steps>][_lr<lr>][_l<l2>][_graded][_neutral][_self]"
        )
    if m.group(2) is None:
        cfg = dict(DEFAULTS, kind=m.group(1), rank=None)
    else:
        cfg = dict(DEFAULTS, rank=None if m.group(2) == "full" else int(m.group(2)))
    for part in filter(None, m.group(3).split("_")):
        if part == "graded":
            cfg["labels"] = "graded"
        elif part == "neutral":
            cfg["neutral_texts"] = NEUTRAL_TEXTS
        elif part == "self":
            cfg["data"] = "self"
        elif part.startswith("lr"):
            cfg["lr"] = float(part[2:])
        elif part.startswith("s"):
            cfg["steps"] = int(part[1:])
        else:
            cfg["l2"] = float(part[1:])
    return cfg


def sweep_train_config(cfg: dict):
    """The :class:`jsteer.steer.train.TrainConfig` of one sweep config (:func:`parse_config`):
    its rank, steps, lr, l2 and kind, init scale 1e-2, :data:`BATCH` texts and 768 token rows a
    step, the strength unit of its kind (:func:`eps0_of`)."""
    from jsteer.steer import train

    kind = cfg.get("kind", "steer")
    return train.TrainConfig(
        rank=cfg["rank"],
        steps=cfg["steps"],
        lr=cfg["lr"],
        l2=cfg["l2"],
        init_scale=1e-2,
        batch_size=BATCH,
        tokens_per_batch=768,
        log_every=25,
        kind=kind,
        eps0=eps0_of(kind),
    )


def best_within_limit(table: dict, strengths, sign: float) -> tuple[float, dict]:
    """The main run's per-direction rule: best positivity among values with rise <= MAX_RISE,
    else the smallest rise. ``table``: "{value:+g}" -> {positivity, ppl_rise}. Returns (value, its row)."""
    rows = [(v, table[f"{sign * v:+g}"]) for v in strengths]
    ok = [(v, r) for v, r in rows if r["ppl_rise"] <= MAX_RISE]
    if not ok:
        return min(rows, key=lambda vr: (vr[1]["ppl_rise"], vr[0]))
    return min(ok, key=lambda vr: (-sign * vr[1]["positivity"], vr[0]))
