"""jsteer.progress: one bar per job in one look, silenced by the quiet switch; jsteer.plots
writes PNGs atomically."""

import numpy as np
import pytest

from jsteer import plots, progress
from jsteer.steer import train


def _bar_lines(err: str, desc: str) -> list[str]:
    """The final renderings of the bars called ``desc`` (tqdm redraws with \\r; a closed bar
    that is left ends with a newline)."""
    return [line.split("\r")[-1] for line in err.split("\n") if line.split("\r")[-1].startswith(desc + ":")]


def test_bar_has_one_look_and_quiet_silences_it(capsys, monkeypatch):
    monkeypatch.delenv("JSTEER_QUIET", raising=False)
    with progress.bar(total=5, desc="job", unit="item") as b:
        for _ in range(5):
            b.update(1)
    lines = _bar_lines(capsys.readouterr().err, "job")
    assert len(lines) == 1 and lines[0].startswith("job: 100%|") and "5/5 [" in lines[0] and "item/s" in lines[0]
    for off in (progress.quiet(), _env(monkeypatch)):
        with off:
            assert list(progress.bar(range(3), desc="job")) == [0, 1, 2]
        assert capsys.readouterr().err == ""
    assert not progress.is_quiet()  # quiet() restores the previous setting
    progress.set_quiet(True)
    try:
        with progress.bar(total=2, desc="job") as b:
            b.update(2)
        assert capsys.readouterr().err == ""
    finally:
        progress.set_quiet(False)


class _env:
    def __init__(self, monkeypatch):
        self.mp = monkeypatch

    def __enter__(self):
        self.mp.setenv("JSTEER_QUIET", "1")

    def __exit__(self, *exc):
        self.mp.delenv("JSTEER_QUIET")


def test_caching_hidden_states_draws_one_bar(capsys, monkeypatch):
    monkeypatch.delenv("JSTEER_QUIET", raising=False)
    encs = [[1, 2, 3]] * 7 + [[1, 2]] * 5

    def hidden(ids, mask):
        return np.zeros((*ids.shape, 4), np.float32)

    cache = train.cache_hidden(hidden, encs, np.ones(12), batch_size=4, progress=True)
    assert cache.num_texts == 12
    err = capsys.readouterr().err
    lines = _bar_lines(err, "cache hidden states")
    assert len(lines) == 1 and "12/12" in lines[0], err
    assert "cached " not in err  # no per-batch print lines any more
    with progress.quiet():
        train.cache_hidden(hidden, encs, np.ones(12), batch_size=4, progress=True)
    assert capsys.readouterr().err == ""


def test_summary_line_goes_to_stderr_even_when_quiet(capsys):
    with progress.quiet():
        line = progress.summary("x run", "did it", 1.25, "out/dir", final_loss=0.123456, steps=3, skipped=None)
    cap = capsys.readouterr()
    assert line == "jsteer x run: did it; final loss 0.1235, steps 3; 1.2s; -> out/dir"
    assert cap.err == line + "\n" and cap.out == ""


def test_plots_are_pngs_written_atomically(tmp_path):
    p = plots.scores_chart({"PER": 80.0, "LOC": 55.5}, tmp_path / "a" / "f1.png", title="t")
    assert p.read_bytes().startswith(b"\x89PNG")
    rows = {"City": [{"token": " Paris", "cos": 0.9}, {"token": "\n", "cos": -0.1}]}
    assert plots.neighbours_chart(rows, tmp_path / "n.png").read_bytes().startswith(b"\x89PNG")
    dirs = [{"index": 0, "singular_value": 2.0, "top": [("good", 1.0)], "bottom": [("bad", -1.0)]}]
    assert plots.explain_chart(dirs, tmp_path / "e.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="no type vectors"):
        plots.neighbours_chart({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="folder"):
        plots.scores_chart({"a": 1.0}, tmp_path)
    assert sorted(x.name for x in tmp_path.rglob("*")) == ["a", "e.png", "f1.png", "n.png"]
