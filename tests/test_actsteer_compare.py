"""jsteer.actsteer.compare: control vectors beside LM-Steer from saved runs, each row against its
own unsteered row; runs not saved are left out; the plot is written."""

import json

import matplotlib

matplotlib.use("Agg")

from jsteer.actsteer import compare  # noqa: E402


def _row(pos, ppl):
    return {"positivity": pos, "ppl_mean": ppl}


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
    (label, v, dp, dr, chosen), neg = pts["CAA"]
    assert (label, v, chosen) == ("CAA layer 15, +1", 1.0, True)
    assert abs(dp - 15.0) < 1e-9 and abs(dr - 15.0) < 1e-9
    assert abs(neg[2] + 10.0) < 1e-9 and abs(neg[3] - 30.0) < 1e-9
    assert [(r[1], round(r[2], 6), round(r[3], 6), r[4]) for r in pts["LM-Steer"]] == [
        (-1.0, -5.0, 5.0, True),
        (2.0, 20.0, 20.0, True),
        (7.0, 40.0, 1900.0, False),
    ]
    rows = compare.table(pts).splitlines()
    assert rows[2] == "| CAA layer 15, +1 | +15 | +15 | yes |" and rows[-1] == "| LM-Steer +7 x eps0 | +40 | +1900 |  |"
    png = compare.plot(tmp_path / "out" / "vs.png", pts)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list((tmp_path / "out").glob("*.tmp.png"))
