"""jsteer.tokenizer: tokenizer.json / vocab.txt sources, special ids, padding, serialisation."""

import json
import pathlib

import numpy as np
import pytest

from jsteer.io import embedded_path
from jsteer.tokenizer import Tokenizer

TEXTS = [
    "Hello World, café!",
    "The [MASK] of Paris is  beautiful.\tÜber naïve 東京 unaffable",
    "",
    "a",
]


@pytest.fixture(scope="module")
def minilm_dir() -> pathlib.Path:
    return embedded_path("minilm")


@pytest.fixture(scope="module")
def hf_minilm(minilm_dir):
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(str(minilm_dir))


def test_tokenizer_json_matches_transformers(minilm_dir, hf_minilm):
    tok = Tokenizer.from_dir(minilm_dir)
    for t in TEXTS:
        assert tok.encode(t) == hf_minilm(t)["input_ids"], t
        assert tok.encode(t, add_special_tokens=False) == hf_minilm(t, add_special_tokens=False)["input_ids"]
    ids = tok.encode(TEXTS[1])
    assert tok.decode(ids) == hf_minilm.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False).startswith("[CLS]")
    # the stored tokenizer.json pads to 128 and truncates; we must not
    assert len(tok.encode("x " * 300)) == 302


def test_vocab_txt_wordpiece_matches_tokenizer_json(minilm_dir, tmp_path):
    ref = Tokenizer.from_dir(minilm_dir)
    wp = Tokenizer.from_vocab_txt(minilm_dir / "vocab.txt")  # reads do_lower_case from tokenizer_config.json
    for t in TEXTS:
        assert wp.encode(t) == ref.encode(t), t
    assert wp.special_ids == ref.special_ids
    assert wp.encode("[MASK]", add_special_tokens=False) == [ref.mask_id]

    # a folder with only vocab.txt and a cased config keeps case (ids differ from the uncased ones)
    (tmp_path / "vocab.txt").write_text((minilm_dir / "vocab.txt").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    cased = Tokenizer.from_dir(tmp_path)
    assert cased.encode("hello", add_special_tokens=False) == ref.encode("hello", add_special_tokens=False)
    assert cased.encode("Hello", add_special_tokens=False) != ref.encode("Hello", add_special_tokens=False)


def test_special_ids(minilm_dir):
    tok = Tokenizer.from_dir(minilm_dir)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.bos_id is None and tok.eos_id is None
    assert tok.token_to_id("[MASK]") == 103 and tok.id_to_token(101) == "[CLS]"
    assert tok.vocab_size == 30522
    # explicit ids win over config / guesses
    tok2 = Tokenizer(tok.backend, {"eos": 102})
    assert tok2.eos_id == 102 and tok2.stop_ids == (102,)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(tok.backend, {"eos": 10**6})
    with pytest.raises(ValueError, match="unknown special-token roles"):
        Tokenizer(tok.backend, {"beginning": 1})


def test_special_ids_from_config_files(tmp_path):
    """tokenizer_config.json token names and config.json *_token_id are honoured."""
    from tokenizers import Tokenizer as RustTok
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 3, "hi": 4, "there": 5}
    rt = RustTok(models.WordLevel(vocab, unk_token="<unk>"))
    rt.pre_tokenizer = pre_tokenizers.Whitespace()
    rt.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    rt.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"pad_token_id": 3}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 3, 0)
    assert tok.stop_ids == (2, 3)  # eos first, then the other end-of-text special
    assert tok.encode("hi there") == [4, 5]
    # HF's default GPT-2 ids (50256) in config.json beside a small vocabulary: ignored, said (HF's
    # tokenizer never reads config.json); the roles come from the tokenizer's tokens
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 50256, "eos_token_id": 50256}))
    with pytest.warns(UserWarning) as caught:
        tok = Tokenizer.from_dir(tmp_path)
    assert [str(w.message).split(";")[0] for w in caught] == [
        f"config.json {r}_token_id 50256 is outside the tokenizer's vocabulary (size 6)" for r in ("bos", "eos")
    ]
    assert tok.eos_id == 3 and tok.bos_id is None  # <|endoftext|> guessed, as HF's GPT2Tokenizer names it


