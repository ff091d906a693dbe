"""NER helpers: tag-scheme conversion and word -> subword label alignment.

Tags are strings (``"O"``, ``"B-PER"``, ``"I-PER"``). IOB1 (CoNLL-2003 as published) opens an
entity with ``I-`` and uses ``B-`` only between two adjacent entities of the same type; IOB2
opens every entity with ``B-``, which is what seqeval-style span scores expect.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import numpy as np

IGNORE_INDEX = -100

CONLL2003_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
NCBI_DISEASE_LABELS = ("O", "B-Disease", "I-Disease")


def split_tag(tag: str) -> tuple[str, Optional[str]]:
    """``"B-PER"`` -> ``("B", "PER")``; ``"O"`` -> ``("O", None)``. Raises ValueError otherwise."""
    if tag == "O":
        return "O", None
    if len(tag) > 2 and tag[1] == "-" and tag[0] in "BI":
        return tag[0], tag[2:]
    raise ValueError(f"tag {tag!r} is not IOB (expected 'O', 'B-<type>' or 'I-<type>')")


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
    """Rewrite IOB1 tags as IOB2: an ``I-X`` that starts an entity becomes ``B-X``."""
    out: list[str] = []
    prev_type: Optional[str] = None  # entity type of the previous token, None after O
    for tag in tags:
        prefix, typ = split_tag(tag)
        if prefix == "I" and typ != prev_type:
            tag = "B-" + typ
        out.append(tag)
        prev_type = typ
    return out


def iob2_violation(tags: Sequence[str]) -> Optional[int]:
    """Index of the first tag that breaks IOB2 (``I-X`` not after ``B-X``/``I-X``), else None."""
    prev_type: Optional[str] = None
    for i, tag in enumerate(tags):
        prefix, typ = split_tag(tag)
        if prefix == "I" and typ != prev_type:
            return i
        prev_type = typ
    return None


def spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """IOB2 tags -> entity spans ``(type, start, end_exclusive)``."""
    out: list[tuple[str, int, int]] = []
    start, typ = None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, t = split_tag(tag)
        if start is not None and (prefix != "I" or t != typ):
            out.append((typ, start, i))
            start, typ = None, None
        if prefix == "B" or (prefix == "I" and start is None):
            start, typ = i, t
    return out


def _word_piece_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Subword ids of each word, without special tokens.

    ``tokenizer`` is a ``tokenizers.Tokenizer``, an object wrapping one (attribute
    ``tokenizer`` / ``_tokenizer`` / ``_tok`` / ``_tk``, e.g. jsteer.tokenizer.Tokenizer), or anything with
    ``encode(text, add_special_tokens=False) -> list[int]``.
    """
    raw = tokenizer
    for attr in ("tokenizer", "_tokenizer", "_tok", "_tk"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "encode_batch"):
            raw = inner
            break
    if hasattr(raw, "encode_batch") and hasattr(raw, "get_vocab_size"):  # tokenizers.Tokenizer
        encs = raw.encode_batch(list(words), add_special_tokens=False)
        # A tokenizer.json may enable padding: keep only real (attention_mask 1) pieces.
        return [[i for i, m in zip(e.ids, e.attention_mask) if m] for e in encs]
    return [list(tokenizer.encode(w, add_special_tokens=False)) for w in words]


