"""The demo's sections (jsteer.demo.sections), each on its own, on the embedded models.

The models and the section results are module-scoped: each section runs once. Missing data
(the KG examples, SST-5) fails, never skips.
"""

import json

import pytest

import jsteer
from jsteer.demo import sections, summary
from jsteer.steer import artifact


@pytest.fixture(scope="module")
def smol(shared_data):
    return jsteer.load("smollm2-135m")


@pytest.fixture(scope="module")
def minilm():
    return jsteer.load("minilm")


@pytest.fixture(scope="module")
def scorer(minilm, shared_data):
    return sections.sentiment_scorer(minilm, n_train=300, n_test=200)


@pytest.fixture(scope="module")
def steer(smol, scorer, minilm):
    return sections.steer_section(smol, scorer[0], sections.english_words(minilm))


@pytest.fixture(scope="module")
def typevec(smol):
    return sections.typevec_section(smol)


@pytest.fixture(scope="module")
def kala():
    return sections.kala_section()


def test_scorer_beats_chance(scorer):
    assert scorer[1]["accuracy"] >= 0.7, scorer[1]


def test_shipped_steer_is_rank_32_for_smollm2_and_refused_elsewhere(smol, minilm):
    params, meta, card = sections.load_steer(smol)
    assert params["p1"].shape == params["p2"].shape == (1, smol.config.hidden_size, 32)
    assert meta["base_model"] == smol.identity == card["base_model"]["identity"]
    assert meta["dummy"] is False and meta["steer_names"] == ["sentiment"]
    assert sections.STEER_FILE.stat().st_size < 200_000
    assert card["rank"] == 32 and "experiments/demo_steer.py" in card["command"]
    with pytest.raises(artifact.WrongModelError):
        sections.load_steer(minilm)
    # the card's evaluation is the committed sweep row it names
    src = json.loads((sections.ASSETS.parents[1] / "experiments/results/steer/sweep_smollm2.json").read_text())
    assert {v: r["positivity"] for v, r in card["evaluation"]["table"].items()} == {
        v: r["positivity"] for v, r in src["configs"]["r32"]["table"].items()
    }


def test_steer_moves_continuations_towards_its_sign(steer, scorer):
    m = steer["mean"]
    lo, zero, hi = steer["values"]
    # the steer's own logit projection of the continuation's tokens orders -v < 0 < +v
    assert m[lo]["projection"] < m[zero]["projection"] < m[hi]["projection"], m
    # and the independent MiniLM scorer finds +v more positive than -v
    assert m[hi]["positivity"] > m[lo]["positivity"] + 0.2, m
    texts = {v: [r["text"] for r in steer["rows"] if r["value"] == v] for v in steer["values"]}
    assert texts[lo] != texts[zero] != texts[hi]
    assert len(steer["top"]) >= 5 and len(steer["bottom"]) >= 5
    assert not set(steer["top"]) & set(steer["bottom"])
    # the words it promotes read as more positive than those it demotes
    assert scorer[0](steer["top"]).mean() > scorer[0](steer["bottom"]).mean() + 0.1


def test_type_vector_moves_next_token_towards_cities(typevec):
    for before, after in zip(typevec["before"], typevec["after"]):
        assert after["city_mass"] > 2 * before["city_mass"], (before, after)
        assert after["held_out_city_mass"] > before["held_out_city_mass"], (before, after)
    assert typevec["examples"][:3] == ["Nuremberg", "Naples", "London"]  # the committed run's sample


def test_kala_reads_unseen_entity_classes_off_the_graph(kala):
    f = kala["f1"]
    assert f["relational"]["unseen"] >= 70.0, f
    assert f["relational"]["unseen"] >= f["finetune"]["unseen"] + 40.0, f
    assert min(f["finetune"]["seen"], f["relational"]["seen"]) >= 90.0, f
    for m in f.values():
        assert m["loss_first_last"][1] < m["loss_first_last"][0]


def test_control_vector_steers_sentiment(smol, scorer):
    r = sections.actsteer_section(smol, scorer[0])
    assert r["recipe"]["texts_sha256"] == r["committed"]["texts_sha256"]  # the committed recipe's texts
    lo, zero, hi = r["strengths"]
    assert r["mean_positivity"][hi] > r["mean_positivity"][lo], r["mean_positivity"]
    assert r["committed"]["held_out"] is not None


def test_composition_one_call_per_row_strengths_no_recompile(smol):
    r = sections.compose_section(smol)
    rows = {(x["steer"], x["type"]): x for x in r["rows"]}
    lam, v = sections.TYPEVEC_LAMBDA, sections.COMPOSE_VALUE
    assert all(rows[(s, lam)]["first_token_is_city"] for s in (0.0, v, -v))  # the type vector acts in every row
    assert not rows[(0.0, 0.0)]["first_token_is_city"]
    assert rows[(v, lam)]["projection"] > rows[(-v, lam)]["projection"]  # and so does the steer
    assert len({x["text"] for x in r["rows"]}) == len(r["rows"])  # every setting changes the text
    assert r["second_call_new_programs"] == 0


def test_summary_page_is_written(tmp_path, steer, typevec, kala):
    png = summary.write_png(tmp_path / "summary.png", steer, typevec, kala)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    page = summary.write_html(tmp_path / "summary.html", png, ["line one"], {"1. LM-Steer": 1.0})
    text = page.read_text()
    assert "src='data:image/png;base64,iVBORw0KGgo" in text and "line one" in text and "1.0 s" in text


def test_cli_has_quiet_and_out(capsys):
    from jsteer.demo import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--quiet" in text and "--out" in text and "LM-Steer" in text


def test_quiet_silences_the_bars_of_every_section(monkeypatch):
    import jsteer.demo as demo
    from jsteer import progress

    monkeypatch.delenv("JSTEER_QUIET", raising=False)
    seen = []
    monkeypatch.setattr(demo, "_run", lambda args: seen.append(progress.is_quiet()) or 0)
    assert demo.main(["--quiet"]) == 0 and demo.main([]) == 0
    assert seen == [True, False] and not progress.is_quiet()
