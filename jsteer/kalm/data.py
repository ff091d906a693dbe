"""The KALM recipe data (``kalm_namedentitylm/`` from uclanlp/NamedEntityLanguageModel).

Files::

    superingredients/<type>.txt   one knowledge-base entry a line, 8 ingredient types (dairy,
                                  drinks, fruits, grains, proteins, seasonings, sides,
                                  vegetables); entries are messy ("Beef (ground)", "sausage,2",
                                  a Python-list line in dairy.txt)
    raw_data/uncleaned_{valid,test}_{ing,ttl}.txt   recipes: ingredient lists / titles, one
                                  recipe a line (there is no train file: we train on valid)

Word-level pipeline (all lower case): :func:`tokenize` keeps letter runs and commas;
:func:`read_lexicon` cleans the entries; :func:`word_types` turns entries into a word-level
typed lexicon {word: types} (every content word of an entry, plus simple plural / singular
variants seen in the corpus); :class:`Vocab` maps words to ids (``<pad>`` 0, ``<unk>`` 1,
``<eos>`` 2, which also starts every line); :func:`encode_lines` makes fixed-length id arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np

PathLike = Union[str, os.PathLike]
TYPE_NAMES = ("dairy", "drinks", "fruits", "grains", "proteins", "seasonings", "sides", "vegetables")
PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
# modifiers dropped from multi-word entries ("Beef (ground)" -> beef); single-word entries stay
MODIFIERS = frozenset(
    """and or of the a an with without all any dry dried fresh frozen canned ground cooked uncooked
pre sauce mix style plain flavored whole""".split()
)
_WORD = re.compile(r"[a-z]+")
_TOKEN = re.compile(r"[a-z]+|,")


class DataError(ValueError):
    """A missing or malformed KALM data file (names the file and line)."""


def tokenize(line: str) -> list[str]:
    """Lower-cased letter runs and commas: ``"Navy beans,  water"`` -> ``[navy, beans, ",", water]``."""
    return _TOKEN.findall(line.lower())


def read_lexicon(root: PathLike, types: Sequence[str] = TYPE_NAMES) -> dict[str, list[str]]:
    """{type: cleaned entries} from ``<root>/superingredients/<type>.txt``.

    Cleaning: lower case; a trailing ``,<count>`` is dropped; a line that is a Python list of
    quoted items is split into its items; parenthesised parts are dropped from multi-word
    entries.
    """
    folder = pathlib.Path(root) / "superingredients"
    if not folder.is_dir():
        raise DataError(f"{folder}: no superingredients folder (expected the kalm_namedentitylm data set)")
    out = {}
    for t in types:
        path = folder / f"{t}.txt"
        if not path.is_file():
            raise DataError(f"{path}: missing type file for type {t!r}")
        entries = []
        for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = raw.strip().lower()
            if not line:
                continue
            items = re.findall(r"'([^']*)'", line) if line.startswith("'") else [re.sub(r",\s*\d+\s*$", "", line)]
            entries += [i.strip() for i in items if i.strip()]
        if not entries:
            raise DataError(f"{path}: no entries")
        out[t] = entries
    return out


def entry_words(entry: str) -> list[str]:
    """Content words of one cleaned entry (see :data:`MODIFIERS`)."""
    words = _WORD.findall(entry)
    if len(words) <= 1:
        return words
    words = _WORD.findall(re.sub(r"\([^)]*\)", " ", entry)) or words
    return [w for w in words if w not in MODIFIERS and len(w) > 2]


def word_types(
    lexicon: Mapping[str, Sequence[str]], corpus_words: Optional[Iterable[str]] = None
) -> dict[str, tuple[str, ...]]:
    """Word-level typed lexicon {word: sorted types}. With ``corpus_words``, each word also
    lends its type to its plural / singular variants (``+s``, ``+es``, ``-s``, ``-es``) found
    there, and words absent from the corpus are dropped."""
    corpus = None if corpus_words is None else set(corpus_words)
    table: dict[str, set[str]] = collections.defaultdict(set)
    for t, entries in lexicon.items():
        for entry in entries:
            for w in entry_words(entry):
                forms = {w}
                if corpus is not None:
                    forms |= {w + "s", w + "es"}
                    if w.endswith("es"):
                        forms.add(w[:-2])
                    if w.endswith("s"):
                        forms.add(w[:-1])
                    forms &= corpus
                for f in forms:
                    table[f].add(t)
    return {w: tuple(sorted(ts)) for w, ts in sorted(table.items())}


def read_lines(path: PathLike, limit: Optional[int] = None) -> list[list[str]]:
    """Tokenised non-empty lines of a recipe file (first ``limit`` lines)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such recipe file")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            toks = tokenize(line)
            if toks:
                out.append(toks)
                if limit is not None and len(out) >= limit:
                    break
    if not out:
        raise DataError(f"{path}: no text lines")
    return out