def test_batch_encode_padding(minilm_dir):
    tok = Tokenizer.from_dir(minilm_dir)
    texts = ["hello world", "a much longer sentence than the first one", "x"]
    encs = [tok.encode(t) for t in texts]
    T = max(map(len, encs))
    for left in (False, True):
        ids, mask = tok.batch_encode(texts, left_pad=left)
        assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == (3, T)
        for b, e in enumerate(encs):
            n = len(e)
            real = ids[b, T - n :] if left else ids[b, :n]
            pads = ids[b, : T - n] if left else ids[b, n:]
            assert real.tolist() == e
            assert (pads == tok.pad_id).all()
            assert mask[b].sum() == n
            assert (mask[b, T - n :] == 1).all() if left else (mask[b, :n] == 1).all()
    # truncation keeps the start (right padding) or the end (left padding)
    ids, mask = tok.batch_encode(texts, max_len=4)
    assert ids.shape == (3, 4) and ids[1].tolist() == encs[1][:4]
    ids, mask = tok.batch_encode(texts, max_len=4, left_pad=True)
    assert ids[1].tolist() == encs[1][-4:]
    ids, _ = tok.batch_encode(texts, pad_to=32)
    assert ids.shape == (3, 32)
    with pytest.raises(ValueError, match="at least one"):
        tok.batch_encode([])
    with pytest.raises(TypeError, match="single str"):
        tok.batch_encode("hello")


def test_json_round_trip(minilm_dir):
    tok = Tokenizer.from_dir(minilm_dir)
    s = tok.to_json()
    tok2 = Tokenizer.from_json(s)
    assert tok2.special_ids == tok.special_ids
    for t in TEXTS:
        assert tok2.encode(t) == tok.encode(t)
    # a plain tokenizers JSON (no jsteer wrapper) also loads, specials guessed from the vocab
    plain = Tokenizer.from_json((minilm_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert plain.special_ids == tok.special_ids
    with pytest.raises(ValueError, match="cannot parse tokenizer JSON"):
        Tokenizer.from_json(json.dumps({"model": {"type": "Nope"}}))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="tokenizer.json, vocab.txt and vocab.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="vocab.txt"):
        Tokenizer.from_vocab_txt(tmp_path / "vocab.txt")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(bad)
    v = tmp_path / "v" / "vocab.txt"
    v.parent.mkdir()
    v.write_text("[PAD]\n[UNK]\nhello\nhello\n")
    with pytest.raises(ValueError, match=r"vocab.txt:4: duplicate token 'hello'"):
        Tokenizer.from_vocab_txt(v)


def test_byte_level_bpe_from_vocab_json_and_merges(tmp_path):
    """A GPT-2-style folder without tokenizer.json: vocab.json + merges.txt, checked against
    transformers' GPT2Tokenizer loaded from the same two files."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Tokenizer

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "Hello world! héllo wörld 123",
        "steering language models with linear transforms",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "eos_token_id": 0, "bos_token_id": 0}))
    tok = Tokenizer.from_dir(tmp_path)
    ref = GPT2Tokenizer.from_pretrained(str(tmp_path))
    for t in ["Hello world! héllo", " the lazy fox<|endoftext|>", "unseen wörds 42"]:
        assert tok.encode(t) == ref(t)["input_ids"], t
        assert tok.decode(tok.encode(t), skip_special_tokens=False) == t
    assert tok.eos_id == tok.bos_id == 0 and tok.stop_ids == (0,)
    # RoBERTa folders get <s> ... </s> around the text
    bpe2 = ByteLevelBPETokenizer()
    bpe2.train_from_iterator(corpus, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    rob = tmp_path / "rob"
    rob.mkdir()
    bpe2.save_model(str(rob))
    (rob / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    rt = Tokenizer.from_dir(rob)
    ids = rt.encode("the fox")
    assert ids[0] == rt.cls_id == 0 and ids[-1] == rt.sep_id == 2 and rt.mask_id == 4 and rt.pad_id == 1
    assert rt.decode(ids) == "the fox"
