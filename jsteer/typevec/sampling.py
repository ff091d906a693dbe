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
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
from typing import Iterable, Optional, Sequence

import numpy as np

STRATEGIES = ("weighted", "top", "bottom", "uniform")


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
    n_candidates: int          # distinct single-token entries available
    n_entries: int             # rows in the KG list
    skipped_multi_token: int   # rows whose label is not a single vocabulary token
    skipped_examples: tuple[str, ...]
    first_token: bool = False  # multi-token entries were represented by their first token

    def report(self) -> dict:
        return {"type": self.type_name, "strategy": self.strategy, "seed": self.seed, "first_token": self.first_token,
                "labels": list(self.labels), "token_ids": list(self.token_ids),
                "n_entries": self.n_entries, "n_candidates": self.n_candidates,
                "skipped_multi_token": self.skipped_multi_token,
                "skipped_examples": list(self.skipped_examples)}


def first_token_id(tokenizer, word: str, leading_space: Optional[bool] = None) -> Optional[int]:
    """The first token of ``word`` (leading-space form for space-sensitive vocabularies)."""
    if leading_space is None:
        leading_space = space_sensitive(tokenizer)
    ids = encode_plain(tokenizer, (" " + word.strip()) if leading_space else word.strip())
    return int(ids[0]) if ids and ids[0] != unk_id(tokenizer) else None


def candidates(entries: Sequence[KGEntry], tokenizer, leading_space: Optional[bool] = None,
               exclude_ids: Iterable[int] = (), first_token: bool = False
               ) -> tuple[list[tuple[str, int, float]], list[str]]:
    """Single-token entries merged by token id -> ([(label, id, degree)], skipped labels).

    ``first_token``: use the first token of multi-token entries instead of skipping them (for
    decoders this is the token the next-token prediction is about; e.g. SmolLM2 splits every
    year into digits, so "Year" has no single-token entry at all)."""
    if leading_space is None:
        leading_space = space_sensitive(tokenizer)
    exclude = set(int(i) for i in exclude_ids)
    merged: dict[int, list] = {}
    skipped = []
    for e in entries:
        tid = single_token_id(tokenizer, e.label, leading_space)
        if tid is None and first_token:
            tid = first_token_id(tokenizer, e.label, leading_space)
        if tid is None:
            skipped.append(e.label)
            continue
        if tid in exclude:
            continue
        if tid in merged:
            merged[tid][2] += e.degree
        else:
            merged[tid] = [e.label, tid, e.degree]
    return [tuple(v) for v in merged.values()], skipped


def sample(entries: Sequence[KGEntry], tokenizer, strategy: str = "weighted", n: int = 10, seed: int = 0,
           type_name: str = "", leading_space: Optional[bool] = None,
           exclude_ids: Iterable[int] = (), first_token: bool = False) -> TypeSample:
    """Pick up to ``n`` single-token examples of a type (see module docstring).

    Raises ValueError when no entry is a single vocabulary token (with examples of why)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    cands, skipped = candidates(entries, tokenizer, leading_space, exclude_ids, first_token)
    if not cands:
        raise ValueError(
            f"type {type_name or '?'}: none of the {len(entries)} KG labels is a single token of the vocabulary "
            f"(e.g. {skipped[:5]}); cannot build a type vector (first_token=True uses their first tokens)")
    deg = np.array([c[2] for c in cands], np.float64)
    rng = np.random.default_rng(seed)
    if strategy == "top":
        order = np.argsort(-deg, kind="stable")[:n]
    elif strategy == "bottom":
        order = np.argsort(deg, kind="stable")[:n]
    elif strategy == "uniform":
        order = rng.choice(len(cands), size=min(n, len(cands)), replace=False)
    else:
        positive = np.flatnonzero(deg > 0)
        if positive.size == 0:
            raise ValueError(f"type {type_name or '?'}: every usable entry has degree 0; use strategy='uniform'")
        p = deg[positive] / deg[positive].sum()
        order = positive[rng.choice(positive.size, size=min(n, positive.size), replace=False, p=p)]
    chosen = [cands[i] for i in order]
    return TypeSample(
        type_name=type_name, strategy=strategy, seed=seed,
        labels=tuple(c[0] for c in chosen), token_ids=tuple(int(c[1]) for c in chosen),
        degrees=tuple(float(c[2]) for c in chosen), n_candidates=len(cands), n_entries=len(entries),
        skipped_multi_token=len(skipped), skipped_examples=tuple(skipped[:10]), first_token=first_token)


def sample_type(root: str | pathlib.Path, type_name: str, tokenizer, **kw) -> TypeSample:
    """:func:`sample` on ``root/<type_name>.csv``."""
    return sample(load_kg_samples(kg_path(root, type_name)), tokenizer, type_name=type_name, **kw)


def tokens_from_words(words: Sequence[str], tokenizer, leading_space: Optional[bool] = None) -> tuple[list[int], list[str]]:
    """User-given example words -> (ids of those that are single tokens, words skipped).
    Raises ValueError if none is usable."""
    ids, skipped = [], []
    for w in words:
        tid = single_token_id(tokenizer, w, leading_space)
        (ids.append(tid) if tid is not None else skipped.append(w))
    if not ids:
        raise ValueError(f"no example word is a single token of the vocabulary: {list(words)}")
    return ids, skipped


def type_vectors(embedding, tokenizer, kg_root: str | pathlib.Path, types: Sequence[str], *,
                 strategy: str = "weighted", n: int = 10, seed: int = 0, method: str = "svd"):
    """Sample each type's examples from its KG list and build its vector.

    -> (tes [K, D] jax array, [TypeSample]) in the order of ``types``."""
    import jax.numpy as jnp

    from jsteer.typevec import core

    samples = [sample_type(kg_root, t, tokenizer, strategy=strategy, n=n, seed=seed) for t in types]
    tes = jnp.stack([core.make(embedding, jnp.asarray(s.token_ids), method=method) for s in samples])
    return tes, samples
