"""Plain parsers for the data formats jsteer trains on; every problem names file and line.

Each reader returns a list of small frozen records carrying ``source`` (the file) and
``line`` (1-based line where the record starts), so later stages can still point at the
input. Nothing is dropped silently: a malformed line, a label outside the label set, an
empty file or a byte that is not UTF-8 raises :class:`DataError`.

Formats:
  * CoNLL-style ``token ... tag`` columns, blank line between sentences, optional
    ``-DOCSTART-`` lines (CoNLL-2003 4 columns IOB1; NCBI-Disease ``token<TAB>tag`` IOB2).
  * Labeled text: JSON lines (SST-5), CSV (Jigsaw), plain text one example a line.
  * LAMA: raw JSON lines (T-REx and Google-RE schemas), ``relations.jsonl`` templates, and
    the type-grouped cloze CSVs ``synth_<Type>/<corpus>/<relation>.csv``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import pathlib
import re
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

from jsteer.data import ner as ner_lib

PathLike = Union[str, os.PathLike]
MASK = "[MASK]"


class DataError(ValueError):
    """A problem in an input file; ``str()`` reads ``path:line: message``."""

    def __init__(self, path: PathLike, line: Optional[int], message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


# ----------------------------------------------------------------------------- text access


def read_text(path: PathLike) -> str:
    """Whole file as str: strict UTF-8 (a leading BOM is dropped), CRLF -> LF.

    Raises DataError for a missing or empty (or whitespace-only) file and for the first
    invalid UTF-8 byte, naming its line and column.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataError(path, None, "no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(path, line, f"invalid UTF-8 byte 0x{data[e.start]:02x} at column {col}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise DataError(path, None, "file is empty")
    return text


def iter_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without newline) over a checked file."""
    text = read_text(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    yield from enumerate(lines, 1)


def json_object(path: PathLike, ln: int, line: str, show: bool = False) -> dict:
    """Line ``ln`` of a JSON-lines file parsed; a DataError naming file and line when it is not
    JSON or not an object (``show``: quoting the line)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(path, ln, f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(rec, dict):
        raise DataError(path, ln, "JSON line is not an object" + (f": {line!r}" if show else ""))
    return rec


# ----------------------------------------------------------------------------- CoNLL


@dataclasses.dataclass(frozen=True)
class TaggedSentence:
    tokens: tuple[str, ...]
    tags: tuple[str, ...]
    source: str
    line: int  # line of the first token
    doc: int = 0  # document index (documents are separated by -DOCSTART- lines; 0 when none)


def read_conll(
    path: PathLike,
    *,
    token_column: int = 0,
    tag_column: Optional[int] = -1,
    delimiter: Optional[str] = None,
    scheme: Optional[str] = None,
    label_set: Optional[Sequence[str]] = None,
) -> list[TaggedSentence]:
    """Parse a CoNLL-style column file into sentences.

    Args:
      tag_column: the tags' column; None reads tokens only (every sentence's ``tags`` is
        ``()``): no tag is read, so the file may be unlabeled, one column (tokens) or more.
      delimiter: column separator; None splits on any whitespace.
      scheme: None (tags are opaque strings), ``"iob1"`` (checked, converted to IOB2) or
        ``"iob2"`` (checked: every entity opens with ``B-``).
      label_set: allowed tags (after conversion); any other tag is an error.

    Every token line must have the same number of columns as the file's first token line
    (at least 2, or 1 when reading tokens only). ``-DOCSTART-`` lines start a new document
    and are not sentences. Tokens-only reading gives the same sentences, lines and documents
    as reading the labeled file.
    """
    if scheme not in (None, "iob1", "iob2"):
        raise ValueError(f"scheme must be None, 'iob1' or 'iob2', got {scheme!r}")
    tagged = tag_column is not None
    if not tagged and (scheme is not None or label_set is not None):
        raise ValueError("scheme and label_set check tags: they need a tag_column")
    columns = {"token_column": token_column, **({"tag_column": tag_column} if tagged else {})}
    allowed = None if label_set is None else frozenset(label_set)
    out: list[TaggedSentence] = []
    ncols: Optional[int] = None
    tokens: list[str] = []
    tags: list[str] = []
    tag_lines: list[int] = []
    start = 0
    doc = 0
    doc_has_sentences = False

    def flush() -> None:
        nonlocal tokens, tags, tag_lines
        if not tokens:
            return
        final = list(tags)
        if scheme is not None:
            for t, ln in zip(tags, tag_lines):
                try:
                    ner_lib.split_tag(t)
                except ValueError as e:
                    raise DataError(path, ln, str(e)) from None
            if scheme == "iob1":
                final = ner_lib.iob1_to_iob2(tags)
            else:
                bad = ner_lib.iob2_violation(tags)
                if bad is not None:
                    raise DataError(
                        path, tag_lines[bad], f"tag {tags[bad]!r} continues no entity (IOB2 needs B- first)"
                    )
        if allowed is not None:
            for t, ln in zip(final, tag_lines):
                if t not in allowed:
                    raise DataError(path, ln, f"label {t!r} not in label set {sorted(allowed)}")
        out.append(TaggedSentence(tuple(tokens), tuple(final), str(path), start, doc))
        tokens, tags, tag_lines = [], [], []

    for ln, line in iter_lines(path):
        if not line.strip():
            flush()
            continue
        cols = line.split(delimiter) if delimiter is not None else line.split()
        if cols[0] == "-DOCSTART-":
            flush()
            # A boundary between documents (files may put it before or after each one).
            if doc_has_sentences:
                doc += 1
                doc_has_sentences = False
            continue
        if ncols is None:
            if tagged and len(cols) < 2:
                raise DataError(path, ln, f"malformed line {line!r}: need at least 2 columns (token and tag)")
            _check_columns(path, ln, line, len(cols), **columns)
            ncols = len(cols)
        elif len(cols) != ncols:
            raise DataError(path, ln, f"malformed line {line!r}: {len(cols)} columns, file started with {ncols}")
        if any(c == "" for c in cols):
            raise DataError(path, ln, f"malformed line {line!r}: empty column")
        if not tokens:
            start = ln
            doc_has_sentences = True
        tokens.append(cols[token_column])
        if tagged:
            tags.append(cols[tag_column])
            tag_lines.append(ln)
    flush()
    if not out:
        raise DataError(path, None, "no sentences found")
    return out


def _check_columns(path, ln, line: str, ncols: int, **columns: int) -> None:
    """Each ``name=index`` of ``columns`` must index a line of ``ncols`` columns."""
    for name, col in columns.items():
        if not -ncols <= col < ncols:
            raise DataError(path, ln, f"{name}={col} is outside the {ncols} columns of line {line!r}")


# ----------------------------------------------------------------------------- labeled text


@dataclasses.dataclass(frozen=True)
class LabeledText:
    text: str
    label: str
    source: str
    line: int


def _check_label(path, ln, label: str, allowed) -> str:
    if allowed is not None and label not in allowed:
        raise DataError(path, ln, f"label {label!r} not in label set {sorted(allowed)}")
    return label


def _check_text(path, ln, text) -> str:
    if not isinstance(text, str):
        raise DataError(path, ln, f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise DataError(path, ln, "empty text")
    return text


def _label_str(path, ln, label) -> str:
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise DataError(path, ln, f"label must be a string or integer, got {label!r}")
    return str(label)


def read_jsonl_labeled(
    path: PathLike,
    *,
    text_field: str = "sentence",
    label_field: str = "label",
    label_set: Optional[Sequence[str]] = None,
) -> list[LabeledText]:
    """JSON lines with a text and a label field (SST-5: ``{"sentence", "label"}``)."""
    allowed = None if label_set is None else frozenset(label_set)
    out = []
    for ln, line in iter_lines(path):
        if not line.strip():
            raise DataError(path, ln, "empty line in JSON lines file")
        rec = json_object(path, ln, line)
        for f in (text_field, label_field):
            if f not in rec:
                raise DataError(path, ln, f"missing field {f!r} (has {sorted(rec)})")
        text = _check_text(path, ln, rec[text_field])
        label = _check_label(path, ln, _label_str(path, ln, rec[label_field]), allowed)
        out.append(LabeledText(text, label, str(path), ln))
    return out


def read_csv_labeled(
    path: PathLike,
    *,
    text_column: Union[int, str] = 0,
    label_column: Union[int, str] = 1,
    header: bool = False,
    label_set: Optional[Sequence[str]] = None,
) -> list[LabeledText]:
    """CSV rows with text and label columns (Jigsaw subset: ``text,label``, no header).

    Columns are indices, or names when ``header``. Quoted fields may span lines; ``line`` is
    the row's first line.
    """
    allowed = None if label_set is None else frozenset(label_set)
    rows = read_csv_rows(path)
    names: Optional[list[str]] = None
    if header:
        names = rows[0][1]
        rows = rows[1:]
    ncols = len(names) if names is not None else (len(rows[0][1]) if rows else 0)
    ti, li = (_col_index(path, c, names) for c in (text_column, label_column))
    out = []
    for ln, row in rows:
        if not row:
            raise DataError(path, ln, "empty CSV row")
        if len(row) != ncols:
            raise DataError(path, ln, f"malformed CSV row: {len(row)} fields, expected {ncols}")
        if max(ti, li) >= len(row):
            raise DataError(path, ln, f"row has {len(row)} fields, needs column {max(ti, li)}")
        t = _check_text(path, ln, row[ti])
        lab = row[li].strip()
        if not lab:
            raise DataError(path, ln, "empty label")
        out.append(LabeledText(t, _check_label(path, ln, lab, allowed), str(path), ln))
    if not out:
        raise DataError(path, None, "no rows found")
    return out


def _col_index(path, col, names) -> int:
    if isinstance(col, int):
        return col
    if names is None:
        raise ValueError(f"column {col!r} given by name but header=False")
    if col not in names:
        raise DataError(path, 1, f"header has no column {col!r} (has {names})")
    return names.index(col)


def read_text_files_labeled(
    files: Mapping[str, PathLike], *, label_set: Optional[Sequence[str]] = None
) -> list[LabeledText]:
    """Plain text files, one example a line, every line labelled with its file's label.

    ``files``: ``{label: path}``. A blank line is an error (it would be an empty example).
    """
    allowed = None if label_set is None else frozenset(label_set)
    out = []
    for label, path in files.items():
        for ln, line in iter_lines(path):
            lab = _check_label(path, ln, str(label), allowed)
            out.append(LabeledText(_check_text(path, ln, line), lab, str(path), ln))
    return out


# ----------------------------------------------------------------------------- LAMA

# LAMA's Google-RE templates (the relation files carry no template of their own).
GOOGLE_RE_TEMPLATES = {
    "place_of_birth": "[X] was born in [Y] .",
    "date_of_birth": "[X] (born [Y]).",
    "place_of_death": "[X] died in [Y] .",
}


@dataclasses.dataclass(frozen=True)
class LamaFact:
    relation: str  # "P19", or "place_of_birth" for Google-RE
    sub_label: str
    obj_label: str
    masked_sentences: tuple[str, ...]  # evidence sentences with [MASK] at the object
    uuid: str
    source: str
    line: int

    def prompt(self, template: str, mask: str = MASK) -> str:
        """Cloze prompt from a template with ``[X]`` (subject) and ``[Y]`` (object)."""
        return template.replace("[X]", self.sub_label).replace("[Y]", mask)


def read_lama_relations(path: PathLike) -> dict[str, str]:
    """``relations.jsonl`` -> ``{relation: template}``; templates need ``[X]`` and ``[Y]``."""
    out = {}
    for ln, line in iter_lines(path):
        rec = json_object(path, ln, line, show=True)
        for f in ("relation", "template"):
            if f not in rec:
                raise DataError(path, ln, f"missing field {f!r}")
            if not isinstance(rec[f], str):
                raise DataError(path, ln, f"field {f!r} must be a string, got {rec[f]!r}")
        if "[X]" not in rec["template"] or "[Y]" not in rec["template"]:
            raise DataError(path, ln, f"template {rec['template']!r} lacks [X] or [Y]")
        out[rec["relation"]] = rec["template"]
    return out


def lama_file_relation(path: PathLike) -> str:
    """The relation of a LAMA fact file, one file per relation: its stem without ``_test``
    (``TREx/P19.jsonl`` -> ``P19``, ``Google_RE/place_of_birth_test.jsonl`` -> ``place_of_birth``)."""
    stem = pathlib.Path(path).stem
    return stem[: -len("_test")] if stem.endswith("_test") else stem


def read_lama_jsonl(path: PathLike, relation: Optional[str] = None) -> list[LamaFact]:
    """Raw LAMA facts. T-REx lines carry ``predicate_id`` and ``evidences[].masked_sentence``;
    Google-RE lines carry ``pred`` (``/people/person/place_of_birth``) and
    ``masked_sentences``. Both need ``sub_label`` and ``obj_label``; blank lines are skipped.

    ``relation``: the file's relation (:func:`lama_file_relation`), given to every fact, as
    LAMA's own loader does; then a line needs neither ``predicate_id`` nor ``pred``."""
    out = []
    for ln, line in iter_lines(path):
        if not line.strip():
            continue
        rec = json_object(path, ln, line)
        for f in ("sub_label", "obj_label"):
            if not isinstance(rec.get(f), str) or not rec[f]:
                raise DataError(path, ln, f"missing or empty field {f!r}")
        rel = relation
        if "predicate_id" in rec:
            rel = rel or _string_field(path, ln, rec, "predicate_id")
            sents = [_evidence_sentence(path, ln, e) for e in _list_field(path, ln, rec, "evidences")]
        elif "pred" in rec:
            rel = rel or _string_field(path, ln, rec, "pred").rstrip("/").rsplit("/", 1)[-1]
            sents = _list_field(path, ln, rec, "masked_sentences")
        elif relation is not None:
            sents = _list_field(path, ln, rec, "masked_sentences")
        else:
            raise DataError(path, ln, "neither 'predicate_id' (T-REx) nor 'pred' (Google-RE) present")
        for s in sents:
            if not isinstance(s, str):
                raise DataError(path, ln, f"masked sentence must be a string, got {s!r}")
        out.append(
            LamaFact(rel, rec["sub_label"], rec["obj_label"], tuple(sents), str(rec.get("uuid", "")), str(path), ln)
        )
    return out


def _string_field(path, ln, rec: Mapping, field: str) -> str:
    if not isinstance(rec[field], str):
        raise DataError(path, ln, f"field {field!r} must be a string, got {rec[field]!r}")
    return rec[field]


def _list_field(path, ln, rec: Mapping, field: str) -> list:
    """``rec[field]`` (absent: empty), which must be a JSON list."""
    value = rec.get(field, [])
    if not isinstance(value, list):
        raise DataError(path, ln, f"field {field!r} must be a list, got {value!r}")
    return value


def _evidence_sentence(path, ln, evidence):
    """``masked_sentence`` of one T-REx evidence (checked to be a string by the caller)."""
    if not isinstance(evidence, dict):
        raise DataError(path, ln, f"each of 'evidences' must be an object with 'masked_sentence', got {evidence!r}")
    return evidence.get("masked_sentence")


@dataclasses.dataclass(frozen=True)
class TypedPrompt:
    sent: str  # cloze sentence with exactly one [MASK]
    gold: str
    type_name: str  # expected answer type, e.g. "City"
    relation: str  # e.g. "P19" or "place_of_birth"
    corpus: str  # "TREx" or "Google_RE"
    source: str
    line: int


_TYPED_PATH = re.compile(r"synth_(?P<type>[^/]+)/(?P<corpus>[^/]+)/(?P<rel>[^/]+)\.csv$")


def read_typed_lama_csv(
    path: PathLike,
    *,
    type_name: Optional[str] = None,
    corpus: Optional[str] = None,
    relation: Optional[str] = None,
    check_prompts: bool = True,
) -> list[TypedPrompt]:
    """One type-grouped LAMA CSV (columns ``sent,gold,filename``, optionally a leading index).

    Type, corpus and relation come from the path ``synth_<Type>/<corpus>/<relation>.csv``
    unless given. Each ``sent`` must hold exactly one ``[MASK]`` and each gold be non-empty,
    unless ``check_prompts`` is False (rows kept as written, for a consumer that counts them).
    """
    m = _TYPED_PATH.search(pathlib.Path(path).as_posix())
    if m is None and None in (type_name, corpus, relation):
        raise DataError(path, None, "path is not synth_<Type>/<corpus>/<relation>.csv; pass type_name/corpus/relation")
    type_name = type_name or m.group("type")
    corpus = corpus or m.group("corpus")
    relation = relation or m.group("rel")
    if relation.endswith("_test"):
        relation = relation[: -len("_test")]
    rows = read_csv_rows(path)
    header, body = rows[0], rows[1:]
    names = header[1]
    for need in ("sent", "gold"):
        if need not in names:
            raise DataError(path, header[0], f"header has no column {need!r} (has {names})")
    si, gi = names.index("sent"), names.index("gold")
    out = []
    for ln, row in body:
        if len(row) != len(names):
            raise DataError(path, ln, f"malformed CSV row: {len(row)} fields, header has {len(names)}")
        sent, gold = row[si], row[gi]
        if check_prompts and sent.count(MASK) != 1:
            raise DataError(path, ln, f"sentence must contain exactly one {MASK}: {sent!r}")
        if check_prompts and not gold.strip():
            raise DataError(path, ln, "empty gold answer")
        out.append(TypedPrompt(sent, gold, type_name, relation, corpus, str(path), ln))
    if not out:
        raise DataError(path, None, "no rows found")
    return out


def read_csv_rows(path: PathLike) -> list[tuple[int, list[str]]]:
    """All CSV rows with their first line numbers (strict quoting)."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""), strict=True)
    rows = []
    row_start = 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise DataError(path, reader.line_num, f"malformed CSV: {e}") from None
        rows.append((row_start, row))
        row_start = reader.line_num + 1
    return rows


def typed_lama_files(root: PathLike, types: Optional[Iterable[str]] = None) -> list[pathlib.Path]:
    """Every ``synth_<Type>/<corpus>/<relation>.csv`` under ``root`` (sorted), optionally only some types."""
    root = pathlib.Path(root)
    files = sorted(root.glob("synth_*/*/*.csv"))
    if types is not None:
        want = set(types)
        files = [f for f in files if f.parts[-3][len("synth_") :] in want]
    if not files:
        raise DataError(root, None, "no synth_<Type>/<corpus>/<relation>.csv files found")
    return files


def read_typed_lama_dir(root: PathLike, types: Optional[Iterable[str]] = None) -> list[TypedPrompt]:
    """Every ``synth_<Type>/<corpus>/<relation>.csv`` under ``root`` (sorted), optionally only some types."""
    out: list[TypedPrompt] = []
    for f in typed_lama_files(root, types):
        out.extend(read_typed_lama_csv(f))
    return out
