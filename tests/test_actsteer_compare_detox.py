"""jsteer.actsteer.compare_detox on synthetic runs shaped like steer_detox.py's JSON: the rows,
intervals and method differences re-derived with NumPy."""

import numpy as np
import pytest

from jsteer.actsteer import compare
from jsteer.actsteer import compare_detox as cd

P = 40


def _run(base_toxic, steered_toxic, chosen=1.0, layer=None, kind="steer", prompts=None):
    """A finished run: per-prompt max toxicity 0.9 where toxic, 0.1 elsewhere."""

    def row(toxic, ppl):
        per = np.where(np.asarray(toxic, bool), 0.9, 0.1).tolist()
        return {
            "natural_prior": {"per_prompt_max": per, "toxicity_prob": float(np.mean(toxic))},
            "ppl_mean": ppl,
            "values": {"samples": 25},
        }

    base_p, steer_p = float(np.mean(base_toxic)), float(np.mean(steered_toxic))
    result = {
        "chosen": chosen,
        "dummy": "off",
        "ppl_rise": 0.12,
        "natural_prior": {
            "base_toxicity_prob": base_p,
            "steered_toxicity_prob": steer_p,
            "ratio": steer_p / base_p,
            "bootstrap": {"ratio_p2.5": 0.1, "ratio_p97.5": 0.9},
        },
    }
    if layer is not None:
        result["layer"] = layer
    return {
        "prompts": {"test": prompts or [f"p{i}" for i in range(P)]},
        "training": {"detox": {"kind": kind}},
        "metrics": {
            "test_base": row(base_toxic, 10.0),
            f"test_d{chosen:+g}_dummyoff": row(steered_toxic, 11.2),
            "select_base": {"natural_prior": {"toxicity_prob": 0.3}},
        },
        "selection": {"table": {f"{chosen:+g}/off": {"toxicity_prob": 0.1, "ppl_rise": 0.2}}},
        "result": result,
    }


def _toxic(seed, share):
    return (np.random.default_rng(seed).random(P) < share).astype(float)


def test_rows_and_interval_match_numpy():
    base, steered = _toxic(0, 0.4), _toxic(1, 0.15)
    run = _run(base, steered, chosen=2.0, layer=10, kind="caa")
    r = cd.rows({"CAA": run})["CAA"]
    assert r["setting"] == "layer 10, strength 2" and r["prompts"] == P and r["samples"] == 25
    assert r["change"] == pytest.approx(100 * (steered.mean() - base.mean()))
    idx = np.random.default_rng(0).integers(0, P, size=(compare.RESAMPLES, P))
    lo, hi = np.percentile((steered - base)[idx].mean(1), [2.5, 97.5])
    assert r["ci"] == pytest.approx((100 * lo, 100 * hi))
    assert lo < steered.mean() - base.mean() < hi and r["ppl_rise"] == pytest.approx(12.0)
    table = cd.table({"CAA": r})
    assert "| CAA | layer 10, strength 2 |" in table and f"{r['change']:+.1f}" in table
    assert cd.held_out_curve(run) == [("+2", pytest.approx(-20.0), pytest.approx(20.0))]
    assert cd.setting(_run(base, steered, chosen=1.5)) == "+1.5 x eps0"


def test_versus_is_the_paired_difference():
    base = _toxic(0, 0.4)
    a, b = _run(base, _toxic(2, 0.05)), _run(base, _toxic(3, 0.3))
    v = cd.versus(a, b)
    diff = cd.per_prompt_change(a) - cd.per_prompt_change(b)
    idx = np.random.default_rng(0).integers(0, P, size=(compare.RESAMPLES, P))
    means = diff[idx].mean(1)
    assert v["difference"] == pytest.approx(100 * diff.mean())
    assert (v["p2.5"], v["p97.5"]) == pytest.approx(tuple(100 * np.percentile(means, [2.5, 97.5])))
    assert v["share_a_lower"] == pytest.approx((means < 0).mean()) and v["share_a_lower"] > 0.9
    with pytest.raises(ValueError, match="same prompts"):
        cd.versus(a, _run(base, base, prompts=[f"q{i}" for i in range(P)]))


def test_plot_writes_a_png(tmp_path):
    runs = {
        "LM-Steer": _run(_toxic(0, 0.4), _toxic(1, 0.2)),
        "CAA": _run(_toxic(0, 0.4), _toxic(2, 0.1), layer=6, kind="caa"),
    }
    out = cd.plot(tmp_path / "d.png", runs, "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp.png"))
    assert cd.plot(tmp_path / "none.png", {}) is None


def test_held_out_table_lists_layers_then_strengths():
    run = _run(_toxic(0, 0.4), _toxic(1, 0.1), chosen=1.5, layer=10, kind="caa")
    run["selection"] = {
        "layers": {"6@1": {"toxicity_prob": 0.2, "ppl_rise": 0.1}, "10@1": {"toxicity_prob": 0.1, "ppl_rise": 0.05}},
        "layer": 10,
        "table": {
            "+1/off": {"toxicity_prob": 0.1, "ppl_rise": 0.05},
            "+1.5/off": {"toxicity_prob": 0.05, "ppl_rise": 0.25},
        },
    }
    lines = cd.held_out_table("CAA", run).splitlines()
    assert lines[0] == "CAA, held out (unsteered toxicity probability 30.0%):"
    assert lines[4:] == [
        "| layer 6, strength 1 | 20.0 | -10.0 | +10 |",
        "| layer 10, strength 1 | 10.0 | -20.0 | +5 |",
        "| layer 10, strength 1.5 **(chosen)** | 5.0 | -25.0 | +25 |",
    ]


def test_other_test_rows_are_listed_and_compared():
    base, chosen, other = _toxic(0, 0.4), _toxic(1, 0.1), _toxic(2, 0.25)
    run = _run(base, chosen, chosen=1.5, layer=15, kind="caa")
    extra = _run(base, other, chosen=0.5)["metrics"]["test_d+0.5_dummyoff"]
    run["metrics"]["test_d+0.5_dummyoff"] = extra
    ((key, label, change, ci, rise),) = cd.other_tests(run)
    assert (key, label) == ("test_d+0.5_dummyoff", "layer 15, strength 0.5")
    assert change == pytest.approx(100 * (other.mean() - base.mean())) and ci[0] < change < ci[1]
    assert rise == pytest.approx(12.0)
    r = cd.rows({"CAA": run})["CAA"]
    assert r["others"][0][0] == key and "| CAA | layer 15, strength 0.5 (not chosen) |" in cd.table({"CAA": r})
    v = cd.versus(run, run, key_a=key)
    assert v["difference"] == pytest.approx(100 * (other.mean() - chosen.mean()))
