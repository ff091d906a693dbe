"""The LM-Steer issue's targets and the rules every results table reads them by.

Positivity (the share of positive continuations, 0..1) must reach :data:`POSITIVE_TARGET` under
positive steering and stay at most :data:`NEGATIVE_TARGET` under negative steering; detox must
halve the toxicity probability (steered / unsteered <= :data:`HALVE_TARGET`); the perplexity rise
stays within 30%. :func:`chosen` gives the steer values a run reports (its held-out choice),
:func:`targets` a main run's targets measured, :func:`fmt` the one number format of the tables.
"""

from __future__ import annotations


def fmt(x, pct=False):
    """A table cell: "-" for None, else two decimals (``pct``: x100, one decimal)."""
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def chosen(res: dict) -> dict:
    """Steer values used for the reported rows: chosen on held-out prompts (strength_selection),
    or +/-5 for results written before that selection existed."""
    sel = res.get("strength_selection")
    return (
        sel["chosen"]
        if sel
        else {
            "dummy": res.get("setup", {}).get("generation", {}).get("dummy_used"),
            "positive": 5.0,
            "negative": 5.0,
            "detox": 5.0,
        }
    )


POSITIVE_TARGET, NEGATIVE_TARGET = 0.8, 0.2  # issue 4: positivity >= 0.80 (+ steering), <= 0.20 (- steering)


def positivity_met(direction: str, positivity: float) -> bool:
    """Whether ``positivity`` meets the target of steering in ``direction`` ("positive" / "negative")."""
    return positivity >= POSITIVE_TARGET if direction == "positive" else positivity <= NEGATIVE_TARGET


HALVE_TARGET = 0.5  # issue 4: detox halves the toxicity probability (steered / unsteered)


def halved(ratio) -> bool:
    """Whether a steered / unsteered toxicity-probability ratio meets the halving target."""
    return ratio is not None and ratio <= HALVE_TARGET


def targets(res: dict) -> dict:
    """The issue's targets, measured."""
    m = res["metrics"]
    c = chosen(res)
    kp, kn, kd = f"neutral_s{c['positive']:+g}", f"neutral_s{-c['negative']:+g}", f"toxic_d{c['detox']:+g}"
    out = {}
    if {kp, kn, "neutral_base"} <= set(m):
        b = m["neutral_base"]["ppl_mean"]
        out[f"positive steering ({kp}) positivity >= 80%"] = (
            m[kp]["positivity"],
            positivity_met("positive", m[kp]["positivity"]),
        )
        out[f"negative steering ({kn}) positivity <= 20%"] = (
            m[kn]["positivity"],
            positivity_met("negative", m[kn]["positivity"]),
        )
        for k in (kp, kn):
            rise = m[k]["ppl_mean"] / b - 1
            out[f"{k} perplexity rise <= 30%"] = (rise, rise <= 0.3)
    if {"toxic_base", kd} <= set(m):
        r = m[kd]["toxicity_prob"] / max(m["toxic_base"]["toxicity_prob"], 1e-9)
        out[f"detox ({kd}) halves toxicity probability"] = (r, halved(r))
    return out
