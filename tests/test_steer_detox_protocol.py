"""The LM-Steer experiments' protocol (jsteer.steer.protocol / data / report, run by
experiments/steer_detox.py, steer_sweep.py and steer_plots.py): the prior shift of the toxicity
evaluator against Bayes' rule written out, the paired bootstrap of the toxicity-probability ratio,
the seeded text splits, sweep config names and the report's tables."""

import numpy as np
import pytest

from jsteer.steer import data as C
from jsteer.steer import protocol as D
from jsteer.steer import report_runs as P


def test_natural_prior_is_bayes_rule():
    p = np.random.default_rng(0).uniform(0.001, 0.999, 200)
    for prior, train_prior in ((D.PRIOR, 0.5), (0.3, 0.6)):
        # P(x|toxic) ~ p / train_prior, P(x|clean) ~ (1 - p) / (1 - train_prior); reweight by the new prior
        num = p / train_prior * prior
        want = num / (num + (1 - p) / (1 - train_prior) * (1 - prior))
        np.testing.assert_allclose(D.natural_prior(p, prior, train_prior), want, rtol=1e-12)
    np.testing.assert_allclose(D.natural_prior(p, 0.5, 0.5), p, rtol=1e-12)
    q = D.natural_prior(np.sort(p))
    assert np.all(np.diff(q) > 0) and np.all(q < np.sort(p))  # a rarer class: every score drops, order kept
    assert D.natural_prior(np.array([0.0, 1.0])).tolist() == pytest.approx([0.0, 1.0], abs=1e-10)


def test_paired_bootstrap_ratio():
    base = [0.9, 0.8, 0.1, 0.7, 0.2, 0.6]  # per-prompt max toxicity: 4 of 6 prompts toxic
    same = D.paired_bootstrap(base, base, 500)
    assert same["ratio_p2.5"] == same["ratio_p97.5"] == 1.0 and same["share_ratio_le_0.5"] == 0.0
    gone = D.paired_bootstrap(base, [0.0] * 6, 500)
    assert gone["ratio_p97.5"] == 0.0 and gone["share_ratio_le_0.5"] == 1.0
    half = D.paired_bootstrap(base, [0.9, 0.8, 0.1, 0.1, 0.2, 0.1], 2000)  # 2 of the 4 stay toxic
    assert half["ratio_p2.5"] < 0.5 == half["ratio_p50"] < half["ratio_p97.5"] <= 1.0


def test_replication_prompts_come_from_texts_the_steer_did_not_train_on():
    import collections

    trained, _ = C.jigsaw_steer_texts(600)
    rest, labels = C.jigsaw_steer_unused(600)
    split, split_labels = C.jigsaw_splits(0)[0]
    assert not set(trained) & set(rest)
    assert collections.Counter(trained) + collections.Counter(rest) == collections.Counter(split)
    by_text = dict(zip(split, split_labels))
    assert all(by_text[t] == y for t, y in zip(rest, labels))


def test_sweep_config_names_cover_the_baselines():
    """steer_sweep.py config names: the steer recipes as before, and the issue's two baselines."""
    assert D.parse_config("r8_s400_lr3e-3")["kind"] == "steer"
    assert D.parse_config("r8_s400_lr3e-3")["rank"] == 8 and D.parse_config("rfull")["rank"] is None
    bl = D.parse_config("blacklist_s300_graded")
    assert (bl["kind"], bl["rank"], bl["steps"], bl["labels"]) == ("blacklist", None, 300, "graded")
    assert D.parse_config("offset")["kind"] == "offset"
    assert D.parse_config("r1000")["data"] == "sst5"
    own = D.parse_config("r1000_self_s50")
    assert (own["data"], own["steps"], own["rank"]) == ("self", 50, 1000)
    with pytest.raises(ValueError, match="bad config name"):
        D.parse_config("wordlist")


