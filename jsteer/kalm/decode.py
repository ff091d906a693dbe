"""Unsupervised typing with KALM: combine context type distributions with type priors.

For a word y_t in context, KALM gives P(type_t | c_<t) (the forward model's prediction before
seeing the word) and, from a model trained right-to-left, P(type_t | c_>t). The knowledge base
gives a type prior P(type | y). Assuming the three are conditionally independent given the
type (a product of experts), the type posterior is::

    P(type = j | c_<t, c_>t, y_t)  ∝  P(j | c_<t) P(j | c_>t) P(j | y_t) / P(j)^(n_ctx - 1)

where P(j) is the model's average type distribution (:func:`jsteer.kalm.train.mean_type_distribution`)
and n_ctx the number of context directions used. :func:`decode_types` returns the best
entity type (1..K, type 0 -- "general word" -- excluded, since the words typed here are known
to be ingredient mentions).

:func:`type_prior` builds log P(type | word) [V, K+1] from the typed lexicon: a word of the
type vocabularies spreads its mass uniformly over its types (``smoothing`` on every other
type); any other word -- in particular a word whose lexicon entry was held out -- gets the
uniform prior, so it is typed from context alone.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from jsteer.kalm.data import TYPE_NAMES, Vocab


def type_prior(
    vocab: Vocab,
    types: Mapping[str, tuple[str, ...]],
    type_names: Sequence[str] = TYPE_NAMES,
    exclude: Sequence[str] = (),
    smoothing: float = 0.01,
) -> np.ndarray:
    """log P(type | word) [V, K+1] (column 0 = the general type; see the module docstring)."""
    k = len(type_names)
    col = {t: j + 1 for j, t in enumerate(type_names)}
    prior = np.full((len(vocab), k + 1), 1.0 / (k + 1))
    ex = set(exclude)
    for w, ts in types.items():
        if w in vocab and w not in ex:
            row = np.full(k + 1, smoothing)
            for t in ts:
                row[col[t]] = 1.0
            prior[vocab(w)] = row / row.sum()
    return np.log(prior)


def decode_types(
    context_logp: Sequence[np.ndarray],
    prior_logp: Optional[np.ndarray] = None,
    marginal_logp: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Best entity type per word.

    context_logp: list of [..., K+1] log P(type | one context direction) for the same words.
    prior_logp: [..., K+1] log P(type | word) or None. marginal_logp: [K+1] log P(type) or None
    (no correction). Returns int [...] in 1..K.
    """
    if not context_logp:
        raise ValueError("decode_types needs at least one context distribution")
    score = sum(np.asarray(c, np.float64) for c in context_logp)
    if prior_logp is not None:
        score = score + prior_logp
    if marginal_logp is not None and len(context_logp) > 1:
        score = score - (len(context_logp) - 1) * np.asarray(marginal_logp)
    return 1 + np.argmax(score[..., 1:], axis=-1)


def word_positions(
    lines: Sequence[Sequence[str]], words: Mapping[str, int], length: int
) -> list[tuple[int, int, int, int]]:
    """Occurrences of ``words`` ({word: gold type 1..K}) within the first ``length - 1`` words
    of each line: [(line, position of the word's forward prediction, of its backward
    prediction, gold type)], for arrays from :func:`jsteer.kalm.data.encode_lines` (forward:
    the word at index i is predicted at position i; backward, reversed: at n - 1 - i)."""
    out = []
    for li, line in enumerate(lines):
        n = len(line)
        if n > length - 1:  # keep both directions untruncated
            continue
        for i, w in enumerate(line):
            if w in words:
                out.append((li, i, n - 1 - i, words[w]))
    return out
