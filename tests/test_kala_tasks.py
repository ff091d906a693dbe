"""KALA task plumbing: NER / SQuAD metrics on hand-checked cases, SQuAD files and windows."""

import json

import numpy as np
import pytest

from jsteer.kala import metrics, qa
from jsteer.kala.formats import FormatError, Mention


def test_entities_follow_seqeval_default_rules():
    tags = ["B-PER", "I-PER", "O", "I-LOC", "I-LOC", "B-LOC", "I-ORG", "I-ORG", "B-MISC"]
    assert metrics.entities(tags) == [("PER", 0, 2), ("LOC", 3, 5), ("LOC", 5, 6), ("ORG", 6, 8), ("MISC", 8, 9)]
    assert metrics.entities(["B-PER", "I-LOC", "I-LOC", "O"]) == [("PER", 0, 1), ("LOC", 1, 3)]
    assert metrics.entities(["O", "O"]) == []


def test_ner_scores_hand_checked():
    # seqeval's documented example: one of two entities right in each direction -> P = R = F1 = 0.5
    gold = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    pred = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    s = metrics.ner_scores(gold, pred)
    assert (s["precision"], s["recall"], s["f1"]) == (0.5, 0.5, 0.5)
    assert s["per_type"]["PER"]["f1"] == 1.0 and s["per_type"]["MISC"]["f1"] == 0.0
    # 3 gold, 2 predicted, 1 right: P = 1/2, R = 1/3, F1 = 2PR/(P+R) = 0.4
    gold = [["B-LOC", "O", "B-ORG", "I-ORG"], ["B-PER"]]
    pred = [["B-LOC", "O", "B-ORG", "O"], ["O"]]
    s = metrics.ner_scores(gold, pred)
    assert s["precision"] == pytest.approx(0.5) and s["recall"] == pytest.approx(1 / 3)
    assert s["f1"] == pytest.approx(0.4)
    # the same entity split across sentences is two entities
    assert metrics.ner_scores([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]])["n_gold"] == 2
    with pytest.raises(ValueError, match="sentence 0"):
        metrics.ner_scores([["O"]], [["O", "O"]])


def test_ner_report_scores_subsets_in_percent():
    gold = [["B-LOC", "O", "B-ORG", "I-ORG"], ["B-PER"], ["B-PER", "O"]]
    pred = [["B-LOC", "O", "B-ORG", "O"], ["O"], ["B-PER", "O"]]
    r = metrics.ner_report(gold, pred, {"seen": [0, 2], "unseen": [1], "empty": []})
    # overall: 4 gold, 3 predicted, 2 right -> P 2/3, R 1/2, F1 4/7
    assert r["precision"] == pytest.approx(200 / 3) and r["recall"] == pytest.approx(50.0)
    assert r["f1"] == pytest.approx(400 / 7) and r["n_sentences"] == 3
    # seen: 3 gold, 3 predicted, 2 right -> F1 2/3; unseen: nothing right -> 0; an empty subset has no F1
    assert r["f1_seen"] == pytest.approx(200 / 3) and r["f1_unseen"] == 0.0
    assert (r["n_seen"], r["n_unseen"], r["n_empty"]) == (2, 1, 0) and "f1_empty" not in r


def test_squad_metrics_hand_checked():
    assert metrics.normalize_answer("The  Cat, sat!") == "cat sat"
    assert metrics.exact_match("the Eiffel Tower", "Eiffel tower.") == 1.0
    assert metrics.token_f1("the big cat", "a cat") == pytest.approx(2 / 3)  # P 1/2, R 1
    assert metrics.token_f1("dog", "cat") == 0.0
    s = metrics.squad_scores({"q1": "Paris", "q2": "in London"}, {"q1": ["paris"], "q2": ["London", "UK"], "q3": ["x"]})
    assert s["exact_match"] == pytest.approx(100 / 3)
    assert s["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)


def _word_tokenizer(words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted(set(words)))}
    tk = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = WhitespaceSplit()
    return tk


