"""KALA on a RoBERTa checkpoint (byte-level BPE): NER words and QA pairs encoded as HF's tokenizer
encodes them, padding with ``<pad>``, the encoder's hidden states equal to HF's on those batches,
and `jsteer kala build-graph / train / eval` end to end for NER and QA."""

import json

import numpy as np
import pytest

from jsteer.cli import main as jsteer_main

CORPUS = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn lives in London and works for Reuters .",
    "Anna visited Paris today . Tom visited London today . Rita visited Berlin today .",
    "Today Anna visited Paris and met Tom in London .",
    "who visited paris ? where did anna meet tom ?",
    "The U.S. ( 1996-08-22 ) said Germany 's economy grew 3.5 % .",
] * 10
SENTENCE = "EU rejects German call to boycott British lamb in the U.S. ( 1996-08-22 ) 's Ünïcode .".split()


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    """A tiny random RobertaForMaskedLM with a byte-level BPE tokenizer, as save_pretrained writes them."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizerFast

    root = tmp_path_factory.mktemp("roberta")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS, vocab_size=400, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    )
    bpe.save_model(str(root))
    tok = RobertaTokenizerFast(vocab=str(root / "vocab.json"), merges=str(root / "merges.txt"))
    assert len(tok) == bpe.get_vocab_size()
    d = root / "model"
    tok.save_pretrained(d)
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    RobertaForMaskedLM(config).eval().save_pretrained(d)
    return d


def _hf_tokenizer(d, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d, **kw)


def _jsteer_tokenizer(d):
    from jsteer.tokenizer import Tokenizer

    return Tokenizer.from_dir(d)


def _encode_sentence(words, tok, max_len=64):
    from jsteer.kala import data as kdata
    from jsteer.kala.entities import EntityVocab

    return kdata.encode_ner(words, ["O"] * len(words), [], tok, ["O"], EntityVocab([]), max_len=max_len)


def test_ner_words_are_encoded_as_hf_roberta_token_classification(roberta_dir):
    """HF's run_ner loads RoBERTa's tokenizer with add_prefix_space=True and encodes the CoNLL words
    with is_split_into_words=True: every word, the first included, in its with-space form (Ġword),
    framed <s> ... </s>; the first piece of a word carries its label."""
    tok = _jsteer_tokenizer(roberta_dir)
    hf = _hf_tokenizer(roberta_dir, add_prefix_space=True)(SENTENCE, is_split_into_words=True)
    enc = _encode_sentence(SENTENCE, tok)
    assert enc["input_ids"].tolist() == hf["input_ids"]
    assert enc["word_index"].tolist() == [-1 if w is None else w for w in hf.word_ids()]
    first = [j for j, w in enumerate(hf.word_ids()) if w is not None and (j == 0 or hf.word_ids()[j - 1] != w)]
    assert np.flatnonzero(enc["labels"] != -100).tolist() == first
    assert enc["pad_id"] == tok.pad_id == 1
    # truncation keeps </s> last
    short = _encode_sentence(SENTENCE, tok, max_len=6)
    assert short["input_ids"].tolist() == hf["input_ids"][:5] + [tok.sep_id]


def test_qa_pair_is_encoded_as_hf_tokenizer_question_context(roberta_dir):
    """One window = HF's tokenizer(question, context): <s> q </s></s> c </s>, token types all 0
    (RoBERTa's type_vocab_size is 1); the answer's tokens are labelled; windows of a long context
    keep that framing."""
    from jsteer.kala import qa

    tok = _jsteer_tokenizer(roberta_dir)
    hf = _hf_tokenizer(roberta_dir)
    question, context = "who visited paris ?", "Today Anna visited Paris and met Tom in London ."
    ex = qa.QAExample("q", question, context, (("Anna", context.index("Anna")),))
    (f,) = qa.encode_qa(ex, tok, max_len=64)
    ref = hf(question, context)
    assert f["input_ids"].tolist() == ref["input_ids"]
    assert f["token_type_ids"].tolist() == [0] * len(ref["input_ids"])
    assert (int(f["start_positions"]), int(f["end_positions"])) == (ref.char_to_token(0, context.index("Anna"), 1),) * 2
    s, e = f["offsets"][f["start_positions"]]
    assert context[s:e] == "Anna"
    q_ids = hf(question, add_special_tokens=False)["input_ids"]
    feats = qa.encode_qa(ex, tok, max_len=len(q_ids) + 4 + 3, stride=2)  # 4 specials, 3 context tokens a window
    assert len(feats) > 2
    for g in feats:
        ids = g["input_ids"].tolist()
        assert ids[: len(q_ids) + 3] == [tok.cls_id, *q_ids, tok.sep_id, tok.sep_id] and ids[-1] == tok.sep_id
        assert len(ids) <= len(q_ids) + 7 and not g["token_type_ids"].any()


def test_padding_uses_pad_id_and_hidden_states_match_hf(roberta_dir):
    """Batches pad input_ids with <pad> (1; 0 is <s>, and RoBERTa's position ids count the tokens
    that are not <pad>); the jsteer encoder on a padded NER batch and a QA batch gives HF
    RobertaModel's hidden states on HF's own padded encodings."""
    import torch
    from transformers import RobertaModel

    import jsteer
    from jsteer.backbones.bert import BertEncoder
    from jsteer.kala import data as kdata
    from jsteer.kala import qa

    lm = jsteer.load(str(roberta_dir))
    assert lm.config.layout == "roberta" and lm.config.pad_token_id == 1
    tok = lm.tokenizer
    sents = [SENTENCE, "Anna visited Paris today .".split()]
    batch = kdata.collate([_encode_sentence(w, tok) for w in sents], 3)
    hf_tok = _hf_tokenizer(roberta_dir, add_prefix_space=True)
    ref = hf_tok(sents, is_split_into_words=True, padding=True, return_tensors="pt")
    t = ref["input_ids"].shape[1]
    assert (batch["input_ids"][:2, :t] == ref["input_ids"].numpy()).all()
    assert (batch["input_ids"][:, t:] == 1).all() and (batch["input_ids"][2] == 1).all()
    assert (batch["attention_mask"][:2, :t] == ref["attention_mask"].numpy()).all()

    ctx = "Today Anna visited Paris and met Tom in London ."
    questions = ["who visited paris ?", "where did anna meet tom ?"]
    feats = [
        f for i, q in enumerate(questions) for f in qa.encode_qa(qa.QAExample(str(i), q, ctx, ()), tok, max_len=64)
    ]
    qbatch = kdata.collate(feats, 2, keys=("input_ids", "token_type_ids"))
    qref = _hf_tokenizer(roberta_dir)(questions, [ctx] * 2, padding=True, return_tensors="pt")
    tq = qref["input_ids"].shape[1]
    assert (qbatch["input_ids"][:, :tq] == qref["input_ids"].numpy()).all() and (qbatch["input_ids"][:, tq:] == 1).all()
    assert not qbatch["token_type_ids"].any()

    model = RobertaModel.from_pretrained(roberta_dir).eval()
    enc = BertEncoder(lm.config)
    for b, r, n in ((batch, ref, t), (qbatch, qref, tq)):
        ours = np.asarray(
            enc.apply({"params": lm.params["encoder"]}, b["input_ids"], b["attention_mask"], b.get("token_type_ids"))[0]
        )
        with torch.no_grad():
            theirs = model(input_ids=r["input_ids"], attention_mask=r["attention_mask"]).last_hidden_state.numpy()
        real = r["attention_mask"].numpy().astype(bool)
        np.testing.assert_allclose(ours[: len(real), :n][real], theirs[real], atol=2e-5)


def _conll(path, sents):
    path.write_text("".join("".join(f"{w} {t}\n" for w, t in s) + "\n" for s in sents))
    return path


def _squad(path, n, seed=0):
    from jsteer.kala import qa

    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    examples = []
    for i in range(n):
        p, r, q = people[(i + seed) % 3], people[(i + seed + 1) % 3], places[(i // 3) % 3]
        ctx = f"Today {p} visited {q} and met {r} in London ."
        examples.append(qa.QAExample(f"s{seed}q{i}", f"who visited {q.lower()} ?", ctx, ((p, ctx.index(p)),)))
    qa.write_squad(path, examples)
    return path


def _last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def test_cli_ner_and_qa_train_eval_on_roberta(tmp_path, roberta_dir, capsys):
    """`jsteer kala build-graph / train / eval` with --model a RoBERTa folder, NER and QA: exit 0,
    and eval of the saved model reproduces the scores train printed."""
    people, places = ["Anna", "Tom", "Rita"], ["Paris", "London", "Berlin"]
    sents = [
        [(people[i % 3], "B-PER"), ("visited", "O"), (places[(i // 3) % 3], "B-LOC"), ("today", "O"), (".", "O")]
        for i in range(12)
    ]
    runs = {}
    for task, train, test, extra in (
        (
            "ner",
            _conll(tmp_path / "train.conll", sents),
            _conll(tmp_path / "test.conll", sents[:4]),
            ["--scheme", "iob2", "--max-len", "32"],
        ),
        (
            "qa",
            _squad(tmp_path / "train.json", 8),
            _squad(tmp_path / "test.json", 4, seed=1),
            ["--max-len", "24", "--stride", "4"],
        ),
    ):
        gdir, out = tmp_path / f"graph_{task}", tmp_path / f"run_{task}"
        assert jsteer_main(["kala", "build-graph", str(train), str(test), "--out", str(gdir)]) == 0
        assert (
            jsteer_main(
                [
                    "kala",
                    "train",
                    "--train",
                    str(train),
                    "--test",
                    str(test),
                    "--graph",
                    str(gdir),
                    "--out",
                    str(out),
                    "--model",
                    str(roberta_dir),
                    "--max-steps",
                    "2",
                    "--batch-size",
                    "4",
                    *extra,
                ]
            )
            == 0
        ), capsys.readouterr().err
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["steps"] == 2 and np.isfinite(metrics["final_loss"])
        capsys.readouterr()
        assert jsteer_main(["kala", "eval", "--run", str(out), "--test", str(test)]) == 0
        runs[task] = (metrics["test"], _last_json(capsys.readouterr().out))
    (ner_train, ner_eval), (qa_train, qa_eval) = runs["ner"], runs["qa"]
    assert ner_eval["f1"] == pytest.approx(ner_train["f1"])
    assert (qa_eval["exact_match"], qa_eval["f1"]) == pytest.approx((qa_train["exact_match"], qa_train["f1"]))
