"""KALA QA data edge cases: answers with outer whitespace, JSON Lines input, context words at
abbreviation periods, --corpus splitting, graph-wide summary counts after annotate-only runs."""

import json

import numpy as np
import pytest

from jsteer.kala import builder, mining, qa, qa_builder
from jsteer.kala.formats import FormatError

_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "Anna", "visited", "Paris", "in", "1900", ".", "where", "?"]


def _bert_tokenizer(extra=()):
    """A WordPiece tokenizer with BERT's normaliser and pre-tokeniser (which drop control and
    format characters such as the soft hyphen and the zero-width space)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    words = list(dict.fromkeys(_VOCAB + list(extra)))
    tk = Tokenizer(WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.normalizer = BertNormalizer(lowercase=False, strip_accents=False)
    tk.pre_tokenizer = BertPreTokenizer()
    return tk


@pytest.mark.parametrize(
    "before,text,after",
    [
        ("Anna visited", " Paris", " in 1900 ."),  # leading space
        ("Anna visited ", "Paris ", "in 1900 ."),  # trailing space
        ("Anna visited ", "Paris\u00ad", " in 1900 ."),  # trailing soft hyphen (no token)
        ("Anna visited ", "\u200bParis", " in 1900 ."),  # leading zero-width space (no token)
        ("Anna visited ", "Paris", " in 1900 ."),  # plain (labelled before too)
    ],
)
def test_answer_with_outer_whitespace_or_dropped_characters_is_labelled(before, text, after):
    ctx = before + text + after
    ex = qa.QAExample("q", "where ?", ctx, ((text, len(before)),))
    (f,) = qa.encode_qa(ex, _bert_tokenizer(), max_len=32)
    sp, ep = int(f["start_positions"]), int(f["end_positions"])
    n_q = 4  # [CLS] where ? [SEP]
    assert (sp, ep) == (n_q + 2, n_q + 2)  # the token of "Paris", not [CLS]
    assert ctx[f["offsets"][sp, 0] : f["offsets"][ep, 1]] == "Paris"
    lg = np.zeros((len(f["input_ids"]), 2))
    lg[sp, 0] = lg[ep, 1] = 5.0
    assert qa.predict_answers([f], [lg], {"q": ctx}) == {"q": "Paris"}


def test_padded_multi_token_answer_is_labelled_in_the_windows_that_hold_it():
    words = [f"w{i}" for i in range(10)] + ["Anna", "visited", "Paris"] + [f"w{i}" for i in range(10, 20)]
    ctx = " ".join(words)
    start = ctx.index("Anna") - 1
    text = " Anna visited Paris "
    assert ctx[start : start + len(text)] == text
    ex = qa.QAExample("q", "where ?", ctx, ((text, start),))
    feats = qa.encode_qa(ex, _bert_tokenizer(words), max_len=13, stride=4)  # 13 - 2 - 3 = 8 context tokens a window
    # windows start at context tokens 0, 4, 8, 12, 16; the answer is tokens 10..12: only [8, 16) holds it all
    labelled = [
        (k, int(f["start_positions"]), int(f["end_positions"])) for k, f in enumerate(feats) if f["start_positions"] > 0
    ]
    assert [k for k, _, _ in labelled] == [2]
    for k, sp, ep in labelled:
        off = feats[k]["offsets"]
        assert ctx[off[sp, 0] : off[ep, 1]] == "Anna visited Paris"


# --- JSON Lines is no SQuAD file ----------------------------------------------------------------


def _records():
    ctx = "Anna visited Paris in 1900."
    return [
        {
            "id": f"q{i}",
            "title": "T",
            "context": ctx,
            "question": "Where?",
            "answers": {"text": ["Paris"], "answer_start": [13]},
        }
        for i in range(3)
    ]


@pytest.mark.parametrize("name", ["train.jsonl", "train.txt", "train.json", "one.json"])
def test_json_lines_input_is_refused_with_a_squad_shape_message(tmp_path, name):
    recs = _records()[:1] if name == "one.json" else _records()
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(FormatError, match=r"JSON Lines.*single SQuAD v1\.1 JSON object") as e:
        if qa.is_squad_file(path):
            qa.read_squad(path)
    assert isinstance(e.value, ValueError) and len(str(e.value)) < 400 and "Anna visited" not in str(e.value)


def test_squad_detection_still_tells_squad_from_conll(tmp_path):
    squad = tmp_path / "squad.txt"
    qa.write_squad(squad, [qa.QAExample("q", "where ?", "Anna visited Paris", (("Paris", 13),))])
    assert qa.is_squad_file(squad)
    conll = tmp_path / "code.conll"
    conll.write_text("{ O\nx B-VAR\n} O\n\n")
    assert not qa.is_squad_file(conll)
    broken = tmp_path / "broken.txt"  # a SQuAD file with a JSON error: read_squad names it
    broken.write_text('{"version": "1.1", "data": [\n')
    assert qa.is_squad_file(broken)
    with pytest.raises(FormatError, match="invalid JSON"):
        qa.read_squad(broken)


def test_cli_build_graph_on_json_lines_exits_2_with_the_message(tmp_path, capsys):
    from jsteer.cli import main

    path = tmp_path / "hf_train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    assert main(["kala", "build-graph", str(path), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "single SQuAD v1.1 JSON object" in err and "malformed line" not in err and len(err) < 500
    assert not (tmp_path / "g").exists()


# --- context words at abbreviation periods ------------------------------------------------------


def _words(ctx):
    return [[w for w, _, _ in s] for s in qa_builder.context_sentences(ctx)]


def test_context_words_keep_initials_and_abbreviations_whole():
    ctx = (
        "President John F. Kennedy visited St. Louis with Martin Luther King Jr. and met Dr. Smith in May. "
        "He left. Shares of Acme Corp. The end, etc. and No. 5 said No. Ok."
    )
    assert _words(ctx) == [
        [
            "President",
            "John",
            "F.",
            "Kennedy",
            "visited",
            "St.",
            "Louis",
            "with",
            "Martin",
            "Luther",
            "King",
            "Jr.",
            "and",
            "met",
            "Dr.",
            "Smith",
            "in",
            "May",
            ".",
        ],
        ["He", "left", "."],
        ["Shares", "of", "Acme", "Corp."],  # a suffix ends the sentence before a capitalised word
        ["The", "end", ",", "etc.", "and", "No.", "5", "said", "No", "."],  # "No." only before a number
        ["Ok", "."],
    ]
    assert all(ctx[a:b] == w for s in qa_builder.context_sentences(ctx) for w, a, b in s)
    assert _words("The U.S. and e.g. 3.5 units.") == [["The", "U.S.", "and", "e.g.", "3.5", "units", "."]]


def _squad(path, contexts):
    data = {
        "version": "1.1",
        "data": [
            {
                "title": "t",
                "paragraphs": [
                    {"context": c, "qas": [{"id": f"q{i}", "question": "Who?", "answers": []}]}
                    for i, c in enumerate(contexts)
                ],
            }
        ],
    }
    path.write_text(json.dumps(data))
    return path


def test_mined_entities_span_initials_and_abbreviations(tmp_path):
    ctxs = [
        "Yesterday John F. Kennedy visited St. Louis and spoke with Dr. Smith about Martin Luther King Jr. today.",
        "In 1963 John F. Kennedy returned to St. Louis, where Dr. Smith praised Martin Luther King Jr. again.",
        "Fans of J. R. R. Tolkien met. Many fans of J. R. R. Tolkien came.",
    ]
    qa_builder.build_qa_graph([_squad(tmp_path / "a.json", ctxs)], tmp_path / "g")
    lex = mining.Lexicon.load(tmp_path / "g" / "lexicon.tsv")
    assert {
        "john f. kennedy",
        "st. louis",
        "dr. smith",
        "martin luther king jr",
        "j. r. r. tolkien",
    } <= lex.entity_ids()
    lines = (tmp_path / "g" / "a.json.mentions.jsonl").read_text().splitlines()
    first = json.loads(lines[0])["mentions"]
    assert [m["text"] for m in first] == ["John F. Kennedy", "St. Louis", "Dr. Smith", "Martin Luther King Jr."]
    assert all(ctxs[0][m["start"] : m["end"]] == m["text"] for m in first)


def test_squad_corpus_lines_are_split_as_contexts(tmp_path):
    ctx = "Delegates met in Bonn, then in Rome."
    data = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": ctx,
                        "qas": [{"id": "q", "question": "Where?", "answers": [{"text": "Bonn", "answer_start": 17}]}],
                    }
                ]
            }
        ]
    }
    (tmp_path / "a.json").write_text(json.dumps(data))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("They flew to Bonn, then left.\nWe saw Rome.\n")  # each counts once only with the context
    qa_builder.build_qa_graph([tmp_path / "a.json"], tmp_path / "g", corpus_paths=[corpus])
    lex = mining.Lexicon.load(tmp_path / "g" / "lexicon.tsv")
    assert set(lex.cased) == {("Bonn",), ("Rome",)}
    ms = json.loads((tmp_path / "g" / "a.json.mentions.jsonl").read_text())["mentions"]
    assert [m["text"] for m in ms] == ["Bonn", "Rome"]
    # CoNLL graphs keep whitespace-split corpus lines (CoNLL text comes tokenised)
    assert builder.read_text_corpus(corpus) == [
        ["They", "flew", "to", "Bonn,", "then", "left."],
        ["We", "saw", "Rome."],
    ]


# --- summary after an annotate-only run --------------------------------------------------------


def _conll(path, sentences):
    path.write_text("".join("".join(f"{w} O\n" for w in s.split()) + "\n" for s in sentences))
    return path


def test_annotate_only_keeps_graph_wide_fact_counts(tmp_path, capsys):
    from jsteer.cli import main

    train = _conll(
        tmp_path / "train.conll", ["the EU met German and Bonn officials", "then the EU and German and Bonn people met"]
    )
    new = _conll(tmp_path / "new.conll", ["only the EU talks", "nothing here"])
    g = tmp_path / "g"
    s = builder.build_graph([train], g)
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 3)
    s = builder.build_graph([new], g, lexicon_path=g / "lexicon.tsv")
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 3)  # graph-wide, as before
    assert s["files"]["train.conll"]["fact_entities_in_mentions"] == 3
    assert s["files"]["new.conll"]["fact_entities_in_mentions"] == 1  # the new file's own: eu
    assert json.loads((g / "summary.json").read_text())["fact_entities_in_mentions"] == 3
    # the CLI's line describes the graph
    assert main(["kala", "build-graph", str(new), "--lexicon", str(g / "lexicon.tsv"), "--out", str(g)]) == 0
    assert "3 of the 3 entities named by the facts are mention ids" in capsys.readouterr().out
    # a folder with only annotate-only files counts those (re-annotating a file replaces its old mentions)
    g2 = tmp_path / "g2"
    builder.build_graph([new], g2, lexicon_path=g / "lexicon.tsv")
    s = builder.build_graph([new], g2, lexicon_path=g / "lexicon.tsv")
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 1)


def test_qa_annotate_only_keeps_graph_wide_fact_counts(tmp_path):
    train = _squad(
        tmp_path / "train.json",
        ["Officials of the EU met German and Bonn officials.", "Then the EU and German and Bonn people met."],
    )
    new = _squad(tmp_path / "new.json", ["Only the EU talks."])
    g = tmp_path / "g"
    s = qa_builder.build_qa_graph([train], g)
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 3)
    s = qa_builder.build_qa_graph([new], g, lexicon_path=g / "lexicon.tsv")
    assert (s["fact_entities"], s["fact_entities_in_mentions"]) == (3, 3)
    assert s["files"]["new.json"]["fact_entities_in_mentions"] == 1


def test_qa_entity_memory_is_built_on_the_segment_the_model_sees():
    """QA windows put the context in segment 1; the entity memory (mean last-layer features over
    a mention's tokens) must be computed on those same inputs, token_type_ids included."""
    import jax

    from jsteer.backbones.bert import BertConfig, BertEncoder
    from jsteer.kala import pipeline
    from jsteer.kala.entities import EntityVocab
    from jsteer.kala.formats import Mention

    ctx = "Anna visited Paris in 1900 ."
    ex = qa.QAExample("q", "where ?", ctx, (("Paris", ctx.index("Paris")),))
    mentions = [Mention("Paris", ctx.index("Paris"), ctx.index("Paris") + 5, "paris"), Mention("Anna", 0, 4, "anna")]
    vocab = EntityVocab(["anna", "paris"])
    feats = qa.encode_qa(ex, _bert_tokenizer(), mentions, vocab, max_len=16)
    cfg = BertConfig(
        vocab_size=len(_VOCAB),
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    enc = BertEncoder(cfg)
    f = feats[0]
    ids = f["input_ids"][None]
    params = enc.init(jax.random.PRNGKey(0), ids)["params"]
    # a segment embedding far from segment 0's, so the two readings differ clearly
    params["embeddings"]["token_type"]["embedding"] = jax.random.normal(
        jax.random.PRNGKey(1), params["embeddings"]["token_type"]["embedding"].shape
    )

    mem = pipeline.memory_from_backbone(cfg, params, feats, vocab, batch_size=2)

    def mean_over(tt, entity):
        h = np.asarray(enc.apply({"params": params}, ids, np.ones_like(ids), tt)[0][0], np.float64)
        return h[f["token_entity"] == vocab(entity)].mean(0)

    seg = f["token_type_ids"][None]
    assert seg[0, f["token_entity"] == vocab("paris")].tolist() == [1]
    for name in ("anna", "paris"):
        np.testing.assert_allclose(mem[vocab(name)], mean_over(seg, name), atol=1e-5)
        assert np.abs(mem[vocab(name)] - mean_over(np.zeros_like(seg), name)).max() > 1e-2


def test_bad_answer_start_is_an_error_for_training_and_repaired_for_scoring(tmp_path):
    """A training read refuses an answer_start that misses its text; a test read (EM / F1 need only
    the texts) moves it to the text's nearest occurrence, keeps a text the context lacks with start
    -1 (no token label), and says so in one warning."""
    ctx = "Paris is in France . Anna visited Paris in 1900 ."
    second = ctx.index("Paris", 1)
    path = tmp_path / "dev.json"
    qa.write_squad(
        path,
        [
            qa.QAExample("good", "where ?", ctx, (("Paris", second),)),
            qa.QAExample("moved", "where ?", ctx, (("Paris", second + 3), ("1900", ctx.index("1900")))),
            qa.QAExample("absent", "where ?", ctx, (("Rome", 4),)),
            qa.QAExample("negative", "where ?", ctx, (("Anna", -3),)),
        ],
    )
    with pytest.raises(FormatError, match=r"data\[1\].paragraphs\[0\].qas\[0\].answers\[0\].answer_start"):
        qa.read_squad(path)
    with pytest.warns(
        UserWarning,
        match=r"dev.json: 3 answer\(s\) whose answer_start does not point at the answer "
        r"text: 2 moved to the text's nearest occurrence in the context, 1 not in the context "
        r"\(scored by text only\); first: 'data\[1\]",
    ):
        examples = qa.read_squad(path, strict=False)
    assert [e.answers for e in examples] == [
        (("Paris", second),),
        (("Paris", second), ("1900", ctx.index("1900"))),
        (("Rome", -1),),
        (("Anna", ctx.index("Anna")),),
    ]
    tk = _bert_tokenizer(["is", "France", "Rome"])
    (absent,) = qa.encode_qa(examples[2], tk, max_len=32)
    assert (int(absent["start_positions"]), int(absent["end_positions"])) == (0, 0)
    (moved,) = qa.encode_qa(examples[1], tk, max_len=32)
    sp, ep = int(moved["start_positions"]), int(moved["end_positions"])
    assert ctx[moved["offsets"][sp, 0] : moved["offsets"][ep, 1]] == "Paris" and moved["offsets"][sp, 0] == second
    assert qa.gold_answers(examples)["absent"] == ["Rome"]  # still scored
