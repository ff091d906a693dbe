"""jsteer.actsteer.compare: control vectors beside LM-Steer from saved runs, each row against its
own unsteered row; runs not saved are left out; the plot is written."""

import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from jsteer.actsteer import compare  # noqa: E402


def _row(pos, ppl, per_prompt=None):
    row = {"positivity": pos, "ppl_mean": ppl, "values": {"samples": 5}}
    if per_prompt is not None:
        row["positivity_per_prompt"] = per_prompt
    return row


def test_points_table_and_plot(tmp_path):
    assert compare.points(tmp_path, tmp_path / "none.json") == {}
    assert compare.table({}) == "" and compare.plot(tmp_path / "x.png", {}) is None
    caa = {
        "selection": {"chosen": {"layer": 15, "strength": 1.0}},
        "metrics": {
            "neutral_base": _row(0.40, 20.0),
            "neutral_l15_s+1": _row(0.55, 23.0),
            "neutral_l15_s-1": _row(0.30, 26.0),
        },
    }
    (tmp_path / "smollm2.json").write_text(json.dumps(caa))
    steer = {
        "strength_selection": {"chosen": {"positive": 2.0, "negative": 1.0}},
        "metrics": {
            "neutral_base": _row(0.50, 10.0),
            "neutral_s+2": _row(0.70, 12.0),
            "neutral_s-1": _row(0.45, 10.5),
            "neutral_s+7": _row(0.90, 200.0),
        },
    }
    (tmp_path / "steer.json").write_text(json.dumps(steer))
    pts = compare.points(tmp_path, tmp_path / "steer.json")
    assert list(pts) == ["CAA", "LM-Steer"]  # no PCA run saved
    (label, v, dp, dr, chosen, ci), neg = pts["CAA"]
    assert (label, v, chosen, ci) == ("CAA layer 15, +1", 1.0, True, None)  # no per-prompt positivity saved
    assert abs(dp - 15.0) < 1e-9 and abs(dr - 15.0) < 1e-9
    assert abs(neg[2] + 10.0) < 1e-9 and abs(neg[3] - 30.0) < 1e-9
    assert [(r[1], round(r[2], 6), round(r[3], 6), r[4]) for r in pts["LM-Steer"]] == [
        (-1.0, -5.0, 5.0, True),
        (2.0, 20.0, 20.0, True),
        (7.0, 40.0, 1900.0, False),
    ]
    rows = compare.table(pts).splitlines()
    assert (
        rows[2] == "| CAA layer 15, +1 | +15 |  | +15 | yes |"
        and rows[-1] == "| LM-Steer +7 x eps0 | +40 |  | +1900 |  |"
    )
    assert compare.samples_per_prompt(tmp_path, tmp_path / "steer.json") == {5}
    png = compare.plot(tmp_path / "out" / "vs.png", pts, subtitle="20 neutral prompts x 5 samples")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list((tmp_path / "out").glob("*.tmp.png"))


def test_intervals_and_versus_resample_prompts(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.integers(0, 6, 20) / 5  # 20 prompts x 5 samples
    up = np.clip(base + rng.integers(0, 4, 20) / 5, 0, 1)
    flat = np.clip(base + rng.integers(-1, 2, 20) / 5, 0, 1)
    a = {"neutral_base": _row(base.mean(), 10.0, base.tolist()), "up": _row(up.mean(), 11.0, up.tolist())}
    b = {"neutral_base": _row(base.mean(), 10.0, base.tolist()), "flat": _row(flat.mean(), 10.5, flat.tolist())}
    lo, hi = compare.interval(up - base)
    assert lo < 100 * (up - base).mean() < hi and lo > 0  # a clear rise: the interval excludes 0
    # the interval is over prompts: the same per-prompt changes repeated 4x (as if 4x the prompts) narrow it ~2x
    lo4, hi4 = compare.interval(np.tile(up - base, 4))
    assert 0.35 < (hi4 - lo4) / (hi - lo) < 0.65
    v = compare.versus((a, "up"), (b, "flat"))
    assert abs(v["difference"] - 100 * ((up - base) - (flat - base)).mean()) < 1e-9
    assert v["p2.5"] < v["difference"] < v["p97.5"] and 0.0 <= v["share_a_ahead"] <= 1.0
    same = compare.versus((a, "up"), (a, "up"))
    assert same["difference"] == same["p2.5"] == same["p97.5"] == 0.0 and same["share_a_ahead"] == 0.0
    with pytest.raises(ValueError, match="not the same test prompts"):
        compare.versus((a, "up"), ({"neutral_base": _row(0.5, 1, [0.5]), "x": _row(0.5, 1, [0.5])}, "x"))
    with pytest.raises(ValueError, match="no per-prompt positivity"):
        compare.versus((a, "up"), ({"neutral_base": _row(0.5, 1), "x": _row(0.5, 1)}, "x"))
    # points carry the interval when the run saved per-prompt positivity; the table prints it
    metrics = {"neutral_base": a["neutral_base"], "neutral_l3_s+2": a["up"], "neutral_l3_s-2": b["flat"]}
    (tmp_path / "smollm2.json").write_text(
        json.dumps({"selection": {"chosen": {"layer": 3, "strength": 2.0}}, "metrics": metrics})
    )
    pts = compare.points(tmp_path, tmp_path / "none.json")
    row_up = pts["CAA"][0]
    assert row_up[5] == compare.interval(up - base)
    assert f"| {row_up[5][0]:+.0f} to {row_up[5][1]:+.0f} |" in compare.table(pts).splitlines()[2]
