"""The KALA report's verdicts (jsteer.kala.report, rendered by experiments/kala_report.py): the
issue's F1 targets are judged on paired per-seed gains over fine-tuning, and the whole-data section
reads its own sweep files; the sweep protocol (jsteer.kala.protocol) merges parallel sweeps."""

import json

import pytest

from jsteer.kala import protocol
from jsteer.kala import report as R


def _run(variant, seed, f1, step=0.5, wall=100.0):
    return {
        "variant": variant,
        "seed": seed,
        "f1": f1,
        "f1_seen": f1 + 1,
        "f1_unseen": f1 - 1,
        "median_step_seconds": step,
        "train_seconds": wall,
        "steps": 10,
        "final_loss": 0.1,
        "params": 1e6,
    }


def _write(tmp_path, name, runs):
    setup = {
        "train_size": 100,
        "test_size": 50,
        "epochs": 1,
        "batch_size": 16,
        "lr": 3e-4,
        "kala_lr": 1e-3,
        "max_len": 64,
        "eval_split": "test",
    }
    (tmp_path / name).write_text(json.dumps({"setup": setup, "runs": runs}))


def test_f1_target_is_the_mean_paired_gain(tmp_path):
    # CoNLL target +0.4: seed gains +1.0, +0.0, +0.5 -> mean +0.5 met; an unpaired extra seed is ignored
    runs = [_run("finetune", s, f) for s, f in ((0, 80.0), (1, 81.0), (2, 79.0), (3, 70.0))]
    runs += [_run("relational_edrop", s, f, step=0.55, wall=105.0) for s, f in ((0, 81.0), (1, 81.0), (2, 79.5))]
    _write(tmp_path, "ner_conll_full.json", runs)
    # NCBI target +1.0: +0.9 on every seed -> missed
    _write(
        tmp_path,
        "ner_ncbi_full.json",
        [_run("finetune", s, 70.0) for s in range(3)] + [_run("relational_edrop", s, 70.9) for s in range(3)],
    )
    text = R.full_data_lines(tmp_path)
    conll = next(x for x in text.splitlines() if x.startswith("- CoNLL-2003 F1"))
    assert "= +0.50 +- 0.50" in conll and "+1.00, +0.00, +0.50" in conll and "**met**" in conll
    ncbi = next(x for x in text.splitlines() if x.startswith("- NCBI-Disease F1"))
    assert "+0.90" in ncbi and "**missed**" in ncbi
    # time: same seeds only (fine-tuning's seed 3 is left out), KALA over fine-tuning
    assert "median step 0.550 s vs 0.500 s = 1.10x, train wall 105 s vs 100 s = 1.05x" in text
    assert "every sentence of the split" in text
    assert R.full_data_lines(tmp_path / "missing") == ""


def test_other_graph_sweep_renders_from_its_suffix(tmp_path):
    _write(
        tmp_path,
        "ner_ncbi_full_abbreviation.json",
        [_run("finetune", s, 70.0) for s in range(2)] + [_run("relational_edrop", s, 71.5) for s in range(2)],
    )
    assert R.full_data_lines(tmp_path) == ""  # no ner_*_full.json
    text = R.full_data_lines(tmp_path, "_full_abbreviation")
    assert "NCBI-Disease F1" in text and "+1.50" in text and "**met**" in text


def test_graph_strategy_is_protocol_and_parallel_sweeps_merge(tmp_path):
    base = {
        "train_size": 100,
        "test_size": 50,
        "epochs": 1,
        "batch_size": 16,
        "lr": 3e-4,
        "kala_lr": 1e-3,
        "max_len": 64,
        "eval_split": "test",
    }
    old = base | {"graph": {"strategy": "frequent"}}  # written before graph_strategy was a setup key
    assert protocol.protocol_diff(old, base | {"graph_strategy": "frequent"}) == {}
    assert protocol.protocol_diff(old, base | {"graph_strategy": "abbreviation"}) == {
        "graph_strategy": ("frequent", "abbreviation")
    }
    # two processes sweep different variants into one file: each save keeps the other's runs
    out = tmp_path / "ner_ncbi_x.json"
    a = {"setup": base | {"graph_strategy": "abbreviation"}, "runs": []}
    b = json.loads(json.dumps(a))
    protocol.save_run(out, a, _run("relational_edrop", 0, 71.0))
    protocol.save_run(out, b, _run("finetune", 0, 70.0))
    protocol.save_run(out, a, _run("relational_edrop", 1, 72.0))
    got = sorted((r["variant"], r["seed"]) for r in json.loads(out.read_text())["runs"])
    assert got == [("finetune", 0), ("relational_edrop", 0), ("relational_edrop", 1)]
    assert not out.with_name(out.name + ".tmp").exists()
    other = {"setup": base | {"graph_strategy": "frequent"}, "runs": []}
    with pytest.raises(SystemExit, match="graph_strategy"):
        protocol.save_run(out, other, _run("finetune", 1, 70.0))
    assert len(json.loads(out.read_text())["runs"]) == 3


def test_lexicon_quality_counts_overlaps_against_gold_spans():
    from jsteer.kala.metrics import lexicon_quality
    from jsteer.kala.mining import Lexicon

    lex = Lexicon(cased={("APC",): "apc"}, uncased={("breast", "cancer"): "breast cancer", ("loci",): "loci"})
    sents = [
        ("breast cancer and APC loci".split(), [(0, 2), (3, 4)]),  # exact, exact, spurious
        ("the breast cancer gene".split(), [(1, 4)]),  # overlaps, not exact
        ("no mention of colon cancer".split(), [(3, 5)]),
    ]  # missed
    got = lexicon_quality(lex, sents)
    assert (got["mentions"], got["gold_spans"]) == (4, 4)
    assert got["precision_overlap"] == 3 / 4 and got["precision_exact"] == 2 / 4 and got["recall_overlap"] == 3 / 4
    assert got["mentions_per_sentence"] == 4 / 3


def test_step_overhead_table_gives_each_method_against_fine_tuning(tmp_path):
    assert R.step_overhead_lines(tmp_path) == ""
    per = {"finetune": 0.200, "pointwise": 0.210, "relational_edrop": 0.224}
    steps = {v: {"median_step_seconds": s, "ratio_to_finetune": s / 0.2, "steps_timed": 8} for v, s in per.items()}
    (tmp_path / "step_overhead.json").write_text(
        json.dumps(
            {
                "backbones": {
                    "minilm": {
                        "params": {"finetune": 22_600_000, "pointwise": 25_700_000, "relational_edrop": 27_700_000},
                        "steps": {"32": steps},
                    }
                }
            }
        )
    )
    row = next(x for x in R.step_overhead_lines(tmp_path).splitlines() if x.startswith("| minilm"))
    assert row == "| minilm | 32 | 200 | 210 (1.050x) | 224 (1.120x) | 22.6M / 27.7M |"


def test_gpu_tables_sort_by_run_then_batch_with_variants(tmp_path):
    results = tmp_path / "kala"
    results.mkdir()
    for run, name in (
        ("gpu_b", "kala_b32.md"),
        ("gpu_a", "kala_b256_fused.md"),
        ("gpu_a", "kala_b32.md"),
        ("gpu_a", "kala_b256.md"),
    ):
        (tmp_path / run).mkdir(exist_ok=True)
        (tmp_path / run / name).write_text(name)
    got = [f"{md.parent.name}/{md.name}" for md in R.gpu_bench_files(results)]
    assert got == ["gpu_a/kala_b32.md", "gpu_a/kala_b256.md", "gpu_a/kala_b256_fused.md", "gpu_b/kala_b32.md"]
