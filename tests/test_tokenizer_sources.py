"""What a folder's tokenizer-side files give a loaded model: no tokenizer (ids only), a chat
template rendered as transformers renders it, and generation_config.json's eos ids as stop ids."""

import json
import shutil

import jinja2
import numpy as np
import pytest
import transformers
from test_io import leaves_equal, make_tiny_decoder

import jsteer
from jsteer.cli import main as jsteer_main
from jsteer.tokenizer import Tokenizer

TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role: ' + message.role) }}
    {%- endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'system' %}
[sys] {{ message.content }}<|im_end|>
    {% else %}
{{ message.content | trim }}<|im_end|>
    {% endif %}
{% endfor %}
{% if tools %}
<tools>{{ tools | tojson }}</tools>
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You are w1."},
    {"role": "user", "content": "  w2 <b>héllo</b> & w3  "},
    {"role": "assistant", "content": "w4", "tool_calls": None},
    {"role": "user", "content": "w5?"},
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_tiny_decoder(path, "llama")


# ----------------------------------------------------------------------------- no tokenizer


def test_folder_without_tokenizer_loads_for_ids(tiny_llama, tmp_path, capsys):
    path, _ = tiny_llama
    bare = shutil.copytree(path, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match=r"no tokenizer files.*lm\.tokenizer is None"):
        lm = jsteer.load(bare)
    assert lm.tokenizer is None
    full = jsteer.load(path)
    ids = np.array([[5, 9, 2, 33], [1, 1, 7, 8]], np.int32)
    mask = np.array([[1, 1, 1, 1], [0, 0, 1, 1]], np.int32)
    np.testing.assert_array_equal(np.asarray(lm.forward(ids, mask).logits), np.asarray(full.forward(ids, mask).logits))
    assert lm._pad_value() == full._pad_value() == 1  # config.json's pad_token_id
    with pytest.raises(ValueError, match=r"generate: this model has no tokenizer.*forward\(\)"):
        lm.generate(["w1 w2"])
    with pytest.raises(ValueError, match="encode_batch: this model has no tokenizer"):
        lm.encode_batch(["w1"])

    jsteer.save(lm, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck")
    assert back.tokenizer is None and back.identity == lm.identity and leaves_equal(back.params, lm.params)
    assert json.loads((tmp_path / "ck" / "jsteer.json").read_text())["tokenizer"] is None
    for src in (tmp_path / "ck", bare):
        assert jsteer_main(["info", str(src)]) == 0
        assert "no tokenizer files" in capsys.readouterr().out


# ----------------------------------------------------------------------------- chat templates


def _hf_tokenizer_folder(tiny_llama, dst, jinja_file: bool):
    """The tiny folder's tokenizer saved by transformers with TEMPLATE (transformers 5 writes
    chat_template.jinja; with save_jinja_files=False the template goes into tokenizer_config.json)."""
    path, _ = tiny_llama
    shutil.copytree(path, dst)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dst, save_jinja_files=jinja_file)
    assert (dst / "chat_template.jinja").is_file() == jinja_file
    assert ("chat_template" in json.loads((dst / "tokenizer_config.json").read_text())) != jinja_file
    return dst


@pytest.mark.parametrize("jinja_file", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(tiny_llama, tmp_path, jinja_file, generation_prompt):
    folder = _hf_tokenizer_folder(tiny_llama, tmp_path / "chat", jinja_file)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    tools = [{"name": "lookup", "description": "finds <things> — fast"}]
    for kw in ({}, {"tools": tools}):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt, **kw)
        got = Tokenizer.from_dir(folder).apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt, **kw)
        assert got == want
    assert got.startswith("<s><|im_start|>system\n[sys] You are w1.<|im_end|>\n<|im_start|>user\nw2")
    assert "w2 <b>héllo</b> & w3<|im_end|>" in got and "finds <things> — fast" in got
    assert got.endswith("<|im_start|>assistant\n") == generation_prompt


def test_chat_template_reaches_the_model_and_survives_save(tiny_llama, tmp_path):
    folder = _hf_tokenizer_folder(tiny_llama, tmp_path / "chat", jinja_file=True)
    lm = jsteer.load(folder)
    assert lm.tokenizer.chat_template == TEMPLATE
    prompt = lm.tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
    jsteer.save(lm, tmp_path / "ck")
    back = jsteer.load(tmp_path / "ck")
    assert back.tokenizer.chat_template == TEMPLATE
    assert back.tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=True) == prompt
    with pytest.raises(jinja2.TemplateError, match="unknown role: tool"):
        lm.tokenizer.apply_chat_template([{"role": "tool", "content": "w1"}])


def test_no_chat_template_is_a_clear_error(tiny_llama):
    path, _ = tiny_llama
    tok = jsteer.load(path).tokenizer
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


# ----------------------------------------------------------------------------- generation_config.json


def test_generation_config_eos_ids_stop_generate(tiny_llama, tmp_path):
    path, _ = tiny_llama
    lm = jsteer.load(path)
    assert lm.tokenizer.stop_ids == (3, 4)
    prompts = ["w1 w2 w3", "w10", "w5 w6 w7 w8 w9 w11 w12"]
    _, tokens, lengths = lm.generate(prompts, max_new_tokens=12, return_ids=True)
    # a token some row emits after its first step, first there, and before any stop id
    b, k = next(
        (b, k)
        for b in range(len(prompts))
        for k in range(1, int(lengths[b]) - 1)
        if tokens[b, k] not in tokens[b, :k] and tokens[b, k] not in (3, 4)
    )
    extra = int(tokens[b, k])

    folder = shutil.copytree(path, tmp_path / "gen")
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 3  # what save_pretrained wrote from config.json
    gen["eos_token_id"] = [3, extra]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    lm2 = jsteer.load(folder)
    assert lm2.tokenizer.stop_ids == (3, 4, extra)
    _, tokens2, lengths2 = lm2.generate(prompts, max_new_tokens=12, return_ids=True)
    assert int(lengths2[b]) == k + 1 and tokens2[b, : k + 1].tolist() == tokens[b, : k + 1].tolist()
    for r in range(len(prompts)):  # every row stops at its first stop id, extra included
        n = int(lengths2[r])
        assert tokens2[r, n - 1] in (3, 4, extra) or n == 12
        assert not set(tokens2[r, : n - 1].tolist()) & {3, 4, extra}
    assert jsteer.load(folder).tokenizer.to_json() == lm2.tokenizer.to_json()
    jsteer.save(lm2, tmp_path / "ck")
    assert jsteer.load(tmp_path / "ck").tokenizer.stop_ids == (3, 4, extra)

    gen["eos_token_id"] = [3, 999]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.warns(UserWarning, match="eos_token_id 999 is outside"):
        assert jsteer.load(folder).tokenizer.stop_ids == (3, 4)
