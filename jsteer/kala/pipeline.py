"""End-to-end NER and extractive QA pieces shared by the CLI, the experiments and the notebook.

    data = load_ner_data(train, test, graph_dir, tokenizer, labels=CONLL2003_LABELS, scheme="iob1")
    memory = memory_from_backbone(config, encoder_params, data.train, data.vocab)
    model, params = build_model(config, encoder_params, data, KalaConfig(method="relational"), memory)
    result = train.fit(model, params, data.train, TrainConfig())
    scores = train.evaluate_ner(model, result.params, data.test, data.test_tags, data.labels,
                                subsets=data.subsets())

Extractive QA the same way, on SQuAD-format files (``build_model`` picks the QA head)::

    data = load_qa_data(train_json, test_json, graph_dir, tokenizer, max_len=384, stride=128)
    model, params = build_model(config, encoder_params, data, KalaConfig(method="relational"), memory)
    result = train.fit(model, params, data.train, TrainConfig(), task="qa")
    scores = train.evaluate_qa(model, result.params, data.test, data.test_examples)

The graph directory is what ``jsteer kala build-graph`` writes (``<file>.mentions.jsonl``,
``facts.jsonl``). The entity vocabulary is built from the *training* mentions only.

NER sentences are read through the TFDS layer: a CoNLL file is prepared once by
:class:`jsteer.data.tfds_builders.ConllNer` into ``data_dir`` (default ``$JSTEER_DATA_DIR``)
and read back with ``tfds.data_source``; a prepared TFDS data set with ``tokens`` and ``tags``
is passed as a :class:`jsteer.data.sources.Split` in place of the path::

    train = sources.open_tfds("jsteer_conll_ner/src_0123456789ab:train", "tfds/", need=sources.NER)
    data = load_ner_data(train, None, graph_dir, tokenizer, lexicon=Lexicon.load(graph_dir / "lexicon.tsv"))

A split's mentions are the graph's ``<file name>.mentions.jsonl`` of the file it was prepared
from (:func:`mentions_path`); without one, ``lexicon`` annotates it in memory.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones.bert import BertConfig, BertEncoder
from jsteer.data import ner as ner_lib
from jsteer.data import sources
from jsteer.kala import data as kdata
from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab, init_memory
from jsteer.kala.formats import FormatError, read_facts, read_mentions
from jsteer.kala.model import KalaConfig, KalaModel, init_params
from jsteer.kala.qa import QAExample, encode_qa, first_unanswered, read_squad

UNSEEN_MIN = 3  # a test context is "unseen" with at least this many out-of-vocabulary entities


@dataclasses.dataclass
class NERData:
    labels: tuple[str, ...]
    train: list[dict]
    test: list[dict]
    train_tags: list[list[str]]
    test_tags: list[list[str]]
    vocab: EntityVocab
    relations: RelationVocab
    kg: KnowledgeGraph

    def subsets(self) -> dict[str, list[int]]:
        """Seen / unseen test contexts (the paper's Figure 4): ``unseen`` = at least
        :data:`UNSEEN_MIN` mentioned entities outside the training vocabulary; ``seen`` = at
        least one mentioned entity and all of them in the vocabulary."""
        unseen = [i for i, e in enumerate(self.test) if e["n_unseen"] >= UNSEEN_MIN]
        seen = [i for i, e in enumerate(self.test) if e["n_unseen"] == 0 and e["graph"].n_local > 0]
        return {"seen": seen, "unseen": unseen}


@dataclasses.dataclass
class QAData:
    train: list[dict]  # features (windows) of the training questions
    test: list[dict]  # features of the test questions (empty without a test file)
    test_examples: list[QAExample]
    vocab: EntityVocab
    relations: RelationVocab
    kg: KnowledgeGraph


def _subsample(n_total: int, n: Optional[int], seed: int) -> list[int]:
    if n is not None and n < 1:
        raise ValueError(f"a subset size must be >= 1 (None: all), got {n}")
    if n is None or n >= n_total:
        return list(range(n_total))
    return sorted(np.random.default_rng(seed).choice(n_total, size=n, replace=False).tolist())


def ner_split(source, scheme: Optional[str] = "iob1", data_dir=None) -> sources.Split:
    """A CoNLL file prepared through :class:`~jsteer.data.tfds_builders.ConllNer` (once; cached
    in ``data_dir``, its tag set inferred from the file), or a :class:`~jsteer.data.sources.Split` as is."""
    from jsteer.data import tfds_builders  # imports tensorflow_datasets (seconds): only when reading

    if isinstance(source, sources.Split):
        return source
    return sources.prepared(tfds_builders.ConllNer, source, data_dir, scheme=scheme)


def split_labels(split: sources.Split) -> tuple[str, ...]:
    """O plus B-X and I-X for every entity type X among the split's tags (IOB2; sorted by type),
    so a test file may hold an I-X (or B-X) the training file happens not to. A prepared file's
    tag names are the tags it holds; a named data set's, its tag vocabulary."""
    names = split.class_names("tags")
    if names is None:  # string tags
        names = {t for s in sources.tagged_sentences(split) for t in s.tags}
    types = {t[2:] for t in names if t != "O"}
    return ("O",) + tuple(f"{p}-{x}" for x in sorted(types) for p in "BI")


def _mentions_key(source) -> str:
    """The name a source's mentions file is keyed by: the (first) file it was prepared from;
    ``<name>_<split>`` for a data set that records none."""
    if not isinstance(source, sources.Split):
        return str(source)
    if source.files:
        return source.files[0]
    names = source.source_names
    return names[0] if len(names) == 1 else f"{source.name.replace('/', '_')}_{source.split}"


def mentions_path(graph_dir, source) -> pathlib.Path:
    """Where build-graph writes the mentions of a CoNLL file: ``<graph_dir>/<name>.mentions.jsonl``
    (a :class:`~jsteer.data.sources.Split`: of the file it was prepared from, see :func:`_mentions_key`)."""
    return pathlib.Path(graph_dir) / f"{pathlib.Path(_mentions_key(source)).name}.mentions.jsonl"


def missing_mentions_error(source, graph_dir) -> FormatError:
    """The error for a CoNLL file the graph folder has no mentions of, naming the command that
    annotates it without touching the graph's facts (or, with no lexicon there, what to do)."""
    graph_dir = pathlib.Path(graph_dir)
    lexicon = graph_dir / "lexicon.tsv"
    what = source.describe() if isinstance(source, sources.Split) else source
    if isinstance(source, sources.Split) and not source.files:
        fix = (
            "write it (format: jsteer.kala.formats; keys are record indices) or give the graph a "
            "lexicon.tsv to annotate it with"
        )
    elif lexicon.is_file():
        fix = (
            f"annotate it with the graph's lexicon (facts and lexicon stay as they are): "
            f"jsteer kala build-graph {what} --lexicon {lexicon} --out {graph_dir}"
        )
    else:
        fix = (
            f"{graph_dir} has no lexicon.tsv to annotate it with (a spaCy graph?); write the mentions file "
            f"yourself (format: jsteer.kala.formats) or rebuild the graph with this file among its inputs"
        )
    return FormatError(
        mentions_path(graph_dir, source),
        None,
        None,
        f"no such file: the graph folder has no mentions for {what}; {fix}",
    )


def read_split(
    path,
    graph_dir,
    labels: Sequence[str],
    scheme: str,
    size: Optional[int] = None,
    subsample_seed: int = 0,
    lexicon=None,
    data_dir=None,
) -> list[tuple[list[str], list[str], list]]:
    """CoNLL file (or a :class:`~jsteer.data.sources.Split`) + its mentions file under
    ``graph_dir`` (:func:`mentions_path`) -> [(words, tags, mentions)] (a seeded random subset of
    ``size`` sentences, in file order; None: all). A file is read through :func:`ner_split`
    (cached in ``data_dir``); a Split's tags are converted by ``scheme``.

    Without a mentions file: with ``lexicon`` (a :class:`jsteer.kala.mining.Lexicon`) the
    sentences are annotated with it in memory, as ``build-graph --lexicon`` would; otherwise a
    FormatError names the command that writes the file."""
    split = ner_split(path, scheme, data_dir)
    # A prepared file's tags are IOB2 already; a named data set's are converted here.
    sents = sources.tagged_sentences(split, scheme=None if split.files else scheme, label_set=labels)
    words = {i: list(s.tokens) for i, s in enumerate(sents)}
    mpath = mentions_path(graph_dir, path)
    if mpath.is_file():
        mentions = read_mentions(mpath, words)
    elif lexicon is not None:
        mentions = {i: lexicon.match(w) for i, w in words.items()}
    else:
        raise missing_mentions_error(path, graph_dir)
    idx = _subsample(len(sents), size, subsample_seed)
    return [(list(sents[i].tokens), list(sents[i].tags), mentions.get(i, [])) for i in idx]


def encode_split(
    split,
    tokenizer,
    labels: Sequence[str],
    vocab: EntityVocab,
    kg: KnowledgeGraph,
    max_len: int = 128,
    max_neighbors: int = 4,
) -> list[dict]:
    return [kdata.encode_ner(w, t, m, tokenizer, labels, vocab, kg, max_len, max_neighbors) for w, t, m in split]


def load_ner_data(
    train_path,
    test_path,
    graph_dir,
    tokenizer,
    labels: Sequence[str] = ner_lib.CONLL2003_LABELS,
    scheme: str = "iob1",
    max_len: int = 128,
    max_neighbors: int = 4,
    train_size: Optional[int] = None,
    test_size: Optional[int] = None,
    subsample_seed: int = 0,
    facts_path=None,
    lexicon=None,
    data_dir=None,
) -> NERData:
    """Read CoNLL train / test files (or :class:`~jsteer.data.sources.Split` s of a prepared
    TFDS data set) and their knowledge files; encode both splits.

    ``train_size`` / ``test_size`` take a seeded random subset of sentences (None: all).
    ``test_path`` None: no test split (``test`` and ``test_tags`` empty). ``lexicon``, ``data_dir``:
    see :func:`read_split`.
    """
    graph_dir = pathlib.Path(graph_dir)
    read = dict(lexicon=lexicon, data_dir=data_dir)
    train = read_split(train_path, graph_dir, labels, scheme, train_size, subsample_seed, **read)
    if not train:
        what = train_path.describe() if isinstance(train_path, sources.Split) else train_path
        raise ValueError(f"{what}: no sentences to train on (an empty CoNLL file)")
    test = (
        [] if test_path is None else read_split(test_path, graph_dir, labels, scheme, test_size, subsample_seed, **read)
    )
    facts = read_facts(facts_path or graph_dir / "facts.jsonl")
    vocab = EntityVocab.from_mentions([m for _, _, m in train])
    relations = RelationVocab.from_facts(facts)
    kg = KnowledgeGraph(facts, relations)
    return NERData(
        labels=tuple(labels),
        train=encode_split(train, tokenizer, labels, vocab, kg, max_len, max_neighbors),
        test=encode_split(test, tokenizer, labels, vocab, kg, max_len, max_neighbors),
        train_tags=[t for _, t, _ in train],
        test_tags=[t for _, t, _ in test],
        vocab=vocab,
        relations=relations,
        kg=kg,
    )


def read_qa_split(
    path, graph_dir, size: Optional[int] = None, subsample_seed: int = 0, lexicon=None, strict: bool = True
) -> list[tuple[QAExample, list]]:
    """SQuAD-format file + its ``<name>.mentions.jsonl`` under ``graph_dir`` (keyed by question
    id, character spans) -> [(question, its mentions)] (a seeded random subset of ``size``
    questions, in file order; None: all). Without a mentions file: annotated in memory with
    ``lexicon`` (:func:`jsteer.kala.qa_builder.annotate`) or, with none, a FormatError naming the
    command that writes the file. ``strict``: see :func:`jsteer.kala.qa.read_squad` (False for test
    files, which are scored on answer texts)."""
    from jsteer.kala.qa_builder import annotate

    examples = read_squad(path, strict)
    mpath = mentions_path(graph_dir, path)
    if mpath.is_file():
        mentions = read_mentions(mpath, {e.qid: e.context for e in examples})
    elif lexicon is not None:
        mentions = annotate(examples, lexicon)
    else:
        raise missing_mentions_error(path, graph_dir)
    return [(examples[i], mentions.get(examples[i].qid, [])) for i in _subsample(len(examples), size, subsample_seed)]


def check_train_split(path, split) -> None:
    """A QA training split (:func:`read_qa_split`) must hold questions, each with a gold answer:
    ValueError naming ``path`` otherwise (an empty file; SQuAD v2.0 unanswerable questions, which
    would train as [CLS] spans that a v1.1 model never predicts)."""
    if not split:
        raise ValueError(f'{path}: no questions to train on (its "data" holds none)')
    ex = first_unanswered([ex for ex, _ in split])
    if ex is not None:
        raise ValueError(
            f"{path}: training question {ex.qid!r} has no answers; SQuAD v2.0 unanswerable "
            f"questions are not supported (extractive QA here is SQuAD v1.1: every training "
            f"question needs at least one answer span); remove them from the file"
        )


def encode_qa_split(
    split,
    tokenizer,
    vocab: EntityVocab,
    kg: KnowledgeGraph,
    max_len: int = 384,
    stride: int = 128,
    max_query: int = 64,
    max_neighbors: int = 4,
) -> list[dict]:
    """Every question's windows (:func:`jsteer.kala.qa.encode_qa`), in order."""
    return [
        f
        for ex, ms in split
        for f in encode_qa(ex, tokenizer, ms, vocab, kg, max_len, stride, max_query, max_neighbors)
    ]


def qa_data(
    train_split,
    test_split,
    facts,
    tokenizer,
    max_len: int = 384,
    stride: int = 128,
    max_query: int = 64,
    max_neighbors: int = 4,
) -> QAData:
    """:class:`QAData` from read splits (:func:`read_qa_split`) and facts: the vocabularies from
    the training mentions, both splits encoded into windows."""
    vocab = EntityVocab.from_mentions([ms for _, ms in train_split])
    relations = RelationVocab.from_facts(facts)
    kg = KnowledgeGraph(facts, relations)
    enc = dict(max_len=max_len, stride=stride, max_query=max_query, max_neighbors=max_neighbors)
    return QAData(
        train=encode_qa_split(train_split, tokenizer, vocab, kg, **enc),
        test=encode_qa_split(test_split, tokenizer, vocab, kg, **enc),
        test_examples=[ex for ex, _ in test_split],
        vocab=vocab,
        relations=relations,
        kg=kg,
    )


def load_qa_data(
    train_path,
    test_path,
    graph_dir,
    tokenizer,
    max_len: int = 384,
    stride: int = 128,
    max_query: int = 64,
    max_neighbors: int = 4,
    train_size: Optional[int] = None,
    test_size: Optional[int] = None,
    subsample_seed: int = 0,
    facts_path=None,
) -> QAData:
    """Read SQuAD-format train / test files (``test_path`` None: no test set) and their
    knowledge files; encode both into windows. ``train_size`` / ``test_size``: a seeded random
    subset of questions (None: all)."""
    graph_dir = pathlib.Path(graph_dir)
    train = read_qa_split(train_path, graph_dir, train_size, subsample_seed)
    check_train_split(train_path, train)
    test = read_qa_split(test_path, graph_dir, test_size, subsample_seed, strict=False) if test_path is not None else []
    facts = read_facts(facts_path or graph_dir / "facts.jsonl")
    return qa_data(train, test, facts, tokenizer, max_len, stride, max_query, max_neighbors)


def memory_from_backbone(
    config: BertConfig, encoder_params, examples: Sequence[dict], vocab: EntityVocab, batch_size: int = 64
) -> np.ndarray:
    """Entity memory [len(vocab), D]: mean last-layer features over mention tokens (see
    :func:`jsteer.kala.entities.init_memory`), computed on the inputs the model is trained on:
    QA windows with their ``token_type_ids`` (the context is segment 1)."""
    enc = BertEncoder(config)
    keys = ("input_ids", "token_type_ids") if examples and "token_type_ids" in examples[0] else ("input_ids",)

    @jax.jit
    def hidden(params, ids, mask, token_types):
        return enc.apply({"params": params}, ids, mask, token_types)[0]

    def hidden_fn(batch):
        return np.asarray(
            hidden(encoder_params, batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        )

    return init_memory(
        hidden_fn, (b for _, b in kdata.batches(examples, batch_size, keys=keys)), len(vocab), config.hidden_size
    )


def check_token_types(config: BertConfig, examples: Sequence[dict]) -> None:
    """ValueError when the examples' token types (QA: the tokenizer's pair framing) exceed the
    model's ``type_vocab_size`` (a row past the table would be read as garbage): BERT's pairs
    use types 0 and 1, RoBERTa-family models (type_vocab_size 1) need their own tokenizer's
    all-zero types."""
    top = max(
        (int(e["token_type_ids"].max()) for e in examples if "token_type_ids" in e and e["token_type_ids"].size),
        default=0,
    )
    if top >= config.type_vocab_size:
        raise ValueError(
            f"the tokenizer gives token type {top}, but the {config.layout} model has type_vocab_size "
            f"{config.type_vocab_size} (types 0..{config.type_vocab_size - 1}): use the model's own "
            f"tokenizer"
        )


def build_model(
    config: BertConfig, encoder_params, data, kala: KalaConfig, memory: Optional[np.ndarray] = None, seed: int = 0
) -> tuple[KalaModel, dict]:
    """A KALA model over ``config`` with the pretrained encoder and a fresh head: NER for
    :class:`NERData`, span QA for :class:`QAData`; ``kala``'s entity / relation counts are
    filled in from ``data``."""
    check_token_types(config, list(data.train) + list(data.test))
    kala = dataclasses.replace(kala, num_entities=len(data.vocab), num_relations=len(data.relations))
    if isinstance(data, QAData):
        model = KalaModel(config, kala, task="qa")
    else:
        model = KalaModel(config, kala, task="ner", num_labels=len(data.labels))
    params = init_params(
        model,
        jax.random.PRNGKey(seed),
        encoder_params=encoder_params,
        memory=jnp.asarray(memory) if (memory is not None and kala.uses_knowledge) else None,
    )
    return model, params
