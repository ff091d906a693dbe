"""Extractive QA in SQuAD format, with KALA's knowledge inputs.

File format (SQuAD v1.1)::

    {"data": [{"title": ..., "paragraphs": [{"context": str,
        "qas": [{"id": str, "question": str, "answers": [{"text": str, "answer_start": int}]}]}]}]}

Long contexts are split into windows: ``[CLS] question [SEP] context window [SEP]`` of at most
``max_len`` tokens (framed as the tokenizer frames a pair, :func:`jsteer.kala.data.framing`:
RoBERTa's ``<s> question </s></s> context window </s>``, all token type 0, as HF's
``tokenizer(question, context)``), consecutive windows starting ``min(stride, room)`` context tokens apart
(``room``: the context tokens a window holds; ``stride`` is the original run_squad's
``doc_stride``, default 128), so they overlap when the window is longer and never skip a
context token when ``stride`` is larger (run_squad caps the step the same way). The answer's
tokens are those holding its characters (leading / trailing whitespace and characters the
tokenizer drops, such as a soft hyphen, have none); a window that does not contain all of
them is labelled with the ``[CLS]`` (``<s>``) position 0. At
prediction time every window's best span (n-best start x end, length <= ``max_answer_len``)
competes on start + end logit, and the winner is cut from the context by character offsets.

Mentions for QA examples use *character* offsets into the context (see
:mod:`jsteer.kala.formats`); a context token belongs to a mention when their character spans
overlap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import warnings
from typing import Optional, Sequence, Union

import numpy as np

from jsteer.kala.data import example_knowledge, framing, raw_tokenizer
from jsteer.kala.entities import EntityVocab, KnowledgeGraph
from jsteer.kala.formats import FormatError, Mention

PathLike = Union[str, os.PathLike]


@dataclasses.dataclass(frozen=True)
class QAExample:
    qid: str
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]  # (text, answer_start); -1: not in the context (read_squad)


_SQUAD_SHAPE = '{"version": "1.1", "data": [{"title": ..., "paragraphs": [{"context": ..., "qas": [...]}]}]}'


def _jsonl_error(path: PathLike) -> FormatError:
    return FormatError(
        path,
        None,
        None,
        f"this is JSON Lines (one record a line, as datasets' to_json writes), not a SQuAD file: "
        f"SQuAD input must be a single SQuAD v1.1 JSON object {_SQUAD_SHAPE} (the records' "
        f"questions grouped into paragraphs by context)",
    )


def _is_record(obj) -> bool:
    """A JSON Lines record of a flat QA data set (one question), not a SQuAD file's object."""
    return isinstance(obj, dict) and "data" not in obj and bool({"context", "question", "qas"} & set(obj))


def _first_line_is_object(text: str) -> bool:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def is_squad_file(path: PathLike) -> bool:
    """Whether ``path`` is meant as a SQuAD-format file rather than CoNLL: a ``.json`` name, or
    contents that parse as one JSON object (no CoNLL file does), or that start like one
    (``{"``; :func:`read_squad` then names the JSON error). Says nothing about its validity:
    :func:`read_squad` checks that. JSON Lines (a ``.jsonl`` name, or a file of one JSON
    object a line) raises :class:`FormatError` (a ValueError) saying SQuAD input is one JSON
    object: read as CoNLL, its records would be "malformed lines"."""
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        return True
    try:
        with open(path, encoding="utf-8") as f:
            if f.read(1024).lstrip()[:1] != "{":
                if suffix == ".jsonl":
                    raise _jsonl_error(path)
                return False
            f.seek(0)
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        if suffix == ".jsonl" or _first_line_is_object(text):
            raise _jsonl_error(path) from None
        return re.match(r"\{\s*\"", text.lstrip()) is not None
    if _is_record(obj) or (suffix == ".jsonl" and not isinstance(obj, dict)):
        raise _jsonl_error(path)
    return isinstance(obj, dict)


def _locate(ctx: str, text: str, start: int) -> int:
    """The start of the occurrence of ``text`` in ``ctx`` nearest to ``start``; -1 if none."""
    found = [m.start() for m in re.finditer(re.escape(text), ctx)] if text else []
    return min(found, key=lambda i: (abs(i - start), i)) if found else -1


