"""Where the method pipelines' records come from: raw files prepared through the TFDS builders,
or a prepared TFDS data set named by the user. Either way the records are read from a
``tfds.data_source`` (array_record, no TensorFlow).

    from jsteer.data import sources, tfds_builders

    split = sources.prepared(tfds_builders.ConllNer, "eng.train", data_dir, scheme="iob1")  # a raw file
    split = sources.open_tfds("jsteer_conll_ner/src_0123456789ab:train", "tfds/", need=sources.NER)
    sentences = sources.tagged_sentences(split, scheme="iob1")    # [readers.TaggedSentence]

A :class:`Split` is one split of a prepared data set: its records by index, its DatasetInfo and
where it came from. The converters (:func:`tagged_sentences`, :func:`labeled_texts`,
:func:`lama_facts`, :func:`typed_prompts`) turn records into the readers' record types, so a
pipeline reads a raw file and a named data set the same way. A named data set that is missing
or lacks a split or a feature raises one :class:`DatasetError` naming the data set, the folder
and what is missing (with what is there).

Feature names a pipeline needs (:data:`NER`, :data:`LABELED`, :data:`LAMA`, :data:`TYPED_LAMA`)
are those the jsteer builders write; a data set from elsewhere needs the same names.
Integer tags / labels take their names from a ``ClassLabel`` feature or from
``info.metadata["label_names"]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
from typing import Any, Optional, Sequence, Union

import numpy as np

from jsteer.data import digest, ner, readers

PathLike = Union[str, os.PathLike]

NER = ("tokens", "tags")
LABELED = ("text", "label")
LAMA = ("relation", "sub_label", "obj_label", "prompt")
TYPED_LAMA = ("sent", "gold", "type", "relation")
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")
_CHUNK = 4096  # records decoded per __getitems__ call


class DatasetError(ValueError):
    """A named TFDS data set that cannot serve a pipeline: missing, or lacking a split or feature."""


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a prepared data set.

    ``source``: the ``tfds.data_source`` (``len``, ``[i]``, ``__getitems__``); ``name``: the data
    set's ``name[/config]``; ``files``: the raw files it was prepared from in this run (empty
    for a named data set, whose first sources' names are in :attr:`source_names`).
    """

    source: Any
    info: Any
    name: str
    split: str
    data_dir: str
    files: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.source)

    @property
    def spec(self) -> str:
        """``name[/config]:split``, as ``--tfds`` takes it."""
        return f"{self.name}:{self.split}"

    def describe(self) -> str:
        """What to call it in messages: the raw file, or ``tfds NAME:SPLIT in DIR``."""
        if len(self.files) == 1:
            return self.files[0]
        return f"tfds {self.spec} in {self.data_dir}"

    @property
    def features(self) -> list[str]:
        return sorted(self.info.features.keys())

    @property
    def source_names(self) -> list[str]:
        """File names the split was first prepared from (a jsteer builder records them); [] otherwise."""
        srcs = (self.info.metadata or {}).get("sources") or {}
        return [s["name"] for s in srcs.get(self.split, [])]

    def records(self, indices: Optional[Sequence[int]] = None) -> list[dict]:
        """Decoded records at ``indices`` (default all), in that order."""
        idx = list(range(len(self.source))) if indices is None else [int(i) for i in indices]
        out: list[dict] = []
        for k in range(0, len(idx), _CHUNK):
            out.extend(self.source.__getitems__(idx[k : k + _CHUNK]))
        return out

    def class_names(self, feature: str) -> Optional[list[str]]:
        """Names of integer values of ``feature``: its ``ClassLabel`` (also inside a Sequence),
        else the data set's ``metadata["label_names"]``; None when it has neither."""
        f = self.info.features[feature]
        inner = getattr(f, "feature", f)
        if hasattr(inner, "names") and hasattr(inner, "num_classes"):
            return list(inner.names)
        meta = self.info.metadata or {}
        return list(meta["label_names"]) if "label_names" in meta else None

    def digest(self) -> str:
        """sha256 identifying the split's records: of the raw file(s), or over the split's
        record files (run records and caches compare it)."""
        if self.files:
            paths = self.files
        else:
            paths = [str(p) for p in self.info.splits[self.split].filepaths]
        if len(paths) == 1:
            return digest.file_sha256(paths[0], self.data_dir)
        h = hashlib.sha256()
        for p in paths:
            h.update(f"{digest.file_sha256(p, self.data_dir)}\n".encode())
        return h.hexdigest()


