"""Offline knowledge builder for SQuAD-format files: mentions in the contexts, facts between them.

The SQuAD counterpart of :func:`jsteer.kala.builder.build_graph` (``jsteer kala build-graph``
on ``.json`` files), with the same lexicon mining, fact patterns, spaCy option and
annotate-only mode (``--lexicon``); see :mod:`jsteer.kala.mining` and
:mod:`jsteer.kala.builder` for those. **Answers are
never read**, nor are questions: only the contexts.

Contexts are raw text, so they are first split into words with character spans
(:func:`context_sentences`): runs of letters / digits (keeping inner hyphens and apostrophes,
``well-known``, ``O'Neil``; a possessive ``'s`` is a word of its own, as in CoNLL), dotted
abbreviations (``U.S.``) and decimals (``3.5``) are words, every other non-space character is
a word of its own (``Paris,`` -> ``Paris`` ``,``); a sentence ends after a ``.``, ``!`` or
``?`` word. A period stays on a single capital letter (an initial: ``John F. Kennedy``) and on
the few abbreviations of :data:`TITLES` (before a name: ``Dr. Smith``, ``St. Louis``; ``No.``
only before a number) and :data:`SUFFIXES` (after one: ``King Jr.``, ``Apple Inc.``, ``etc.``),
and no sentence ends after them, except after a suffix followed by a capitalised word
(``... of Acme Corp. The company ...``). Mining and fact extraction run on these
sentences, each distinct context counted once (SQuAD repeats a paragraph's context for every
question on it). A word-span mention becomes a character-span mention of the context
(``text == context[start:end]``), and every question gets its context's mentions: the mentions
file is keyed by question id, as :func:`jsteer.kala.qa.encode_qa` expects.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Sequence, Union

from jsteer.kala import builder
from jsteer.kala.formats import Mention
from jsteer.kala.mining import Lexicon
from jsteer.kala.qa import QAExample, read_squad

PathLike = Union[str, os.PathLike]

#: Abbreviations written before a name or number, kept with their period: no sentence ends after them.
TITLES = ("Mr", "Mrs", "Ms", "Dr", "Prof", "Rev", "Gen", "Col", "Lt", "Sgt", "St", "Mt", "Ft", "vs", "No")
#: Abbreviations written after a name, kept with their period: a sentence ends after them only
#: when the next word is capitalised.
SUFFIXES = ("Jr", "Sr", "Inc", "Co", "Ltd", "Corp", "etc")
_UPPER = "".join(c for c in map(chr, range(0x2000)) if c.isupper() and len(c.lower()) == 1)
_WORD = re.compile(
    r"(?:[^\W\d_]\.){2,}"  # U.S., e.g.
    rf"|(?<!\w)(?:(?:{'|'.join(t for t in TITLES if t != 'No')}|{'|'.join(SUFFIXES)}|[{_UPPER}])\.|No\.(?=\s*\d))"
    r"|\d+(?:[.,]\d+)+|\w+(?:-\w+|['’](?![sS]\b)\w+)*|['’][sS]\b|[^\w\s]"
)
_SENTENCE_END = frozenset(".!?")
_SUFFIX_WORDS = frozenset(f"{s}." for s in SUFFIXES)


def context_sentences(context: str) -> list[list[tuple[str, int, int]]]:
    """``context`` -> sentences of (word, char start, char end) (see the module docstring)."""
    out, cur = [], []
    for m in _WORD.finditer(context):
        w = m.group()
        if cur and cur[-1][0] in _SUFFIX_WORDS and w[0].isupper():  # "... Acme Corp. The ..."
            out.append(cur)
            cur = []
        cur.append((w, m.start(), m.end()))
        if w in _SENTENCE_END:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _corpus_words(line: str) -> list[list[str]]:
    """A ``--corpus`` line -> sentences of words, split as the contexts are."""
    return [[w for w, _, _ in s] for s in context_sentences(line)]


def _char_mentions(context: str, sentences, word_mentions) -> list[Mention]:
    """Word-span mentions of each sentence -> character-span mentions of the context."""
    out = []
    for sent, ms in zip(sentences, word_mentions, strict=True):
        for m in ms:
            start, end = sent[m.start][1], sent[m.end - 1][2]
            out.append(Mention(text=context[start:end], start=start, end=end, id=m.id))
    return out


def _contexts(examples: Sequence[QAExample]) -> list[str]:
    """The distinct contexts, in order of first use."""
    return list(dict.fromkeys(e.context for e in examples))


def annotate(examples: Sequence[QAExample], lexicon: Lexicon) -> dict[str, list[Mention]]:
    """{question id: its context's mentions} with ``lexicon`` matched in the contexts (in
    memory, as ``build-graph --lexicon`` writes them)."""
    by_context = {}
    for ctx in _contexts(examples):
        sents = context_sentences(ctx)
        by_context[ctx] = _char_mentions(ctx, sents, [lexicon.match([w for w, _, _ in s]) for s in sents])
    return {e.qid: by_context[e.context] for e in examples}


def build_qa_graph(squad_paths: Sequence[PathLike], out_dir: PathLike, **options) -> dict:
    """Write ``<name>.mentions.jsonl`` per SQuAD file (keyed by question id, character spans),
    ``facts.jsonl``, ``lexicon.tsv`` and ``summary.json`` under ``out_dir``, with the options of
    :func:`jsteer.kala.builder.build_graph` (:class:`~jsteer.kala.builder.GraphOptions`, documented
    there); ``corpus_paths`` lines are split into words as the contexts are. Returns the summary,
    whose ``files`` entries count questions, distinct contexts, the mentions in those contexts and
    the facts' entities among them. Every input is read and checked before ``out_dir`` is created
    or written; a graph already there is replaced only with ``overwrite`` (see
    :func:`jsteer.kala.builder.build_graph`)."""

    def read(paths):
        per_file = {pathlib.Path(p).name: read_squad(p, strict=False) for p in paths}  # answers are never read
        contexts = _contexts([e for exs in per_file.values() for e in exs])
        sentences = {c: context_sentences(c) for c in contexts}

        def files(mentions_flat, knowledge):
            by_context, k = {}, 0
            for c in contexts:
                n = len(sentences[c])
                by_context[c] = _char_mentions(c, sentences[c], mentions_flat[k : k + n])
                k += n
            out = {}
            for name, examples in per_file.items():
                ctxs = _contexts(examples)
                out[name] = (
                    {e.qid: by_context[e.context] for e in examples},
                    {
                        "questions": len(examples),
                        "contexts": len(ctxs),
                        "mentions": sum(len(by_context[c]) for c in ctxs),
                        "fact_entities_in_mentions": builder.file_fact_entities(
                            knowledge, [by_context[c] for c in ctxs]
                        ),
                    },
                )
            return out

        return [[w for w, _, _ in s] for c in contexts for s in sentences[c]], files

    return builder.build_folder(squad_paths, out_dir, read, builder.GraphOptions(**options), _corpus_words)