def align_labels(
    word_pieces: Sequence[Sequence[int]],
    word_labels: Sequence[int],
    *,
    label_all_subwords: bool = False,
    inside_of: Optional[Mapping[int, int]] = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[list[int], list[int], list[int]]:
    """Flatten per-word pieces and give each subword a label.

    The first piece of a word gets the word's label; later pieces get ``ignore_index``, or
    with ``label_all_subwords`` the word's label mapped through ``inside_of`` (B-X -> I-X
    ids; identity where absent). A word with no pieces raises ValueError (its
    label would be lost); :func:`encode_tagged` maps such words to ``unk_id`` first.

    Returns (ids, labels, word_index) - flat lists of equal length; ``word_index[j]`` is the
    word subword ``j`` came from.
    """
    if len(word_pieces) != len(word_labels):
        raise ValueError(f"{len(word_pieces)} words but {len(word_labels)} labels")
    ids: list[int] = []
    labels: list[int] = []
    widx: list[int] = []
    for w, (pieces, lab) in enumerate(zip(word_pieces, word_labels)):
        if len(pieces) == 0:
            raise ValueError(f"word {w} has no subword pieces; its label would be lost")
        for j, p in enumerate(pieces):
            ids.append(int(p))
            widx.append(w)
            if j == 0:
                labels.append(int(lab))
            elif label_all_subwords:
                labels.append(int(inside_of.get(int(lab), int(lab)) if inside_of else lab))
            else:
                labels.append(ignore_index)
    return ids, labels, widx


def inside_map(label_names: Sequence[str]) -> dict[int, int]:
    """Label-id map B-X -> I-X (for labelling continuation subwords)."""
    index = {n: i for i, n in enumerate(label_names)}
    return {index[n]: index["I-" + n[2:]] for n in label_names if n.startswith("B-") and "I-" + n[2:] in index}


def encode_tagged(
    tokenizer,
    words: Sequence[str],
    label_ids: Sequence[int],
    *,
    max_len: int,
    cls_id: Optional[int],
    sep_id: Optional[int],
    unk_id: Optional[int] = None,
    label_all_subwords: bool = False,
    inside_of: Optional[Mapping[int, int]] = None,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, np.ndarray]:
    """One tagged sentence -> ``{"input_ids", "labels", "word_index"}`` int32 [L] (unpadded).

    Adds ``[CLS]``/``[SEP]`` when their ids are given (labelled ``ignore_index``, word index
    -1) and truncates to ``max_len`` tokens in total. A word with no pieces becomes
    ``unk_id`` (or raises ValueError when ``unk_id`` is None), so no label is ever lost
    silently.
    """
    pieces = _word_piece_ids(tokenizer, words)
    for w, p in enumerate(pieces):
        if not p:
            if unk_id is None:
                raise ValueError(f"word {w} ({words[w]!r}) tokenizes to nothing and no unk_id was given")
            pieces[w] = [unk_id]
    ids, labels, widx = align_labels(
        pieces, label_ids, label_all_subwords=label_all_subwords, inside_of=inside_of, ignore_index=ignore_index
    )
    room = max_len - (cls_id is not None) - (sep_id is not None)
    if room <= 0:
        raise ValueError(f"max_len={max_len} leaves no room for tokens")
    ids, labels, widx = ids[:room], labels[:room], widx[:room]
    if cls_id is not None:
        ids, labels, widx = [cls_id] + ids, [ignore_index] + labels, [-1] + widx
    if sep_id is not None:
        ids, labels, widx = ids + [sep_id], labels + [ignore_index], widx + [-1]
    return {
        "input_ids": np.asarray(ids, np.int32),
        "labels": np.asarray(labels, np.int32),
        "word_index": np.asarray(widx, np.int32),
    }


def word_predictions(subword_pred: np.ndarray, word_index: np.ndarray, num_words: int, fill: int = 0) -> np.ndarray:
    """Per-word prediction = prediction at the word's first subword. [L] -> [num_words].

    Words cut off by truncation get ``fill``.
    """
    out = np.full((num_words,), fill, dtype=np.asarray(subword_pred).dtype)
    seen = np.zeros((num_words,), bool)
    for j, w in enumerate(np.asarray(word_index)):
        if 0 <= w < num_words and not seen[w]:
            out[w] = subword_pred[j]
            seen[w] = True
    return out


def label_encoder(label_names: Sequence[str]) -> Callable[[Sequence[str]], list[int]]:
    """tags -> ids with a KeyError naming the unknown tag."""
    index = {n: i for i, n in enumerate(label_names)}

    def encode(tags: Sequence[str]) -> list[int]:
        try:
            return [index[t] for t in tags]
        except KeyError as e:
            raise KeyError(f"tag {e.args[0]!r} not in label set {list(label_names)}") from None

    return encode