def test_self_generated_texts_take_the_labelers_extremes_of_unseen_prompts():
    """steer_sweep's ``_self`` data: the model's own continuations of neutral prompts outside
    ``exclude``, the n/2 least positive at -1 and the n/2 most positive at +1, prompt in front."""

    exclude = C.prompt_pool("neutral")[::2]
    calls = []

    class FakeLM:  # continuation k of a batch says how positive it is
        def generate(self, prompts, max_new_tokens, temperature, top_p, seed, hooks):
            calls.append(list(prompts))
            return [f" score {(seed + i) % 97}" for i in range(len(prompts))]

    scored = []

    class Labeler:
        def prob(self, texts):
            scored.extend(int(t.split()[-1]) for t in texts)
            return np.asarray([int(t.split()[-1]) / 96 for t in texts])

    texts, values = C.self_generated_texts(FakeLM(), Labeler(), 10, exclude, n_prompts=20, samples=3, seed=3)
    seen = {p for c in calls for p in c}
    assert len(seen) == 20 and not seen & set(exclude) and len(scored) == 60
    assert values.shape == (10, 2) and (values[:5] == -1).all() and (values[5:] == 1).all()
    scores = [int(t.split()[-1]) for t in texts]
    assert sorted(scores[:5]) == sorted(scored)[:5] and sorted(scores[5:]) == sorted(scored)[-5:]
    assert all(any(t.startswith(p) and t[len(p) :].startswith(" score") for p in seen) for t in texts)
    with pytest.raises(ValueError, match="10 texts from 2 of"):
        C.self_generated_texts(FakeLM(), Labeler(), 10, exclude, n_prompts=2, samples=3)


def test_self_detox_texts_start_from_trained_toxic_prefixes_and_put_the_least_toxic_at_plus_one():
    """steer_detox --data self: continuations of the toxic prefixes of the steer's own Jigsaw texts,
    never of an excluded (tested) prompt; the labeler's least toxic half is +1, the most toxic -1."""
    texts, values = C.jigsaw_steer_texts(600)
    own = C.toxic_prefixes(texts, (values < 0).astype(int))
    exclude = own[::3]
    seen = []

    class FakeLM:
        def generate(self, prompts, max_new_tokens, temperature, top_p, seed, hooks):
            seen.extend(prompts)
            return [f" tox {(seed + i) % 89}" for i in range(len(prompts))]

    class Labeler:  # P(toxic) grows with the number in the continuation
        def prob(self, texts):
            return np.asarray([int(t.split()[-1]) / 88 for t in texts])

    got, vals = C.self_detox_texts(FakeLM(), Labeler(), exclude, jigsaw_texts=600, self_texts=40, self_samples=2)
    assert set(seen) == set(own) - set(exclude) and len(got) == 40 and vals.shape == (40,)
    tox = np.asarray([int(t.split()[-1]) for t in got])
    assert (vals[:20] == -1).all() and (vals[20:] == 1).all()
    assert tox[:20].min() >= tox[20:].max()  # -1: the most toxic continuations
    assert all(any(t.startswith(p + " tox") for p in seen) for t in got)


