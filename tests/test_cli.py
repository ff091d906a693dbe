"""The core `jsteer` verbs, run in-process through jsteer.cli.main."""

import json

import numpy as np
import pytest
from test_io import leaves_equal, make_tiny_decoder

import jsteer
from jsteer.cli import main


@pytest.fixture(scope="module")
def minilm_ckpt(tmp_path_factory):
    dst = tmp_path_factory.mktemp("cli") / "minilm"
    assert main(["convert", "minilm", str(dst)]) == 0
    return dst


def test_convert_writes_a_loadable_checkpoint(minilm_ckpt, capsys):
    back = jsteer.load(minilm_ckpt)
    ref = jsteer.load("minilm")
    assert back.family == "bert" and back.head is None
    assert leaves_equal(back.params, ref.params) and back.identity == ref.identity


def test_convert_dtype_and_head(tmp_path, capsys):
    src = tmp_path / "gpt2"
    make_tiny_decoder(src, "gpt2")
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "saved" in out and "bfloat16" in out
    lm = jsteer.load(tmp_path / "bf16", dtype="bfloat16")
    assert {str(x.dtype) for x in __import__("jax").tree.leaves(lm.params)} == {"bfloat16"}
    # --head on a decoder is an error reported as such (exit code 2, message on stderr)
    assert main(["convert", str(src), str(tmp_path / "x"), "--head", "mlm"]) == 2
    assert "decoder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_info_text_and_json(minilm_ckpt, capsys):
    assert main(["info", str(minilm_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "family:     bert" in out and "hidden_size: 384" in out and "num_layers: 6" in out
    assert "parameters: 22,565,376" in out  # MiniLM-L6 without pooler
    sha = jsteer.load("minilm").provenance["sha256"]
    assert f"sha256: {sha}" in out and "jsteer_version:" in out and "mask_id: 103" in out
    assert main(["info", str(minilm_ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["vocab_size"] == 30522 and info["params"] == 22565376
    assert info["provenance"]["dtype"] == "float32" and info["tokenizer"]["cls_id"] == 101


def test_info_on_a_source_that_is_not_a_checkpoint(tmp_path, capsys):
    src = tmp_path / "llama"
    make_tiny_decoder(src, "llama")
    assert main(["info", str(src), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "decoder" and info["config"]["model_type"] == "llama"
    assert info["config"]["num_kv_heads"] == 2
    assert info["provenance"]["source_format"] == "hf"


def test_generate_prints_continuations(tmp_path, capsys):
    src = tmp_path / "gpt2"
    make_tiny_decoder(src, "gpt2")
    prompts = ["w1 w2 w3", "w4"]
    assert main(["generate", str(src), *prompts, "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    expect = jsteer.load(src).generate(prompts, max_new_tokens=5)
    assert out == [prompts[0] + expect[0], "---", prompts[1] + expect[1], "---"]
    # sampling flags reach the sampler: seeds change the text, equal seeds repeat it
    runs = []
    for seed in (0, 0, 1, 2, 3):
        assert (
            main(
                [
                    "generate",
                    str(src),
                    "w1",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "2",
                    "--top-k",
                    "20",
                    "--top-p",
                    "0.95",
                    "--seed",
                    str(seed),
                ]
            )
            == 0
        )
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and len(set(runs)) > 1


def test_cli_errors(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["generate", "minilm", "hello"]) == 2
    assert "encoder" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "hi", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    assert main(["convert", "minilm", str(tmp_path / "notes")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    with pytest.raises(SystemExit):
        main(["convert", "minilm"])  # DST missing: argparse usage error
    np.testing.assert_equal(capsys.readouterr().err.count("usage"), 1)


def test_convert_keeps_a_checkpoints_dtype(tmp_path, capsys):
    """`convert --dtype bfloat16`, then `convert` and `info` of the result without --dtype:
    still bfloat16 (the default dtype is the stored one for jsteer checkpoints)."""
    src = tmp_path / "gpt2"
    make_tiny_decoder(src, "gpt2")
    assert main(["convert", str(src), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "again")]) == 0
    assert "bfloat16" in capsys.readouterr().out
    lm = jsteer.load(tmp_path / "again")
    assert {str(x.dtype) for x in __import__("jax").tree.leaves(lm.params)} == {"bfloat16"}
    assert main(["info", str(tmp_path / "again"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provenance"]["dtype"] == "bfloat16"
    assert main(["convert", str(src), str(tmp_path / "f32")]) == 0  # an HF source: float32
    assert "float32" in capsys.readouterr().out


def test_generate_with_an_empty_prompt(tmp_path, capsys):
    src = tmp_path / "gpt2"
    make_tiny_decoder(src, "gpt2")
    assert main(["generate", str(src), "w1 w2", "", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == [jsteer.load(src).generate([""], max_new_tokens=4)[0], "---"]


def test_damaged_checkpoint_is_reported_in_one_line(tmp_path):
    """A truncated array file: exit code 2 and a one-line error, not pages of TensorStore spec
    (also at interpreter exit, when Orbax's abandoned readers are finalised), through `python -m jsteer`."""
    import subprocess
    import sys

    from test_io import ROOT, _damage

    src = tmp_path / "llama"
    make_tiny_decoder(src, "llama")
    assert main(["convert", str(src), str(tmp_path / "ck")]) == 0
    _damage(tmp_path / "ck", "truncated array file")
    r = subprocess.run(
        [sys.executable, "-m", "jsteer", "generate", str(tmp_path / "ck"), "w1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("jsteer generate: error:")]
    assert len(errors) == 1 and "corrupt or incomplete checkpoint" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "TensorStore" not in r.stderr and len(r.stderr.splitlines()) < 10


def test_version_and_doctor(capsys):
    import jsteer
    from jsteer.core_cli import doctor_report

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"jsteer {jsteer.__version__}"
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info == json.loads(json.dumps(doctor_report()))
    assert info["jax_backend"] == "cpu" and len(info["devices"]) == 8  # conftest forces 8 host devices
    assert info["packages"]["jax"] and info["packages"]["flax"] and "minilm" in info["embedded_models"]
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "JAX backend: cpu" in text and "CPU decode kernel:" in text and "cache hf_hub:" in text
    from jsteer.backbones import cpu

    rows = "any row count" if cpu.kernel_rows() is None else f"up to {cpu.kernel_rows()} rows"
    assert f"CPU decode kernel: available, products of {rows}" in text  # every machine this suite runs on
    assert f"CPU: {info['cpu']['model']} ({info['cpu']['family']}), {info['cpu']['cores']} cores; " in text


def test_quiet_is_taken_before_or_after_the_command(monkeypatch):
    """`jsteer --quiet kala train ...` and `jsteer kala train ... --quiet` both silence the bars
    while the command runs; without it they stay on (and the setting is restored after)."""
    from jsteer import cli, progress

    monkeypatch.delenv("JSTEER_QUIET", raising=False)
    seen = []
    parser = cli.build_parser()
    for argv in (["--quiet", "doctor"], ["doctor", "--quiet"], ["doctor"]):
        args = parser.parse_args(argv)
        assert args.quiet == (argv != ["doctor"]), argv
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for argv in (["doctor", "--quiet"], ["doctor"]):
        monkeypatch.setattr(
            parser._subparsers._group_actions[0].choices["doctor"],
            "_defaults",
            {"func": lambda a: seen.append(progress.is_quiet())},
        )
        assert main(argv) == 0
    assert seen == [True, False] and not progress.is_quiet()
    for group, cmd in (("kala", "train"), ("steer", "train"), ("typevec", "probe"), ("actsteer", "train")):
        sub = parser._subparsers._group_actions[0].choices[group]
        assert "--quiet" in sub._subparsers._group_actions[0].choices[cmd]._option_string_actions, (group, cmd)


def test_help_examples_parse_and_help_shows_no_markup():
    """`jsteer --help`'s example lines are commands the parser takes; no method group's help shows
    reST markup (double backquotes, :func: roles) or a line run together by a docstring's backslash."""
    import shlex

    from jsteer import cli

    parser = cli.build_parser()
    examples = [line.split("  ")[1] for line in cli.DESCRIPTION.splitlines() if line.startswith("  jsteer ")]
    assert len(examples) == 5
    for line in examples:
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command == shlex.split(line)[1], line
    groups = parser._subparsers._group_actions[0].choices
    for name in cli.METHOD_GROUPS:
        text = groups[name].format_help()
        assert "``" not in text and ":func:" not in text and ":mod:" not in text, name
        assert not any("         --" in line.strip() for line in text.splitlines()), name