@dataclasses.dataclass
class Vocab:
    words: list[str]

    def __post_init__(self):
        self.index = {w: i for i, w in enumerate(self.words)}
        if self.words[:3] != [PAD, UNK, EOS]:
            raise ValueError(f"Vocab must start with {[PAD, UNK, EOS]}, got {self.words[:3]}")

    @classmethod
    def build(cls, lines: Iterable[Sequence[str]], min_count: int = 3) -> "Vocab":
        counts = collections.Counter(w for line in lines for w in line)
        return cls([PAD, UNK, EOS] + sorted(w for w, c in counts.items() if c >= min_count))

    def __len__(self) -> int:
        return len(self.words)

    def __call__(self, word: str) -> int:
        return self.index.get(word, 1)

    def __contains__(self, word: str) -> bool:
        return word in self.index


def encode_lines(
    lines: Sequence[Sequence[str]], vocab: Vocab, length: int, reverse: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Lines -> (ids int32 [N, length + 1], mask int32 [N, length + 1]): ``<eos> w1 .. wn <eos>``
    (``reverse``: the words backwards, for a right-to-left LM), truncated and padded. Position
    t predicts position t + 1."""
    ids = np.zeros((len(lines), length + 1), np.int32)
    mask = np.zeros_like(ids)
    for i, line in enumerate(lines):
        words = list(reversed(line)) if reverse else list(line)
        seq = [vocab(EOS)] + [vocab(w) for w in words] + [vocab(EOS)]
        seq = seq[: length + 1]
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return ids, mask


def split_held_out(
    types: Mapping[str, tuple[str, ...]],
    vocab: Vocab,
    fraction: float,
    seed: int = 0,
    eligible: Optional[Iterable[str]] = None,
) -> set[str]:
    """Words to hold out of the type vocabularies: ``fraction`` of each type's in-vocabulary
    words that have exactly that one type (and are in ``eligible``, e.g. seen in the test set)."""
    rng = np.random.default_rng(seed)
    ok = None if eligible is None else set(eligible)
    held = set()
    for t in sorted({t for ts in types.values() for t in ts}):
        cand = sorted(w for w, ts in types.items() if ts == (t,) and w in vocab and (ok is None or w in ok))
        k = int(round(fraction * len(cand)))
        held |= set(rng.choice(cand, size=k, replace=False).tolist()) if k else set()
    return held


def type_word_ids(
    types: Mapping[str, tuple[str, ...]],
    vocab: Vocab,
    type_names: Sequence[str] = TYPE_NAMES,
    exclude: Iterable[str] = (),
) -> list[list[int]]:
    """Per entity type (in ``type_names`` order) the vocabulary ids of its words, minus
    ``exclude`` and words outside the vocabulary."""
    ex = set(exclude)
    return [sorted(vocab(w) for w, ts in types.items() if t in ts and w in vocab and w not in ex) for t in type_names]
