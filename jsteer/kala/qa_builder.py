"""Offline knowledge builder for SQuAD-format files: mentions in the contexts, facts between them.

The SQuAD counterpart of :func:`jsteer.kala.builder.build_graph` (``jsteer kala build-graph``
on ``.json`` files), with the same lexicon mining, fact patterns, spaCy option and
annotate-only mode (``--lexicon``); see :mod:`jsteer.kala.builder` for those. **Answers are
never read**, nor are questions: only the contexts.

Contexts are raw text, so they are first split into words with character spans
(:func:`context_sentences`): runs of letters / digits (keeping inner hyphens and apostrophes,
``well-known``, ``O'Neil``; a possessive ``'s`` is a word of its own, as in CoNLL), dotted
abbreviations (``U.S.``) and decimals (``3.5``) are words, every other non-space character is
a word of its own (``Paris,`` -> ``Paris`` ``,``); a
sentence ends after a ``.``, ``!`` or ``?`` word. Mining and fact extraction run on these
sentences, each distinct context counted once (SQuAD repeats a paragraph's context for every
question on it). A word-span mention becomes a character-span mention of the context
(``text == context[start:end]``), and every question gets its context's mentions: the mentions
file is keyed by question id, as :func:`jsteer.kala.qa.encode_qa` expects.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Optional, Sequence, Union

from jsteer.kala import builder
from jsteer.kala.formats import Mention, write_mentions
from jsteer.kala.qa import QAExample, read_squad

PathLike = Union[str, os.PathLike]

_WORD = re.compile(r"(?:[^\W\d_]\.){2,}|\d+(?:[.,]\d+)+|\w+(?:-\w+|['’](?![sS]\b)\w+)*|['’][sS]\b|[^\w\s]")
_SENTENCE_END = frozenset(".!?")


def context_sentences(context: str) -> list[list[tuple[str, int, int]]]:
    """``context`` -> sentences of (word, char start, char end) (see the module docstring)."""
    out, cur = [], []
    for m in _WORD.finditer(context):
        cur.append((m.group(), m.start(), m.end()))
        if m.group() in _SENTENCE_END:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


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


def annotate(examples: Sequence[QAExample], lexicon: builder.Lexicon) -> dict[str, list[Mention]]:
    """{question id: its context's mentions} with ``lexicon`` matched in the contexts (in
    memory, as ``build-graph --lexicon`` writes them)."""
    by_context = {}
    for ctx in _contexts(examples):
        sents = context_sentences(ctx)
        by_context[ctx] = _char_mentions(ctx, sents, [lexicon.match([w for w, _, _ in s]) for s in sents])
    return {e.qid: by_context[e.context] for e in examples}


def build_qa_graph(squad_paths: Sequence[PathLike], out_dir: PathLike, *, facts_path: Optional[PathLike] = None,
                   corpus_paths: Sequence[PathLike] = (), strategy: str = "capitalised", min_count: int = 2,
                   max_len: int = 4, spacy_model: Optional[str] = None,
                   lexicon_path: Optional[PathLike] = None) -> dict:
    """Write ``<name>.mentions.jsonl`` per SQuAD file (keyed by question id, character spans),
    ``facts.jsonl``, ``lexicon.tsv`` and ``summary.json`` under ``out_dir``, with the options of
    :func:`jsteer.kala.builder.build_graph` (which documents them). Returns the summary, whose
    ``files`` entries count questions, distinct contexts and the mentions in those contexts.
    Every input is read and checked before ``out_dir`` is created or written."""
    builder.check_unique_names(squad_paths)
    out = pathlib.Path(out_dir)
    per_file = {str(p): read_squad(p) for p in squad_paths}
    contexts = _contexts([e for exs in per_file.values() for e in exs])
    sentences = {c: context_sentences(c) for c in contexts}
    all_sents = [[w for w, _, _ in s] for c in contexts for s in sentences[c]]
    mentions_flat, knowledge = builder.annotate_sentences(
        all_sents, out, facts_path=facts_path, corpus_paths=corpus_paths, strategy=strategy, min_count=min_count,
        max_len=max_len, spacy_model=spacy_model, lexicon_path=lexicon_path)
    by_context, k = {}, 0
    for c in contexts:
        n = len(sentences[c])
        by_context[c] = _char_mentions(c, sentences[c], mentions_flat[k:k + n])
        k += n
    summary = builder.write_knowledge(out, knowledge, mentions_flat)
    for p, examples in per_file.items():
        name = pathlib.Path(p).name
        write_mentions(out / f"{name}.mentions.jsonl", {e.qid: by_context[e.context] for e in examples})
        ctxs = _contexts(examples)
        summary["files"][name] = {"questions": len(examples), "contexts": len(ctxs),
                                  "mentions": sum(len(by_context[c]) for c in ctxs),
                                  "mentions_file": f"{name}.mentions.jsonl"}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