def prepared(builder_cls, files: Union[PathLike, Sequence[PathLike]], data_dir=None, **builder_kwargs) -> Split:
    """Raw ``files`` (one path, or several read as one split) through ``builder_cls`` into the
    cache at ``data_dir`` (prepared once; default :func:`tfds_builders.default_data_dir`) -> their :class:`Split`."""
    from jsteer.data import tfds_builders

    many = not isinstance(files, (str, os.PathLike))
    paths = [str(f) for f in files] if many else [str(files)]
    ds = tfds_builders.prepare(builder_cls, data_dir, splits={"data": paths if many else paths[0]}, **builder_kwargs)
    return Split(ds["data"], ds.info, ds.name, "data", ds.data_dir, tuple(paths))


def from_prepared(ds, split: str) -> Split:
    """A split of a :class:`tfds_builders.PreparedDataset` (e.g. ``tfds_builders.conll2003(...)``)."""
    if split not in ds:
        raise DatasetError(f"tfds {ds.name} in {ds.data_dir} has no split {split!r} (splits: {sorted(ds)})")
    return Split(ds[split], ds.info, ds.name, split, ds.data_dir)


def parse_spec(spec: str) -> tuple[str, Optional[str], Optional[str]]:
    """``NAME[/CONFIG][:SPLIT]`` -> (name, config or None, split or None)."""
    head, _, split = spec.partition(":")
    name, _, config = head.partition("/")
    if not name or "/" in config or ":" in split or (":" in spec and not split):
        raise DatasetError(
            f"--tfds {spec!r}: expected NAME[/CONFIG][:SPLIT], e.g. jsteer_conll_ner/src_0a1b2c3d4e5f:train"
        )
    return name, config or None, split or None


def default_tfds_dir() -> str:
    """TFDS's own default: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), "tensorflow_datasets")


def _subdirs(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")) if path.is_dir() else []


def _resolve(name: str, config: Optional[str], data_dir: pathlib.Path) -> Optional[str]:
    """The config to open (None: the data set has none), checked against the folder, so a data
    set that is not there is named as such instead of reaching TFDS's code or downloads."""
    if not data_dir.is_dir():
        raise DatasetError(f"tfds {name}: the data dir {data_dir} does not exist")
    root = data_dir / name
    if not root.is_dir():
        held = [d for d in _subdirs(data_dir) if not d.startswith(("downloads", "incomplete"))]
        raise DatasetError(f"tfds {name}: no such data set in {data_dir} (it holds: {', '.join(held) or 'nothing'})")
    entries = _subdirs(root)
    configs = [d for d in entries if not _VERSION.match(d) and any(_VERSION.match(v) for v in _subdirs(root / d))]
    if config is None:
        if any(_VERSION.match(d) for d in entries):
            return None
        if len(configs) == 1:
            return configs[0]
        raise DatasetError(
            f"tfds {name} in {data_dir} has configs {configs or 'none prepared'}: name one as {name}/CONFIG"
        )
    if config not in configs:
        raise DatasetError(f"tfds {name} in {data_dir} has no config {config!r} (configs: {configs or 'none'})")
    return config


def open_tfds(
    spec: str,
    data_dir: Optional[PathLike] = None,
    *,
    need: Sequence[str] = (),
    default_split: Optional[str] = None,
    what: str = "",
) -> Split:
    """A prepared TFDS data set by name: ``spec`` ``NAME[/CONFIG][:SPLIT]`` in ``data_dir``
    (default :func:`default_tfds_dir`), opened with ``tfds.builder(name, data_dir=...)`` and
    read with ``as_data_source``; nothing is downloaded or built.

    The split may be left out when the data set has one, or ``default_split`` is among them.
    ``need``: features the caller reads (``what`` says for what, in the error). Anything
    missing -> :class:`DatasetError` naming the data set, ``data_dir`` and what is missing."""
    import tensorflow_datasets as tfds

    from jsteer.data.tfds_builders import quiet_tfds

    name, config, split = parse_spec(spec)
    root = pathlib.Path(data_dir or default_tfds_dir()).expanduser()
    config = _resolve(name, config, root)
    full = name if config is None else f"{name}/{config}"
    with quiet_tfds():
        try:
            builder = tfds.builder(full, data_dir=str(root))
        except Exception as e:  # TFDS raises several kinds; all mean "cannot be opened from here"
            raise DatasetError(f"tfds {full} in {root}: cannot be opened ({type(e).__name__}: {e})") from None
    splits = sorted(builder.info.splits.keys())
    where = f"tfds {full} in {root}"
    if not splits:
        raise DatasetError(f"{where}: not prepared (no splits)")
    if split is None:
        if len(splits) == 1:
            split = splits[0]
        elif default_split in splits:
            split = default_split
        else:
            raise DatasetError(f"{where} has splits {splits}: name one as {full}:SPLIT")
    if split not in splits:
        raise DatasetError(f"{where} has no split {split!r} (splits: {splits})")
    have = set(builder.info.features.keys())
    missing = [f for f in need if f not in have]
    if missing:
        raise DatasetError(
            f"{where} lacks the feature(s) {missing}{' ' + what if what else ''} (it has {sorted(have)})"
        )
    with quiet_tfds():
        try:
            source = builder.as_data_source(split=split)
        except Exception as e:
            raise DatasetError(
                f"{where}: split {split!r} cannot be read as a data source ({type(e).__name__}: {e}); "
                f"data sources need file_format='array_record'"
            ) from None
    return Split(source, builder.info, full, split, str(root))


