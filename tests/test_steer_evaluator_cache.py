"""The LM-Steer evaluators' cache (jsteer.steer.evaluate) is keyed by training recipe: two
experiments that train an evaluator differently never load each other's."""

import numpy as np

from jsteer.steer import evaluate as EV


def test_cache_path_names_the_recipe(monkeypatch, tmp_path):
    monkeypatch.setattr(EV, "CACHE", tmp_path)
    assert EV.cache_path("toxicity") == tmp_path / "toxicity"
    assert EV.cache_path("toxicity", 0.8, 1600, 1000) == tmp_path / "toxicity_e0.8_n1600_t1000"
    assert EV.cache_path("sentiment", 0.74) == tmp_path / "sentiment_e0.74"
    assert len({EV.cache_path("toxicity", e, n) for e in (2.0, 0.8) for n in (0, 1600)}) == 4


def test_cached_evaluator_is_retrained_for_another_recipe(tmp_path):
    enc = object()  # Evaluator only touches the encoder when it scores texts
    trained = []

    def train(epochs):
        def fit(_enc):
            trained.append(epochs)
            return EV.Evaluator(_enc, {"w": np.full(3, epochs, np.float32)}, {"epochs": epochs})

        return fit

    path = tmp_path / "toxicity"
    quick, full = ({"epochs": e, "max_train": 0, "max_test": 0} for e in (0.8, 2.0))
    ev = EV._cached(path, enc, train(0.8), recipe=quick)
    assert ev.meta["recipe"] == quick and trained == [0.8]
    again = EV._cached(path, enc, train(0.8), recipe=quick)  # loaded, not retrained
    assert trained == [0.8] and np.allclose(again.params["w"], 0.8)
    other = EV._cached(path, enc, train(2.0), recipe=full)  # same folder, another recipe: retrained
    assert trained == [0.8, 2.0] and np.allclose(other.params["w"], 2.0)
    # a cache written before the recipe was stored: its epochs decide
    from jsteer.io import save_artifact

    legacy = tmp_path / "legacy"
    save_artifact(legacy, {"w": np.zeros(3, np.float32)}, {"epochs": 2.0})
    assert np.allclose(EV._cached(legacy, enc, train(2.0), recipe=full).params["w"], 0.0) and len(trained) == 2
    EV._cached(legacy, enc, train(0.8), recipe=quick)
    assert trained == [0.8, 2.0, 0.8]


def test_summarize_keeps_positivity_per_prompt(monkeypatch):
    """summarize: positivity overall and per prompt (samples [P][S] scored in one flat batch)."""

    class Clf:
        def prob(self, texts):  # positive when the text says so
            return np.array([0.9 if "good" in t else 0.1 for t in texts])

    monkeypatch.setattr(EV, "fluency_diversity", lambda lm, prompts, samples: {"ppl_mean": 1.0})
    samples = [["good", "bad", "good", "good"], ["bad", "bad", "bad", "good"], ["bad"] * 4]
    m = EV.summarize(None, Clf(), None, ["a", "b", "c"], samples)
    assert m["positivity_per_prompt"] == [0.75, 0.25, 0.0] and abs(m["positivity"] - 4 / 12) < 1e-12
    assert m["ppl_mean"] == 1.0