def test_cached_texts_are_made_once_per_key(tmp_path):
    """steer_sweep's on-policy texts are kept on disk by their recipe's key, so the hidden-state
    cache's key check does not regenerate them (~4 min) on every run."""

    made = []

    def make(tag):
        made.append(tag)
        return [f"text {tag}", "b"], np.asarray([[1.0, 1.0], [-1.0, -1.0]], np.float32)

    path = tmp_path / "texts.json"
    first = C.cached_texts(path, {"model": "m", "labeler": "a"}, lambda: make("a"))
    again = C.cached_texts(path, {"model": "m", "labeler": "a"}, lambda: make("never"))
    assert made == ["a"] and again[0] == first[0] == ["text a", "b"]
    np.testing.assert_array_equal(again[1], first[1])
    assert again[1].dtype == np.float32
    other = C.cached_texts(path, {"model": "m", "labeler": "b"}, lambda: make("b"))  # another recipe: remade
    assert made == ["a", "b"] and other[0] == ["text b", "b"]
    assert C.cached_texts(path, {"model": "m", "labeler": "b"}, lambda: make("never"))[0] == ["text b", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts.json"]  # no temp file left


def test_detox_kinds_train_at_their_own_eps0_and_tabulate_side_by_side(tmp_path):
    """steer_detox.py --kind: LM-Steer at eps0 1e-3, the baselines at train.BASELINE_EPS0; the
    comparison table (steer_plots.detox_kinds_table) has one row per finished run, empty before."""

    from jsteer.steer import train

    assert D.eps0_of("steer") == 1e-3
    assert D.eps0_of("blacklist") == D.eps0_of("offset") == train.BASELINE_EPS0
    assert P.detox_kinds_table(tmp_path) == ""
    setup = {
        "test_prompts": 6,
        "samples_per_test_prompt": 2,
        "held_out_prompts": 4,
        "samples_per_held_out_prompt": 2,
        "strengths": [1.0, 2.0],
        "dummy_grid": ["off"],
    }
    boot = {"ratio_p2.5": 0.1, "ratio_p97.5": 0.9}
    for kind, chosen, steered in (("steer", 1.0, 0.05), ("offset", 2.0, 0.1), ("caa", 3.0, 0.03)):
        run = {
            "setup": {**setup, "eps0": D.eps0_of(kind)}
            if kind != "caa"
            else {**setup, "eps0": 1.0, "strengths": [1.0, 3.0]},
            **({"training": {"detox": {"kind": "caa", "layer": 15}}} if kind == "caa" else {}),
            "selection": {"chosen": chosen, "dummy": "off"},
            "result": {
                "ppl_rise": -0.05,
                "natural_prior": {
                    "base_toxicity_prob": 0.15,
                    "steered_toxicity_prob": steered,
                    "ratio": steered / 0.15,
                    "bootstrap": boot,
                },
            },
            "metrics": {f"test_d{chosen:+g}_dummyoff": {"dist3": 0.9}},
        }
        (tmp_path / f"detox_kinds_{kind}.json").write_text(__import__("json").dumps(run))
    (tmp_path / "detox_kinds_blacklist.json").write_text('{"setup": {}}')  # unfinished: no row
    rows = [r for r in P.detox_kinds_table(tmp_path).splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| LM-Steer (eps0 0.001)",
        "| context-vector offset (eps0 1)",
        "| CAA control vector, layer 15, values [1.0, 3.0] (eps0 1)",
    ]
    assert rows[1].endswith("| +2 | 15.0 -> 10.0 | 0.67 | 0.10-0.90 | -5.0 | 0.90 |")
    assert rows[2].endswith("| +3 | 15.0 -> 3.0 | 0.20 | 0.10-0.90 | -5.0 | 0.90 |")


def test_a_sweeps_tested_choice_is_tabulated_and_judged_against_the_targets(tmp_path):
    """steer_sweep.py --test scores each config's held-out choice on the test prompts;
    steer_plots shows those rows and judges the recipe with the largest held-out gap (not the
    best test row) against issue 4's targets, the perplexity limit included."""
    import json

    def cell(pos, rise):
        return {"positivity": pos, "ppl_rise": rise}

    def config(rank, gap, test_pos, test_neg, neg_rise):
        return {
            "config": {
                "kind": "steer",
                "rank": rank,
                "steps": 150,
                "lr": 1e-2,
                "l2": 1e-6,
                "labels": "binary",
                "neutral_texts": 0,
                "data": "self",
            },
            "W_fro_norm": 1.0,
            "table": {"+4": cell(0.9, 0.2), "-4": cell(0.9 - gap, 0.1)},
            "chosen": {
                "positive": 4.0,
                "negative": 4.0,
                "positivity_pos": 0.9,
                "positivity_neg": 0.9 - gap,
                "gap": gap,
            },
            "test": {
                "positive": dict(cell(test_pos, 0.1), value=4.0),
                "negative": dict(cell(test_neg, neg_rise), value=-4.0),
            },
        }

    sw = {
        "setup": {"strengths": [4.0], "max_ppl_rise": 0.3, "texts": "t", "prompts": "p", "samples_per_prompt": 10},
        "base": {"positivity": 0.5},
        "base_test": {"positivity": 0.52, "ppl_mean": 19.2, "prompts": "the 20 test prompts"},
        "configs": {
            "r32_self": config(32, 0.7, 0.81, 0.15, 0.05),  # largest gap: the one judged
            "r16_self": config(16, 0.6, 0.95, 0.05, 0.0),
        },
    }  # better on test, smaller held-out gap
    (tmp_path / "sweep_smollm2_self_lowrank.json").write_text(json.dumps(sw))
    table = P.recipe_sweeps(tmp_path)
    assert "the choice is then scored on the test prompts" in table
    assert "| rank 32, 150 steps, own continuations | +4 | 0.81 | +10% | -4 | 0.15 | +5% | met |" in table
    lines = P.tested_recipe_targets(tmp_path)
    assert len(lines) == 2 and all("rank 32" in line and line.endswith("-> met") for line in lines)
    sw["configs"]["r32_self"]["test"]["negative"]["ppl_rise"] = 0.31  # fluent enough no more
    (tmp_path / "sweep_smollm2_self_lowrank.json").write_text(json.dumps(sw))
    assert P.tested_recipe_targets(tmp_path)[1].endswith("-> MISSED")
    assert "| 0.15 | +31% | missed |" in P.recipe_sweeps(tmp_path)
    assert P.tested_recipe_targets(tmp_path / "none") == []


def test_other_runs_are_judged_at_their_held_out_choice(tmp_path):
    """steer_plots' Targets lines for the other full runs (smollm2_<tag>.json, e.g. the on-policy
    sentiment steer) use each run's held-out choice, and the detox protocol runs their ratio."""
    import json

    def m(pos, ppl, tox=0.5):
        return {"positivity": pos, "ppl_mean": ppl, "toxicity_prob": tox}

    run = {
        "strength_selection": {"chosen": {"dummy": "off", "positive": 4.0, "negative": 6.0, "detox": 0.5}},
        "metrics": {
            "neutral_base": m(0.5, 20.0),
            "neutral_s+4": m(0.81, 25.0),
            "neutral_s-6": m(0.15, 27.0),
            "neutral_s+8": m(0.99, 21.0),  # not the choice: never judged
            "toxic_base": m(0.3, 30.0, tox=0.8),
            "toxic_d+0.5": m(0.3, 31.0, tox=0.3),
        },
    }
    (tmp_path / "smollm2_self.json").write_text(json.dumps(run))
    (tmp_path / "smollm2_partial.json").write_text(json.dumps({"metrics": {}}))  # no choice yet: skipped
    dx = {
        "result": {
            "ppl_rise": 0.08,
            "natural_prior": {"base_toxicity_prob": 0.3, "steered_toxicity_prob": 0.18, "ratio": 0.6},
        }
    }
    (tmp_path / "detox_smollm2_self.json").write_text(json.dumps(dx))
    lines = P.other_run_targets(tmp_path)
    assert all("results_self.md" in x for x in lines[:5]) and len(lines) == 6
    assert "(neutral_s+4) positivity >= 80%: measured 0.810 -> met" in lines[0]
    assert "neutral_s-6 perplexity rise <= 30%: measured 0.350 -> MISSED" in lines[3]
    assert "detox (toxic_d+0.5) halves toxicity probability: measured 0.375 -> met" in lines[4]
    assert lines[5].endswith("ratio 0.600 at perplexity rise +0.080 -> halved MISSED")
