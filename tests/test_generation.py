"""Generation as HF users expect it (jsteer.generation behind LM.generate / LM.stream): chat
conversations, num_return_sequences, do_sample, repetition_penalty, min_new_tokens, stop strings,
streaming, ids on request; against HF generate on the same tiny checkpoint, and the CLI flags."""

import json

import numpy as np
import pytest
import torch
from test_io import make_tiny_decoder

import jsteer
from jsteer.cli import main

PROMPTS = ["w1 w5 w9", "w2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen_llama")
    hf = make_tiny_decoder(path, "llama")
    template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return path, hf, jsteer.load(path)


def _hf(hf, lm, prompts, **kw):
    tok = lm.tokenizer
    ids, mask = tok.batch_encode(prompts, left_pad=True)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(), pad_token_id=1, eos_token_id=None, **kw
        )
    return [tok.decode(row[ids.shape[1] :].tolist()) for row in out.numpy()]


def test_repetition_penalty_min_new_tokens_and_do_sample_match_hf(tiny):
    _, hf, lm = tiny
    want = _hf(hf, lm, PROMPTS, max_new_tokens=10, do_sample=False, repetition_penalty=1.5)
    got = lm.generate(PROMPTS, max_new_tokens=10, repetition_penalty=1.5, stop_ids=[])
    assert [g.strip() for g in got] == [w.strip() for w in want]
    assert lm.generate(PROMPTS, max_new_tokens=6, do_sample=False, temperature=0.9) == lm.generate(
        PROMPTS, max_new_tokens=6
    )
    assert lm.generate(PROMPTS, max_new_tokens=6, do_sample=True, seed=4) == lm.generate(
        PROMPTS, max_new_tokens=6, temperature=1.0, seed=4
    )
    _, plain, _ = lm.generate(PROMPTS, max_new_tokens=8, return_ids=True, stop_ids=[])
    first = int(plain[0, 0])  # greedy's first token, made a stop id
    _, _, lengths = lm.generate(PROMPTS, max_new_tokens=8, stop_ids=[first], return_ids=True)
    assert lengths[0] == 1
    _, tokens, lengths = lm.generate(PROMPTS, max_new_tokens=8, stop_ids=[first], min_new_tokens=5, return_ids=True)
    assert lengths[0] >= 5 and first not in tokens[0, :4].tolist() and tokens.shape == (2, 8)


def test_num_return_sequences_are_prompt_major_and_independent(tiny):
    _, _, lm = tiny
    greedy = lm.generate(PROMPTS, max_new_tokens=6, num_return_sequences=3)
    assert greedy == [t for t in lm.generate(PROMPTS, max_new_tokens=6) for _ in range(3)]
    sampled = lm.generate(PROMPTS, max_new_tokens=8, num_return_sequences=4, temperature=1.5, seed=1)
    assert len(sampled) == 8 and len(set(sampled[:4])) > 1  # four different samples of the first prompt
    with pytest.raises(ValueError, match="num_return_sequences"):
        lm.generate(PROMPTS, num_return_sequences=0)


def test_stop_strings_cut_the_text_and_stop_the_row(tiny):
    _, _, lm = tiny
    full, tokens, lengths = lm.generate(PROMPTS, max_new_tokens=16, return_ids=True, stop_ids=[])
    words = full[0].split()
    stop = " " + words[2]  # the third generated word of row 0
    texts, _, cut_lengths = lm.generate(PROMPTS, max_new_tokens=16, stop=[stop], return_ids=True, stop_ids=[])
    assert texts[0] == full[0][: full[0].index(stop) + len(stop)] and texts[0].endswith(stop)
    assert cut_lengths[0] < lengths[0]  # the row stopped early
    assert texts[1] == (full[1] if stop not in full[1] else full[1][: full[1].index(stop) + len(stop)])


def test_stream_pieces_join_to_generate(tiny):
    _, _, lm = tiny
    want = lm.generate(PROMPTS, max_new_tokens=12, temperature=0.8, seed=2)
    pieces = list(lm.stream(PROMPTS, max_new_tokens=12, temperature=0.8, seed=2, chunk=3))
    assert len(pieces) >= 3
    assert ["".join(p[b] for p in pieces) for b in range(2)] == want


def test_chat_conversations_use_the_template(tiny):
    _, _, lm = tiny
    chat = [[{"role": "user", "content": "w1 w5"}], [{"role": "user", "content": "w7"}]]
    rendered = [lm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chat]
    assert rendered[0] == "<s>user: w1 w5</s><s>assistant:"
    ids, _ = lm.tokenizer.batch_encode(rendered, left_pad=True, add_special_tokens=False)
    texts, tokens, _ = lm.generate(chat, max_new_tokens=5, return_ids=True, stop_ids=[])
    from jsteer import decode

    ref = decode.generate(lm.module, lm.params, ids, (ids != lm._pad_value()).astype(np.int32), max_new_tokens=5)
    np.testing.assert_array_equal(tokens, np.asarray(ref.tokens))
    with pytest.raises(ValueError, match="mix of plain prompts and chat"):
        lm.generate(["w1", chat[0]])


def test_cli_generate_flags(tiny, capsys):
    path, _, lm = tiny
    assert (
        main(
            [
                "generate",
                str(path),
                *PROMPTS,
                "--max-new-tokens",
                "6",
                "--num-return-sequences",
                "2",
                "--repetition-penalty",
                "1.3",
                "--ids",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    want = lm.generate(PROMPTS, max_new_tokens=6, num_return_sequences=2, repetition_penalty=1.3)
    for text in want:
        assert text in out
    assert "ids:" in out
    assert main(["generate", str(path), "--chat", "w1 w5", "--max-new-tokens", "4", "--stream"]) == 0
    assert lm.generate([[{"role": "user", "content": "w1 w5"}]], max_new_tokens=4)[0] in capsys.readouterr().out
