"""Choosing the example tokens that define a type, from a degree-weighted KG list.

The lists are ``../shared/data/type_embedding/kg_samples/<Type>.csv`` with columns
``Label,URI,Indegree,Outdegree,Degree``. Only labels that are a *single* token of the
model's vocabulary are usable (the paper looks each label up in the vocabulary); for
space-sensitive (byte-level BPE) vocabularies the single token must be the form with a
leading space (" London"), which is how the word appears after "born in".

Strategies (the paper's): ``weighted`` (default: 10 labels drawn without replacement with
probability proportional to KG degree), ``top`` / ``bottom`` (10 highest / lowest degree),
``uniform`` (10 drawn uniformly). Labels that map to the same token are merged (their
degrees summed), so a token is never drawn twice.

A token that decodes to whitespace or punctuation only (no letter or digit) is never an
example: e.g. SmolLM2 writes " 1985" as " " + "1" + "9" + "8" + "5", and the " " token says
nothing about years. When fewer distinct tokens than requested are usable,
:class:`FewExamplesWarning` is issued, and below ``min_examples`` sampling fails.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
import warnings
from typing import Iterable, Optional, Sequence

import numpy as np

STRATEGIES = ("weighted", "top", "bottom", "uniform")
MIN_EXAMPLES = 2  # one token is that word, not a type (SmolLM2's "Group" has only 2 usable)


class FewExamplesWarning(UserWarning):
    """A type vector is built from fewer distinct example tokens than were asked for."""


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (jsteer Tokenizer or tokenizers.Tokenizer)."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def unk_id(tokenizer) -> Optional[int]:
    for name in ("unk_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    tid = getattr(tokenizer, "token_to_id", None)
    if tid is not None:
        for tok in ("[UNK]", "<unk>"):
            v = tid(tok)
            if v is not None:
                return int(v)
    return None


def decode_token(tokenizer, token_id: int) -> str:
    """The text of one token (special tokens decode to "" with a jsteer Tokenizer)."""
    return tokenizer.decode([int(token_id)])


def is_word_token(tokenizer, token_id: int) -> bool:
    """True when the token's text holds a letter or digit (not whitespace / punctuation only)."""
    return any(ch.isalnum() for ch in decode_token(tokenizer, token_id))


def space_sensitive(tokenizer) -> bool:
    """True for vocabularies where " word" and "word" are different tokens (byte-level BPE)."""
    return encode_plain(tokenizer, " the") != encode_plain(tokenizer, "the")


def single_token_id(tokenizer, word: str, leading_space: Optional[bool] = None) -> Optional[int]:
    """The id of ``word`` if it is exactly one (non-[UNK]) token, else None.

    leading_space: use " word" (None: decide with :func:`space_sensitive`)."""
    if leading_space is None:
        leading_space = space_sensitive(tokenizer)
    word = word.strip()
    if not word:
        return None
    ids = encode_plain(tokenizer, (" " + word) if leading_space else word)
    if len(ids) != 1 or ids[0] == unk_id(tokenizer):
        return None
    return int(ids[0])


@dataclasses.dataclass(frozen=True)
class KGEntry:
    label: str
    degree: float