# ----------------------------------------------------------------------------- records -> reader types


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value.item())
    return str(value)


def _line(rec: dict, i: int) -> int:
    return int(rec["line"]) if "line" in rec else i + 1


def _names_of(split: Split, values, feature: str, where: str) -> list[str]:
    """Integer class ids or strings -> strings."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        names = split.class_names(feature)
        if names is None:
            raise DatasetError(
                f"{where}: feature {feature!r} holds integers but the data set names no classes "
                f"(a ClassLabel feature or metadata['label_names'])"
            )
        return [names[int(v)] for v in arr.reshape(-1)]
    return [_text(v) for v in arr.reshape(-1)]


def tagged_sentences(
    split: Split, *, scheme: Optional[str] = None, label_set: Optional[Sequence[str]] = None, indices=None
) -> list[readers.TaggedSentence]:
    """NER records (``tokens``, ``tags``) -> sentences as :func:`readers.read_conll` gives them.

    ``scheme`` "iob1" converts tags to IOB2 (IOB2 tags pass unchanged), "iob2" checks them;
    ``label_set``: any other tag is a :class:`readers.DataError` at its line (raw files: the
    file's line, as the reader reports it)."""
    where = split.describe()
    allowed = None if label_set is None else frozenset(label_set)
    out = []
    for i, rec in zip(indices if indices is not None else range(len(split)), split.records(indices)):
        tokens = tuple(_text(t) for t in np.asarray(rec["tokens"]).reshape(-1))
        tags = _names_of(split, rec["tags"], "tags", where)
        start = _line(rec, i)
        if len(tags) != len(tokens):
            raise readers.DataError(where, start, f"{len(tokens)} tokens but {len(tags)} tags")
        if scheme == "iob1":
            tags = ner.iob1_to_iob2(tags)
        elif scheme == "iob2" and (bad := ner.iob2_violation(tags)) is not None:
            raise readers.DataError(where, start + bad, f"tag {tags[bad]!r} continues no entity (IOB2 needs B- first)")
        if allowed is not None:
            for j, t in enumerate(tags):
                if t not in allowed:
                    raise readers.DataError(where, start + j, f"label {t!r} not in label set {sorted(allowed)}")
        doc = int(rec["doc"]) if "doc" in rec else 0
        out.append(readers.TaggedSentence(tokens, tuple(tags), where, start, doc))
    return out


def labeled_texts(split: Split) -> list[readers.LabeledText]:
    """Labeled records (``text``, ``label``) -> :class:`readers.LabeledText` (label as a string:
    a class id becomes its name)."""
    where = split.describe()
    out = []
    for i, rec in enumerate(split.records()):
        label = _names_of(split, rec["label"], "label", where)
        if len(label) != 1:
            raise readers.DataError(where, _line(rec, i), f"label must be one value, got {len(label)}")
        out.append(readers.LabeledText(_text(rec["text"]), label[0], where, _line(rec, i)))
    return out


def lama_facts(split: Split) -> list[tuple[readers.LamaFact, str]]:
    """LAMA fact records -> [(fact, its prompt)] (prompt "" where the relation had no template)."""
    where = split.describe()
    out = []
    for i, rec in enumerate(split.records()):
        sents = tuple(_text(s) for s in np.asarray(rec.get("masked_sentences", [])).reshape(-1))
        fact = readers.LamaFact(
            _text(rec["relation"]),
            _text(rec["sub_label"]),
            _text(rec["obj_label"]),
            sents,
            _text(rec.get("uuid", "")),
            where,
            _line(rec, i),
        )
        out.append((fact, _text(rec["prompt"])))
    return out


def typed_prompts(split: Split) -> list[readers.TypedPrompt]:
    """Type-grouped LAMA records -> :class:`readers.TypedPrompt` (``corpus`` "" when absent)."""
    where = split.describe()
    out = []
    for i, rec in enumerate(split.records()):
        (type_name,) = _names_of(split, rec["type"], "type", where)
        corpus = _text(rec["corpus"]) if "corpus" in rec else ""
        out.append(
            readers.TypedPrompt(
                _text(rec["sent"]), _text(rec["gold"]), type_name, _text(rec["relation"]), corpus, where, _line(rec, i)
            )
        )
    return out
