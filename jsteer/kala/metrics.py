"""Task metrics: entity-level NER F1 (seqeval's default mode) and SQuAD EM / F1.

Entity chunks follow conlleval / seqeval's default (non-strict) rules: a chunk starts at
``B-X``, or at ``I-X`` after ``O`` or after a chunk of another type; it ends before
``O``, ``B-*`` or a tag of another type. A predicted entity counts only when type, start
and end all match a gold one. Micro precision / recall / F1 over all entities.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Iterable, Sequence


def _split(tag: str) -> tuple[str, str]:
    if tag in ("O", ""):
        return "O", ""
    if len(tag) > 2 and tag[1] in "-_":
        return tag[0], tag[2:]
    return tag[0], ""


def _ends(prev: str, tag: str, prev_type: str, typ: str) -> bool:
    if prev in ("E", "S"):
        return True
    if prev in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev != "O" and prev_type != typ


def _starts(prev: str, tag: str, prev_type: str, typ: str) -> bool:
    if tag in ("B", "S"):
        return True
    if tag in ("E", "I") and prev in ("E", "S", "O"):
        return True
    return tag != "O" and prev_type != typ


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """IOB/IOBES tags -> chunks ``(type, start, end_exclusive)`` (seqeval default rules)."""
    out, prev, prev_type, begin = [], "O", "", 0
    for i, tag in enumerate(list(tags) + ["O"]):
        cur, typ = _split(tag)
        if _ends(prev, cur, prev_type, typ):
            out.append((prev_type, begin, i))
        if _starts(prev, cur, prev_type, typ):
            begin = i
        prev, prev_type = cur, typ
    return out


def ner_scores(gold: Iterable[Sequence[str]], pred: Iterable[Sequence[str]]) -> dict:
    """Micro entity-level scores over sentences.

    Returns {"precision", "recall", "f1", "n_gold", "n_pred", "n_correct",
    "per_type": {type: {"precision", "recall", "f1", "support"}}} (scores in [0, 1]).
    """
    counts = collections.defaultdict(lambda: [0, 0, 0])  # type -> [gold, pred, correct]
    for s, (g, p) in enumerate(zip(gold, pred, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {s}: {len(g)} gold tags but {len(p)} predicted tags")
        ge, pe = set(entities(g)), set(entities(p))
        for t, *_ in ge:
            counts[t][0] += 1
        for t, *_ in pe:
            counts[t][1] += 1
        for t, *_ in ge & pe:
            counts[t][2] += 1

    def prf(n_gold, n_pred, n_ok):
        p = n_ok / n_pred if n_pred else 0.0
        r = n_ok / n_gold if n_gold else 0.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)

    tot = [sum(c[i] for c in counts.values()) for i in range(3)]
    p, r, f = prf(*tot)
    per = {}
    for t, c in sorted(counts.items()):
        tp, tr, tf = prf(*c)
        per[t] = {"precision": tp, "recall": tr, "f1": tf, "support": c[0]}
    return {
        "precision": p,
        "recall": r,
        "f1": f,
        "n_gold": tot[0],
        "n_pred": tot[1],
        "n_correct": tot[2],
        "per_type": per,
    }


# ---------------------------------------------------------------------------------- SQuAD


def ner_report(
    gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], subsets: dict | None = None, per_type: bool = False
) -> dict:
    """Entity-level scores in percent (``f1``, ``precision``, ``recall``, ``n_sentences``), plus
    ``f1_<name>`` / ``n_<name>`` for each {name: sentence indices} subset (F1 only if non-empty)
    and, with ``per_type``, ``per_type`` {entity type: F1} (types in gold or predictions)."""
    res = ner_scores(gold, pred)
    out = {
        "f1": 100 * res["f1"],
        "precision": 100 * res["precision"],
        "recall": 100 * res["recall"],
        "n_sentences": len(gold),
    }
    for name, idx in (subsets or {}).items():
        idx = list(idx)
        if idx:
            out[f"f1_{name}"] = 100 * ner_scores([gold[i] for i in idx], [pred[i] for i in idx])["f1"]
        out[f"n_{name}"] = len(idx)
    if per_type:
        out["per_type"] = {t: 100 * v["f1"] for t, v in res["per_type"].items()}
    return out


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD v1.1)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction: str, truth: str) -> float:
    """Token-overlap F1 of the normalised answers, as the official SQuAD v1.1 script computes it:
    0 whenever no token is shared -- also when either side normalises to nothing (``"a"`` vs
    ``"the"``, or two empty strings). (SQuAD v2.0's script instead scores two empty answers 1;
    the files this module scores are v1.1, where every question has an answer.)"""
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(p) & collections.Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, Sequence[str]]) -> dict:
    """{qid: predicted text}, {qid: gold texts} -> {"exact_match", "f1"} in percent, max over
    gold answers, averaged over every question in ``answers`` (a missing prediction scores 0).
    EM and F1 follow the official SQuAD v1.1 evaluation script (see :func:`token_f1`)."""
    if not answers:
        raise ValueError("squad_scores: no questions")
    em = f1 = 0.0
    for qid, golds in answers.items():
        if not golds:
            raise ValueError(f"squad_scores: question {qid!r} has no gold answer")
        pred = predictions.get(qid, "")
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(token_f1(pred, g) for g in golds)
    n = len(answers)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "n": n}


def lexicon_quality(lexicon, sentences) -> dict:
    """How well a graph builder's lexicon (:class:`jsteer.kala.mining.Lexicon`) finds gold entity
    mentions: ``sentences`` [(words, gold spans [(start, end)])] -> counts and rates. Mentions that
    overlap / equal a gold span (``precision_overlap`` / ``precision_exact``), gold spans some
    mention overlaps (``recall_overlap``), ``mentions_per_sentence``. The labels only score the
    builder's output; it never reads them."""
    found = overlap = exact = gold = hit = 0
    for words, spans in sentences:
        ms = lexicon.match(words)
        found, gold = found + len(ms), gold + len(spans)
        overlap += sum(any(m.start < e and s < m.end for s, e in spans) for m in ms)
        exact += sum((m.start, m.end) in spans for m in ms)
        hit += sum(any(m.start < e and s < m.end for m in ms) for s, e in spans)
    return {
        "sentences": len(sentences),
        "lexicon_size": len(lexicon),
        "mentions": found,
        "gold_spans": gold,
        "mentions_per_sentence": found / max(len(sentences), 1),
        "precision_overlap": overlap / max(found, 1),
        "precision_exact": exact / max(found, 1),
        "recall_overlap": hit / max(gold, 1),
    }