def load_kg_samples(path: str | pathlib.Path) -> list[KGEntry]:
    """Read one KG list CSV (Label, ..., Degree). Blank labels are dropped; a missing or
    non-numeric degree is an error naming the file and line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"KG sample list not found: {path}")
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for col in ("Label", "Degree"):
            if reader.fieldnames is None or col not in reader.fieldnames:
                raise ValueError(f"{path}: missing column {col!r} (header: {reader.fieldnames})")
        for line, row in enumerate(reader, start=2):
            label = (row["Label"] or "").strip()
            if not label or label.lower() == "nan":
                continue
            try:
                degree = float(row["Degree"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: field Degree is not a number: {row['Degree']!r}") from None
            if not math.isfinite(degree) or degree < 0:
                raise ValueError(f"{path}:{line}: field Degree must be a finite non-negative number, got {degree}")
            out.append(KGEntry(label, degree))
    return out


def kg_path(root: str | pathlib.Path, type_name: str) -> pathlib.Path:
    """kg_samples/<Type>.csv; accepts "TV Network" for the file "TV_Network.csv"."""
    root = pathlib.Path(root)
    for cand in (type_name, type_name.replace(" ", "_"), type_name.replace("_", " ")):
        p = root / f"{cand}.csv"
        if p.is_file():
            return p
    raise FileNotFoundError(f"no KG list for type {type_name!r} under {root}")


@dataclasses.dataclass(frozen=True)
class TypeSample:
    """The tokens chosen for one type, with what was left out and why."""

    type_name: str
    strategy: str
    seed: int
    labels: tuple[str, ...]
    token_ids: tuple[int, ...]
    degrees: tuple[float, ...]
    n_candidates: int  # distinct single-token entries available
    n_entries: int  # rows in the KG list
    skipped_multi_token: int  # rows whose label is not a single vocabulary token
    skipped_examples: tuple[str, ...]
    first_token: bool = False  # multi-token entries were represented by their first word token
    tokens: tuple[str, ...] = ()  # the decoded example tokens actually used (one per token id)
    n_requested: int = 0  # examples asked for (len(token_ids) may be smaller)
    skipped_non_word: int = 0  # rows whose token is whitespace / punctuation only

    def report(self) -> dict:
        return {
            "type": self.type_name,
            "strategy": self.strategy,
            "seed": self.seed,
            "first_token": self.first_token,
            "tokens": list(self.tokens),
            "token_ids": list(self.token_ids),
            "labels": list(self.labels),
            "n_requested": self.n_requested,
            "n_used": len(self.token_ids),
            "n_entries": self.n_entries,
            "n_candidates": self.n_candidates,
            "skipped_multi_token": self.skipped_multi_token,
            "skipped_non_word": self.skipped_non_word,
            "skipped_examples": list(self.skipped_examples),
        }


def first_token_id(tokenizer, word: str, leading_space: Optional[bool] = None) -> Optional[int]:
    """The first *word* token of ``word`` (leading-space form for space-sensitive vocabularies):
    leading whitespace / punctuation-only tokens are passed over (SmolLM2's " 1985" ->
    " ", "1", ... gives "1"). None when no token is a word token or it is [UNK]."""
    if leading_space is None:
        leading_space = space_sensitive(tokenizer)
    ids = encode_plain(tokenizer, (" " + word.strip()) if leading_space else word.strip())
    for i in ids:
        if i == unk_id(tokenizer):
            return None
        if is_word_token(tokenizer, i):
            return int(i)
    return None


SKIP_MULTI = "not a single token"
SKIP_NON_WORD = "whitespace / punctuation-only token"


def candidates(
    entries: Sequence[KGEntry],
    tokenizer,
    leading_space: Optional[bool] = None,
    exclude_ids: Iterable[int] = (),
    first_token: bool = False,
) -> tuple[list[tuple[str, int, float]], dict[str, list[str]]]:
    """Usable entries merged by token id -> ([(label, id, degree)], {reason: skipped labels}).

    An entry is usable when its label is a single word token (:func:`is_word_token`).
    ``first_token``: use the first word token of multi-token entries instead of skipping them
    (for decoders the answer starts there; e.g. SmolLM2 splits every year into digits, so
    "Year" has no single-token entry at all)."""
    if leading_space is None:
        leading_space = space_sensitive(tokenizer)
    exclude = set(int(i) for i in exclude_ids)
    merged: dict[int, list] = {}
    skipped: dict[str, list[str]] = {SKIP_MULTI: [], SKIP_NON_WORD: []}
    word_cache: dict[int, bool] = {}
    for e in entries:
        tid = single_token_id(tokenizer, e.label, leading_space)
        if tid is None and first_token:
            tid = first_token_id(tokenizer, e.label, leading_space)
        if tid is None:
            skipped[SKIP_MULTI].append(e.label)
            continue
        if tid not in word_cache:
            word_cache[tid] = is_word_token(tokenizer, tid)
        if not word_cache[tid]:
            skipped[SKIP_NON_WORD].append(e.label)
            continue
        if tid in exclude:
            continue
        if tid in merged:
            merged[tid][2] += e.degree
        else:
            merged[tid] = [e.label, tid, e.degree]
    return [tuple(v) for v in merged.values()], skipped


def sample(
    entries: Sequence[KGEntry],
    tokenizer,
    strategy: str = "weighted",
    n: int = 10,
    seed: int = 0,
    type_name: str = "",
    leading_space: Optional[bool] = None,
    exclude_ids: Iterable[int] = (),
    first_token: bool = False,
    min_examples: int = MIN_EXAMPLES,
) -> TypeSample:
    """Pick up to ``n`` distinct single-word-token examples of a type (see module docstring).

    Fewer than ``n`` usable: :class:`FewExamplesWarning`; fewer than ``min(n, min_examples)``
    (none at all, in particular): ValueError naming the type and why entries were skipped."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    name = type_name or "?"
    cands, skipped = candidates(entries, tokenizer, leading_space, exclude_ids, first_token)
    why = (
        f"{len(skipped[SKIP_MULTI])} not a single token (e.g. {skipped[SKIP_MULTI][:5]}), "
        f"{len(skipped[SKIP_NON_WORD])} whitespace / punctuation only (e.g. {skipped[SKIP_NON_WORD][:5]})"
    )
    hint = "" if first_token else "; first_token=True uses the first word token of multi-token labels"
    if not cands:
        raise ValueError(
            f"type {name}: none of the {len(entries)} KG labels is a single word token of the "
            f"vocabulary ({why}); cannot build a type vector{hint}"
        )
    order = _draw(cands, strategy, n, seed, name)
    chosen = [cands[i] for i in order]
    need = min(n, min_examples)
    if len(chosen) < need:
        raise ValueError(
            f"type {name}: only {len(chosen)} distinct example token(s) usable, at least {need} "
            f"needed for a type vector ({why}){hint}"
        )
    if len(chosen) < n:
        warnings.warn(
            f"type {name}: {len(chosen)} distinct example tokens used, {n} requested "
            f"({len(cands)} usable of {len(entries)} KG labels; {why})",
            FewExamplesWarning,
            stacklevel=2,
        )
    skipped_all = skipped[SKIP_MULTI] + skipped[SKIP_NON_WORD]
    return TypeSample(
        type_name=type_name,
        strategy=strategy,
        seed=seed,
        labels=tuple(c[0] for c in chosen),
        token_ids=tuple(int(c[1]) for c in chosen),
        degrees=tuple(float(c[2]) for c in chosen),
        n_candidates=len(cands),
        n_entries=len(entries),
        skipped_multi_token=len(skipped[SKIP_MULTI]),
        skipped_examples=tuple(skipped_all[:10]),
        first_token=first_token,
        tokens=tuple(decode_token(tokenizer, c[1]) for c in chosen),
        n_requested=n,
        skipped_non_word=len(skipped[SKIP_NON_WORD]),
    )


