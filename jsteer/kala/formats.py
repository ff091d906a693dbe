"""KALA's knowledge files: entity mentions and facts, as JSON Lines.

Mentions file (``*.mentions.jsonl``): one line per example that has mentions::

    {"example": 12, "mentions": [{"text": "European Union", "start": 3, "end": 5, "id": "european union"}]}

- ``example``: the example key. For a CoNLL file, the 0-based index of the sentence in the
  file (``-DOCSTART-`` lines are not sentences); for a SQuAD-format file, the question ``id``.
- ``start``/``end``: the mention span, end exclusive. CoNLL: word indices into the
  sentence; SQuAD: character offsets into the context. ``text`` must equal the span
  (CoNLL: the words joined by one space; SQuAD: ``context[start:end]``) -- checked when the
  examples are given to :func:`read_mentions`.
- Mentions of one example must not overlap (a token belongs to at most one entity).
- ``id``: the entity id (any non-empty string: a Wikidata QID, a normalised surface form,
  ...). Entity ids outside the training vocabulary become the null entity.

Facts file (``facts.jsonl``): one fact per line, entity ids as in mentions files::

    {"h": "european union", "r": "P150", "t": "germany"}

An optional positive integer ``weight`` (default 1) says how often the fact was observed; the
subgraph builder keeps the most heavily weighted neighbours first.

Every problem is a :class:`FormatError` whose message reads ``path:line: field 'x': ...``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Iterable, Mapping, Optional, Sequence, Union

PathLike = Union[str, os.PathLike]
Key = Union[int, str]


class FormatError(ValueError):
    """A malformed mentions / facts file; names the file, the line and the field."""

    def __init__(self, path: PathLike, line: Optional[int], field: Optional[str], message: str):
        self.path, self.line, self.field = str(path), line, field
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{message}")


@dataclasses.dataclass(frozen=True)
class Mention:
    text: str
    start: int
    end: int
    id: str


@dataclasses.dataclass(frozen=True)
class Fact:
    h: str
    r: str
    t: str
    weight: int = 1  # how often the fact was observed (optional in files; ranks neighbours)


def _lines(path: PathLike):
    path = pathlib.Path(path)
    if not path.is_file():
        raise FormatError(path, None, None, "no such file")
    with open(path, encoding="utf-8") as f:
        for ln, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise FormatError(path, ln, None, f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise FormatError(path, ln, None, f"expected a JSON object, got {type(obj).__name__}")
            yield ln, obj


def _field(path, ln, obj: Mapping, name: str, kind, prefix: str = ""):
    if name not in obj:
        raise FormatError(path, ln, prefix + name, "missing")
    v = obj[name]
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if not ok:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise FormatError(path, ln, prefix + name, f"expected {want}, got {json.dumps(v)}")
    if isinstance(v, str) and name != "text" and not v.strip():
        raise FormatError(path, ln, prefix + name, "empty string")
    return v


def first_overlap(mentions: Sequence[Mention]) -> Optional[tuple[int, int]]:
    """Indices (i, j) into ``mentions`` of two overlapping spans, or None when all are disjoint.

    After sorting by (start, end), any overlap shows up between neighbours."""
    order = sorted(range(len(mentions)), key=lambda i: (mentions[i].start, mentions[i].end))
    for i, j in zip(order, order[1:]):
        if mentions[j].start < mentions[i].end:
            return i, j
    return None


def describe(m: Mention) -> str:
    """``'EU rejects' [0:2] (id 'a')``: a mention as error messages name it."""
    return f"{m.text!r} [{m.start}:{m.end}] (id {m.id!r})"


def read_mentions(
    path: PathLike, examples: Optional[Mapping[Key, Union[Sequence[str], str]]] = None
) -> dict[Key, list[Mention]]:
    """Read a mentions file -> {example key: mentions sorted by start}.

    examples: optional {key: words (CoNLL) or context string (SQuAD)} to check keys, spans
    and texts against. Raises :class:`FormatError` on the first problem.
    """
    out: dict[Key, list[Mention]] = {}
    for ln, obj in _lines(path):
        key = _field(path, ln, obj, "example", (int, str))
        if key in out:
            raise FormatError(path, ln, "example", f"example {key!r} appears twice")
        if examples is not None and key not in examples:
            raise FormatError(path, ln, "example", f"no example {key!r} in the data ({len(examples)} examples)")
        ms = _field(path, ln, obj, "mentions", list)
        parsed = []
        for k, m in enumerate(ms):
            pre = f"mentions[{k}]."
            if not isinstance(m, dict):
                raise FormatError(path, ln, f"mentions[{k}]", f"expected an object, got {json.dumps(m)}")
            text = _field(path, ln, m, "text", str, pre)
            start = _field(path, ln, m, "start", int, pre)
            end = _field(path, ln, m, "end", int, pre)
            eid = _field(path, ln, m, "id", str, pre)
            if start < 0:
                raise FormatError(path, ln, pre + "start", f"negative start {start}")
            if end <= start:
                raise FormatError(path, ln, pre + "end", f"end {end} must be greater than start {start}")
            if examples is not None:
                ex = examples[key]
                if end > len(ex):
                    unit = "characters" if isinstance(ex, str) else "words"
                    raise FormatError(path, ln, pre + "end", f"end {end} is past the example's {len(ex)} {unit}")
                span = ex[start:end] if isinstance(ex, str) else " ".join(ex[start:end])
                if span != text:
                    raise FormatError(
                        path, ln, pre + "text", f"{text!r} does not match the span [{start}:{end}] = {span!r}"
                    )
            parsed.append(Mention(text=text, start=start, end=end, id=eid))
        clash = first_overlap(parsed)
        if clash is not None:
            i, j = clash
            raise FormatError(
                path,
                ln,
                "mentions",
                f"mentions[{i}] {describe(parsed[i])} and mentions[{j}] "
                f"{describe(parsed[j])} overlap (a token can belong to one mention only)",
            )
        out[key] = sorted(parsed, key=lambda m: (m.start, m.end))
    return out


def read_facts(path: PathLike) -> list[Fact]:
    """Read a facts file -> list of (h, r, t). Raises :class:`FormatError` on the first problem."""
    out = []
    for ln, obj in _lines(path):
        h, r, t = (_field(path, ln, obj, k, str) for k in ("h", "r", "t"))
        w = _field(path, ln, obj, "weight", int) if "weight" in obj else 1
        if w < 1:
            raise FormatError(path, ln, "weight", f"must be a positive integer, got {w}")
        out.append(Fact(h=h, r=r, t=t, weight=w))
    return out


def write_mentions(path: PathLike, mentions: Mapping[Key, Sequence[Mention]]) -> None:
    """Write {example key: mentions}; examples without mentions are left out."""
    with open(path, "w", encoding="utf-8") as f:
        for key, ms in mentions.items():
            if ms:
                f.write(
                    json.dumps({"example": key, "mentions": [dataclasses.asdict(m) for m in ms]}, ensure_ascii=False)
                    + "\n"
                )


def write_facts(path: PathLike, facts: Iterable[Fact]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for fact in facts:
            d = dataclasses.asdict(fact)
            if d["weight"] == 1:
                del d["weight"]
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