def test_squad_file_windows_and_answers(tmp_path):
    words = [f"w{i}" for i in range(10)] + ["Paris", "is", "big"] + [f"w{i}" for i in range(10, 20)]
    ctx = " ".join(words)
    start = ctx.index("Paris")
    ex = qa.QAExample("q1", "where now ?", ctx, (("Paris", start),))
    path = tmp_path / "s.json"
    qa.write_squad(path, [ex])
    assert qa.read_squad(path) == [ex]
    tok = _word_tokenizer(ctx.split() + ["where", "now", "?"])
    mentions = [Mention("Paris", start, start + 5, "paris")]
    feats = qa.encode_qa(ex, tok, mentions, max_len=14, stride=4)
    # question 3 tokens + 3 specials -> 8 context tokens per window; 23 context tokens ->
    # windows start at 0, 4, 8, 12, 16 (the last one reaches the end)
    assert len(feats) == 5
    n_q = 5
    char_start = np.cumsum([0] + [len(w) + 1 for w in words])
    for f, s0 in zip(feats, (0, 4, 8, 12, 16)):
        assert f["input_ids"][0] == 2 and f["input_ids"][n_q - 1] == 3 and f["input_ids"][-1] == 3
        assert f["offsets"][n_q, 0] == char_start[s0] and f["token_type_ids"][n_q] == 1
    assert len(feats[-1]["input_ids"]) == n_q + 7 + 1
    inside = [f for f in feats if f["start_positions"] > 0]
    assert len(inside) == 2  # windows [4, 12) and [8, 16) hold "Paris" (context token 10)
    for f in inside:
        sp = int(f["start_positions"])
        assert f["start_positions"] == f["end_positions"]
        assert tuple(f["offsets"][sp]) == (start, start + 5)
        assert f["token_node"][sp] == 0 and (f["token_node"] >= 0).sum() == 1
    # best span over windows -> the answer text
    logits = []
    for f in feats:
        lg = np.zeros((len(f["input_ids"]), 2))
        if f["start_positions"] > 0:
            lg[int(f["start_positions"])] = 5.0
        logits.append(lg)
    assert qa.predict_answers(feats, logits, {"q1": ctx}) == {"q1": "Paris"}


def test_squad_errors_name_the_field(tmp_path):
    bad = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": "abc def",
                        "qas": [{"id": "q", "question": "?", "answers": [{"text": "def", "answer_start": 2}]}],
                    }
                ]
            }
        ]
    }
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(FormatError, match=r"data\[0\].paragraphs\[0\].qas\[0\].answers\[0\].answer_start"):
        qa.read_squad(path)
    bad["data"][0]["paragraphs"][0]["qas"][0]["answers"][0] = {"text": "def"}
    path.write_text(json.dumps(bad))
    with pytest.raises(FormatError, match=r"answers\[0\].answer_start': missing"):
        qa.read_squad(path)