def _draw(cands: Sequence[tuple[str, int, float]], strategy: str, n: int, seed: int, name: str) -> np.ndarray:
    """Indices of up to ``n`` candidates chosen by ``strategy``."""
    deg = np.array([c[2] for c in cands], np.float64)
    rng = np.random.default_rng(seed)
    if strategy == "top":
        return np.argsort(-deg, kind="stable")[:n]
    if strategy == "bottom":
        return np.argsort(deg, kind="stable")[:n]
    if strategy == "uniform":
        return rng.choice(len(cands), size=min(n, len(cands)), replace=False)
    positive = np.flatnonzero(deg > 0)
    if positive.size == 0:
        raise ValueError(f"type {name}: every usable entry has degree 0; use strategy='uniform'")
    p = deg[positive] / deg[positive].sum()
    return positive[rng.choice(positive.size, size=min(n, positive.size), replace=False, p=p)]


def sample_type(root: str | pathlib.Path, type_name: str, tokenizer, **kw) -> TypeSample:
    """:func:`sample` on ``root/<type_name>.csv``."""
    return sample(load_kg_samples(kg_path(root, type_name)), tokenizer, type_name=type_name, **kw)


def tokens_from_words(
    words: Sequence[str], tokenizer, leading_space: Optional[bool] = None
) -> tuple[list[int], list[str]]:
    """User-given example words -> (ids of those that are single word tokens, words skipped).
    Raises ValueError if none is usable."""
    ids, skipped = [], []
    for w in words:
        tid = single_token_id(tokenizer, w, leading_space)
        ok = tid is not None and is_word_token(tokenizer, tid) and tid not in ids
        (ids.append(tid) if ok else skipped.append(w))
    if not ids:
        raise ValueError(
            f"no example word is a single token of the vocabulary (that is not whitespace / punctuation "
            f"only): {list(words)}"
        )
    return ids, skipped


def type_vectors(embedding, tokenizer, kg_root: str | pathlib.Path, types: Sequence[str], **options):
    """Sample each type's examples from its KG list and build its vector (``options``:
    :func:`available_type_vectors`' strategy, n, seed, method, first_token).

    -> (tes [K, D] jax array, [TypeSample]) in the order of ``types``; any type that fails is
    an error (:func:`available_type_vectors` skips them instead)."""
    if not len(types):
        raise ValueError("type_vectors: no types given (need at least one type name with a KG list)")
    vecs, samples, missing = available_type_vectors(embedding, tokenizer, kg_root, types, **options)
    if missing:
        raise ValueError("; ".join(missing.values()))
    import jax.numpy as jnp

    return jnp.stack([vecs[t] for t in types]), [samples[t] for t in types]


def available_type_vectors(
    embedding,
    tokenizer,
    kg_root: str | pathlib.Path,
    types: Sequence[str],
    *,
    strategy: str = "weighted",
    n: int = 10,
    seed: int = 0,
    method: str = "svd",
    first_token: bool = False,
):
    """Like :func:`type_vectors`, but a type without a KG list or without enough usable
    examples is skipped. -> ({type: TE [D]}, {type: TypeSample}, {type: why it was skipped})."""
    import jax.numpy as jnp

    from jsteer.typevec import core

    vecs, samples, missing = {}, {}, {}
    for t in types:
        try:
            s = sample_type(kg_root, t, tokenizer, strategy=strategy, n=n, seed=seed, first_token=first_token)
        except (ValueError, FileNotFoundError) as e:
            missing[t] = str(e)
            continue
        samples[t] = s
        vecs[t] = core.make(embedding, jnp.asarray(s.token_ids), method=method)
    return vecs, samples, missing