def read_squad(path: PathLike, strict: bool = True) -> list[QAExample]:
    """Parse a SQuAD-format file; problems raise FormatError naming the JSON path of the field.

    An answer whose ``answer_start`` does not point at its text in the context is an error with
    ``strict`` (training labels are built from it). Without (test and graph-building reads: EM / F1
    compare answer texts only), it is moved to the occurrence of the text nearest to the given
    start, or, where the context does not hold the text, kept for scoring with ``answer_start``
    -1 (no token span); one warning counts both and names the first such answer."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FormatError(path, None, None, "no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and _first_line_is_object(path.read_text(encoding="utf-8")):
            raise _jsonl_error(path) from None
        raise FormatError(path, e.lineno, None, f"invalid JSON ({e.msg})") from None
    if _is_record(obj):
        raise _jsonl_error(path)

    def need(d, key, kind, where):
        if not isinstance(d, dict) or key not in d:
            raise FormatError(path, None, f"{where}.{key}", "missing")
        v = d[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise FormatError(path, None, f"{where}.{key}", f"expected {kind.__name__}, got {json.dumps(v)[:40]}")
        return v

    out, seen, moved, unlocated = [], set(), [], []
    for a, art in enumerate(need(obj, "data", list, "$")):
        for p, par in enumerate(need(art, "paragraphs", list, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            ctx = need(par, "context", str, where)
            for q, qa in enumerate(need(par, "qas", list, where)):
                w = f"{where}.qas[{q}]"
                qid = need(qa, "id", str, w)
                if qid in seen:
                    raise FormatError(path, None, f"{w}.id", f"duplicate question id {qid!r}")
                seen.add(qid)
                answers = []
                for k, ans in enumerate(need(qa, "answers", list, w)):
                    text = need(ans, "text", str, f"{w}.answers[{k}]")
                    start = need(ans, "answer_start", int, f"{w}.answers[{k}]")
                    if start < 0 or ctx[start : start + len(text)] != text:
                        field = f"{w}.answers[{k}].answer_start"
                        problem = (
                            f"context[{start}:{start + len(text)}] = {ctx[start : start + len(text)]!r} is "
                            f"not the answer {text!r}"
                        )
                        if strict:
                            raise FormatError(path, None, field, problem)
                        start = _locate(ctx, text, start)
                        (moved if start >= 0 else unlocated).append(f"'{field}': {problem}")
                    answers.append((text, start))
                out.append(QAExample(qid, need(qa, "question", str, w), ctx, tuple(answers)))
    if moved or unlocated:
        warnings.warn(
            f"{path}: {len(moved) + len(unlocated)} answer(s) whose answer_start does not point at the "
            f"answer text: {len(moved)} moved to the text's nearest occurrence in the context, "
            f"{len(unlocated)} not in the context (scored by text only); first: {(moved or unlocated)[0]}",
            stacklevel=2,
        )
    return out


def gold_answers(examples: Sequence[QAExample]) -> dict[str, list[str]]:
    """{question id: gold answer texts}, as :func:`jsteer.kala.metrics.squad_scores` takes them."""
    return {e.qid: [t for t, _ in e.answers] for e in examples}


def first_unanswered(examples: Sequence[QAExample]) -> Optional[QAExample]:
    """The first question without a gold answer (SQuAD v2.0's unanswerable ones), or None."""
    return next((ex for ex in examples if not ex.answers), None)


def write_squad(path: PathLike, examples: Sequence[QAExample]) -> None:
    data = [
        {
            "title": ex.qid,
            "paragraphs": [
                {
                    "context": ex.context,
                    "qas": [
                        {
                            "id": ex.qid,
                            "question": ex.question,
                            "answers": [{"text": t, "answer_start": s} for t, s in ex.answers],
                        }
                    ],
                }
            ],
        }
        for ex in examples
    ]
    pathlib.Path(path).write_text(json.dumps({"version": "1.1", "data": data}))


def _answer_tokens(answer: tuple[str, int], c_off: Sequence[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """(first, last) context token of ``answer`` = (text, answer_start), or None when no token
    holds any of its characters. The answer's character span is first shrunk to the characters
    the tokens hold: leading / trailing whitespace and characters the tokenizer drops (soft
    hyphen, zero-width characters, ...) are left out, so ``" Paris"`` and ``"Paris\\u00ad"`` are the
    tokens of ``Paris``. A token only partly inside the answer (``Paris`` of ``Parisian``) is
    its token, as in HF run_qa. A window is labelled when it holds both tokens."""
    text, a_s = answer
    a_e = a_s + len(text)
    stripped = text.strip()
    if stripped:  # whitespace first: a tokenizer whose offsets include a space (byte-level BPE) still lands inside
        a_s += len(text) - len(text.lstrip())
        a_e = a_s + len(stripped)
    toks = [j for j, (s, e) in enumerate(c_off) if s < a_e and e > a_s and e > s]
    return (toks[0], toks[-1]) if toks else None


def encode_qa(
    ex: QAExample,
    tokenizer,
    mentions: Sequence[Mention] = (),
    vocab: Optional[EntityVocab] = None,
    kg: Optional[KnowledgeGraph] = None,
    max_len: int = 384,
    stride: int = 128,
    max_query: int = 64,
    max_neighbors: int = 4,
) -> list[dict]:
    """One question -> windows (features), each a dict of int32 arrays [L] plus bookkeeping:
    input_ids, token_type_ids, start_positions, end_positions (scalars), offsets [L, 2]
    (context char span, -1 outside the context), token_node, token_entity, graph, qid, pad_id.

    Windows start ``min(stride, room)`` context tokens apart, so every context token is in at
    least one window; ``stride`` must be at least 1."""
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
        raise ValueError(
            f"encode_qa: stride must be an integer >= 1 (context tokens between window starts), got {stride!r}"
        )
    raw = raw_tokenizer(tokenizer)
    fr = framing(tokenizer, "QA")
    vocab = vocab or EntityVocab([])
    q_ids = raw.encode(ex.question, add_special_tokens=False).ids[:max_query]
    enc = raw.encode(ex.context, add_special_tokens=False)
    c_ids, c_off = enc.ids, enc.offsets
    room = max_len - len(q_ids) - len(fr.prefix) - len(fr.middle) - len(fr.end)
    if room <= 0:
        raise ValueError(f"max_len={max_len} leaves no room for the context after a {len(q_ids)}-token question")
    graph, node_of = example_knowledge(mentions, vocab, kg, max_neighbors)
    tok_node_ctx = np.full(len(c_ids), -1, np.int32)
    for m in mentions:
        for j, (s, e) in enumerate(c_off):
            if s < m.end and e > m.start:
                tok_node_ctx[j] = node_of[m.id]
    located = [a for a in ex.answers if a[1] >= 0]  # answer_start -1: scored by text only (read_squad)
    answer = _answer_tokens(located[0], c_off) if located else None
    feats = []
    start = 0
    while True:
        end = min(start + room, len(c_ids))
        ids, tt = fr.pair(q_ids, c_ids[start:end])
        n_q = len(fr.prefix) + len(q_ids) + len(fr.middle)  # the window's first context token
        off = np.full((len(ids), 2), -1, np.int32)
        off[n_q : n_q + end - start] = np.asarray(c_off[start:end], np.int32).reshape(-1, 2)
        tn = np.full(len(ids), -1, np.int32)
        tn[n_q : n_q + end - start] = tok_node_ctx[start:end]
        sp = ep = 0
        if answer is not None and start <= answer[0] and answer[1] < end:
            sp, ep = answer[0] - start + n_q, answer[1] - start + n_q
        ent = np.where(tn >= 0, graph.entity[np.maximum(tn, 0)] if graph.n_node else 0, 0).astype(np.int32)
        feats.append(
            {
                "input_ids": np.asarray(ids, np.int32),
                "token_type_ids": np.asarray(tt, np.int32),
                "start_positions": np.int32(sp),
                "end_positions": np.int32(ep),
                "offsets": off,
                "token_node": tn,
                "token_entity": ent,
                "graph": graph,
                "qid": ex.qid,
                "pad_id": fr.pad_id,
            }
        )
        if end >= len(c_ids):
            break
        start += min(stride, room)
    return feats


def best_span(
    start_logits: np.ndarray, end_logits: np.ndarray, offsets: np.ndarray, n_best: int = 20, max_answer_len: int = 30
) -> tuple[float, int, int]:
    """(score, char start, char end) of the best valid span in one window; score -inf if none."""
    best = (-np.inf, 0, 0)
    valid = offsets[:, 0] >= 0
    starts = [i for i in np.argsort(-start_logits) if valid[i]][:n_best]
    ends = [i for i in np.argsort(-end_logits) if valid[i]][:n_best]
    for s in starts:
        for e in ends:
            if s <= e < s + max_answer_len:
                score = float(start_logits[s] + end_logits[e])
                if score > best[0]:
                    best = (score, int(offsets[s, 0]), int(offsets[e, 1]))
    return best


def predict_answers(
    features: Sequence[dict],
    logits: Sequence[np.ndarray],
    contexts: dict[str, str],
    n_best: int = 20,
    max_answer_len: int = 30,
) -> dict[str, str]:
    """features and their logits [L, 2] -> {qid: answer text} (best span over all windows)."""
    best: dict[str, tuple[float, int, int]] = {}
    for f, lg in zip(features, logits, strict=True):
        n = len(f["input_ids"])
        cand = best_span(np.asarray(lg)[:n, 0], np.asarray(lg)[:n, 1], f["offsets"], n_best, max_answer_len)
        if f["qid"] not in best or cand[0] > best[f["qid"]][0]:
            best[f["qid"]] = cand
    return {q: (contexts[q][s:e] if np.isfinite(sc) else "") for q, (sc, s, e) in best.items()}