def test_qa_training_on_generated_squad_file(tmp_path):
    """A tiny relational-KALA QA model learns a generated SQuAD-format set through the whole
    pipeline: file -> windows (stride) -> Trainer -> best span over windows -> EM / F1."""
    import jax

    from jsteer.backbones.bert import BertConfig
    from jsteer.kala import entities
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig, KalaModel, init_params

    rng = np.random.default_rng(0)
    fillers = [f"w{i}" for i in range(20)]
    ents = [f"ent{i}" for i in range(10)]
    examples, mentions = [], {}
    for i in range(96):
        words = list(rng.choice(fillers, size=18))
        pos = int(rng.integers(0, 18))
        words[pos] = str(rng.choice(ents))
        ctx = " ".join(words)
        start = len(" ".join(words[:pos])) + (1 if pos else 0)
        examples.append(qa.QAExample(f"q{i}", "which entity ?", ctx, ((words[pos], start),)))
        mentions[f"q{i}"] = [Mention(words[pos], start, start + len(words[pos]), words[pos])]
    path = tmp_path / "squad.json"
    qa.write_squad(path, examples)
    examples = qa.read_squad(path)
    tok = _word_tokenizer(fillers + ents + ["which", "entity", "?"])
    train_ex, test_ex = examples[:64], examples[64:]
    vocab = entities.EntityVocab.from_mentions([mentions[e.qid] for e in train_ex])
    rels = entities.RelationVocab()
    kg = entities.KnowledgeGraph([], rels)

    def feats(exs):
        return [f for e in exs for f in qa.encode_qa(e, tok, mentions[e.qid], vocab, kg, max_len=16, stride=6)]

    train_f, test_f = feats(train_ex), feats(test_ex)
    assert len(test_f) > len(test_ex)  # long contexts were split into windows
    bert = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = KalaModel(
        bert,
        KalaConfig(method="relational", num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
        task="qa",
    )
    params = init_params(model, jax.random.PRNGKey(0))
    before = ktrain.evaluate_qa(model, params, test_f, test_ex, batch_size=32)
    fit = ktrain.fit(
        model, params, train_f, ktrain.TrainConfig(lr=2e-3, kala_lr=2e-3, batch_size=32, epochs=15), task="qa"
    )
    after = ktrain.evaluate_qa(model, fit.params, test_f, test_ex, batch_size=32)
    assert after["exact_match"] >= 80.0 and after["exact_match"] >= before["exact_match"] + 50.0, (before, after)
    assert after["f1"] >= after["exact_match"]


@pytest.mark.parametrize("pred,gold", [("a", "the"), ("the", "a"), ("", ""), ("", "Paris"), ("Paris", ".")])
def test_token_f1_is_zero_without_a_shared_token_as_in_squad_v11(pred, gold):
    # The official v1.1 script's f1_score: num_same == 0 -> 0, also when a side normalises to nothing.
    def v11_f1(prediction, ground_truth):
        p, g = metrics.normalize_answer(prediction).split(), metrics.normalize_answer(ground_truth).split()
        same = sum((__import__("collections").Counter(p) & __import__("collections").Counter(g)).values())
        return 0.0 if same == 0 else 2 * (same / len(p)) * (same / len(g)) / (same / len(p) + same / len(g))

    assert metrics.token_f1(pred, gold) == v11_f1(pred, gold) == 0.0
    assert metrics.squad_scores({"q": pred}, {"q": [gold]})["f1"] == 0.0


def test_qa_stride_must_be_positive():
    ctx = " ".join(f"w{i}" for i in range(30))
    ex = qa.QAExample("q1", "where ?", ctx, ())
    tok = _word_tokenizer(ctx.split() + ["where", "?"])
    import signal

    def hung(*_):
        raise TimeoutError("encode_qa did not return (a stride of 0 or less used to loop forever)")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        for bad in (0, -3):
            with pytest.raises(ValueError, match="stride must be an integer >= 1"):
                qa.encode_qa(ex, tok, max_len=12, stride=bad)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("stride", [1, 3, 7, 8, 9, 40])
def test_qa_windows_cover_every_context_token(stride):
    words = [f"w{i}" for i in range(30)]
    ctx = " ".join(words)
    ans = ctx.index("w20")
    ex = qa.QAExample("q1", "where ?", ctx, (("w20", ans),))
    tok = _word_tokenizer(words + ["where", "?"])
    feats = qa.encode_qa(ex, tok, max_len=12, stride=stride)  # room: 12 - 2 - 3 = 7 context tokens
    starts = set()
    for f in feats:
        off = f["offsets"]
        starts |= {int(s) for s in off[off[:, 0] >= 0, 0]}
    char_start = {ctx.index(w + " ") if i < 29 else ctx.rindex(w) for i, w in enumerate(words)}
    assert starts == char_start  # every context token is in some window
    assert any(f["start_positions"] > 0 for f in feats)  # so is the answer
    assert len(feats) == 1 + -(-(30 - 7) // min(stride, 7))
