"""TFDS builders (array_record) for jsteer's data sets; no TensorFlow needed.

tensorflow-datasets runs without TensorFlow only when data is written as ``array_record``
and read back by index with ``tfds.data_source`` / ``builder.as_data_source()``
(``as_dataset`` needs TF). The builders here therefore always write array_record.

Every builder takes its *source files* as constructor arguments, so any user path works;
``data_dir`` is only the cache where the prepared records go. The builder config name
(``src_<12 hex>``) is a hash of the sources' *contents* (sha256, :mod:`jsteer.data.digest`)
and the parse options: an edited source never reuses a stale cache, even with its size and
mtime put back, and a copy of a prepared file reuses its records. Names of files enter the key
only where they carry data (a LAMA file's relation, a typed CSV's type folder).

Parsing is done by :mod:`jsteer.data.readers`, so a bad input raises
:class:`~jsteer.data.readers.DataError` naming file and line while preparing. Records keep
file order (``disable_shuffling``); shuffling is the batcher's job (seeded, resumable). Each
prepared data set records its sources in ``info.metadata["sources"]`` (``{split: [{"name",
"sha256"}]}``: the file names it was first prepared from).

Quick use::

    splits = prepare(ConllNer, data_dir, splits={"train": ".../eng.train"}, scheme="iob1",
                     label_names=CONLL2003_LABELS)
    ex = splits["train"][0]   # {"tokens": array([b"EU", ...]), "tags": array([3, 0, ...]), "line": 1, ...}
    splits.label_names        # ["O", "B-PER", ...]
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow_datasets as tfds

from jsteer.data import digest, readers
from jsteer.data import ner as ner_lib

PathLike = Union[str, os.PathLike]

FILE_FORMAT = "array_record"

_log = logging.getLogger(__name__)


def default_data_dir() -> str:
    """``$JSTEER_DATA_DIR`` or ``~/.cache/jsteer/tfds``."""
    return os.environ.get("JSTEER_DATA_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jsteer", "tfds"))


def _fingerprint(files: Sequence[PathLike], options: Mapping[str, Any], cache_dir: PathLike) -> str:
    """12 hex digits of sha256 over the files' content hashes (in order) and ``options``."""
    h = hashlib.sha256()
    for f in files:
        # A missing file is left to the reader, whose DataError names it while preparing.
        h.update(f"{digest.file_sha256(f, cache_dir) if os.path.isfile(f) else 'missing'}\n".encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


class _LocalInfo(tfds.core.DatasetInfo):
    """DatasetInfo of a local-source builder: never looked up on the TFDS GCS bucket.

    TFDS calls ``initialize_from_bucket`` for every builder not yet prepared, and that makes an
    empty ``tempfile.mkdtemp("tfds")`` folder it never removes (one ``/tmp/tmp*tfds`` per new
    cache key); there is nothing on the bucket for these builders anyway."""

    def initialize_from_bucket(self) -> None:
        return None


class _SourceBuilder(tfds.core.GeneratorBasedBuilder):
    """Shared plumbing: source files -> config name, array_record, file order kept."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}

    # No checksums or download URLs: sources are local files. Without this TFDS locates the
    # class's package through `importlib_resources`, which is not installed here.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return None

    def __init__(
        self,
        *,
        source_files: Sequence[PathLike],
        options: Mapping[str, Any],
        split_files: Optional[Mapping[str, Sequence[PathLike]]] = None,
        data_dir=None,
        **kwargs,
    ):
        data_dir = data_dir or default_data_dir()
        name = "src_" + _fingerprint(source_files, options, data_dir)
        config = tfds.core.BuilderConfig(name=name, description=f"sources: {[str(f) for f in source_files]}")
        kwargs.setdefault("file_format", FILE_FORMAT)
        if str(kwargs["file_format"]) not in (FILE_FORMAT, "FileFormat.ARRAY_RECORD"):
            raise ValueError("jsteer builders write array_record only (the only TF-free TFDS format)")
        self._data_dir_for_hashes = data_dir
        self._split_files = {k: [pathlib.Path(f) for f in v] for k, v in (split_files or {}).items()}
        self._source_meta = tfds.core.MetadataDict()
        super().__init__(data_dir=data_dir, config=config, **kwargs)

    def _make_info(self, description: str, features: dict, label_names=None) -> tfds.core.DatasetInfo:
        # disable_shuffling keeps file order (record i = i-th example of the source).
        if label_names is not None:
            self._source_meta["label_names"] = list(label_names)
        return _LocalInfo(
            builder=self,
            description=description,
            features=tfds.features.FeaturesDict(features),
            disable_shuffling=True,
            metadata=self._source_meta,
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        # Written into the prepared data set's metadata (read back by jsteer.data.sources).
        self._source_meta["sources"] = {
            split: [
                {"name": f.name, "sha256": digest.file_sha256(f, self._data_dir_for_hashes)}
                for f in self._split_files.get(split, [])
            ]
            for split in self._split_names()
        }
        return {split: self._generate_examples(split) for split in self._split_names()}


def _check_splits(splits: Mapping[str, Any]) -> dict:
    if not splits:
        raise ValueError("give at least one split, e.g. splits={'train': path}")
    return dict(splits)


class ConllNer(_SourceBuilder):
    """CoNLL-format NER: CoNLL-2003 (4 columns, IOB1 -> IOB2), NCBI-Disease, any ``token tag`` file.

    Args:
      splits: ``{split_name: path}``.
      label_names: tag vocabulary (ClassLabel order). None infers it from the first split
        while preparing (``O`` first, then sorted), so a tag in a later split that the first
        lacks is an error; a prepared data set is opened without parsing its sources.
      scheme, delimiter, token_column, tag_column: as in :func:`readers.read_conll`.

    Features: ``tokens`` [n] bytes, ``tags`` [n] int32 ids into ``label_names``, ``doc`` and
    ``line`` ints. ``label_names`` are in ``info.metadata["label_names"]``.
    """

    name = "jsteer_conll_ner"

    def __init__(
        self,
        *,
        splits: Mapping[str, PathLike],
        label_names: Optional[Sequence[str]] = None,
        scheme: Optional[str] = None,
        delimiter: Optional[str] = None,
        token_column: int = 0,
        tag_column: int = -1,
        **kwargs,
    ):
        self._splits = _check_splits(splits)
        self._read_kw = dict(scheme=scheme, delimiter=delimiter, token_column=token_column, tag_column=tag_column)
        self._label_names = None if label_names is None else list(label_names)
        super().__init__(
            source_files=list(self._splits.values()),
            options=dict(self._read_kw, labels=self._label_names, splits=list(self._splits)),
            split_files={k: [v] for k, v in self._splits.items()},
            **kwargs,
        )

    def _info(self):
        # Tensor features (not Sequence(Text)/Sequence(ClassLabel)): TFDS encodes sequences
        # item by item in Python, ~4x slower to prepare; tag names live in the metadata.
        return self._make_info(
            "CoNLL-format token tagging (jsteer).",
            {
                "tokens": tfds.features.Tensor(shape=(None,), dtype=np.object_),
                "tags": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                "doc": np.int32,
                "line": np.int32,
            },
            label_names=self._label_names,
        )

    def _split_names(self):
        return list(self._splits)

    def _split_generators(self, dl_manager):
        if self._label_names is None:
            first = next(iter(self._splits.values()))
            seen = {t for s in readers.read_conll(first, **self._read_kw) for t in s.tags}
            self._label_names = ["O"] + sorted(seen - {"O"}) if "O" in seen else sorted(seen)
            self._source_meta["label_names"] = list(self._label_names)
        return super()._split_generators(dl_manager)

    def _generate_examples(self, split):
        sents = readers.read_conll(self._splits[split], label_set=self._label_names, **self._read_kw)
        encode = ner_lib.label_encoder(self._label_names)
        for i, s in enumerate(sents):
            yield (
                i,
                {
                    "tokens": np.asarray(s.tokens, dtype=np.object_),
                    "tags": np.asarray(encode(s.tags), np.int32),
                    "doc": s.doc,
                    "line": s.line,
                },
            )


class LabeledText(_SourceBuilder):
    """Labeled text: JSON lines (SST-5), CSV (Jigsaw) or plain text files with a label.

    Args:
      splits: ``{split: path}`` for ``fmt`` "jsonl"/"csv"; for "text" ``{split: {label: path}}``.
      fmt: "jsonl" | "csv" | "text".
      label_names: ClassLabel order; None infers from the first split (sorted).
      reader_kwargs: passed to the reader (``text_field``, ``label_field``, ``text_column``,
        ``label_column``, ``header``).

    Features: ``text``, ``label`` (class id), ``line``.
    """

    name = "jsteer_labeled_text"

    def __init__(
        self,
        *,
        splits: Mapping[str, Any],
        fmt: str,
        label_names: Optional[Sequence[str]] = None,
        reader_kwargs: Optional[Mapping[str, Any]] = None,
        **kwargs,
    ):
        if fmt not in ("jsonl", "csv", "text"):
            raise ValueError(f"fmt must be 'jsonl', 'csv' or 'text', got {fmt!r}")
        self._splits = _check_splits(splits)
        self._fmt = fmt
        self._reader_kw = dict(reader_kwargs or {})
        if label_names is None:
            label_names = sorted({r.label for r in self._read(next(iter(self._splits)), None)})
        self._label_names = [str(x) for x in label_names]
        split_files = {k: list(v.values()) if isinstance(v, Mapping) else [v] for k, v in self._splits.items()}
        # fmt="text": which file holds which label is data too (the files' order alone is not).
        layout = {k: list(v) if isinstance(v, Mapping) else None for k, v in self._splits.items()}
        super().__init__(
            source_files=[f for v in split_files.values() for f in v],
            options=dict(fmt=fmt, labels=self._label_names, reader=self._reader_kw, splits=layout),
            split_files=split_files,
            **kwargs,
        )

    def _read(self, split, label_set):
        src = self._splits[split]
        if self._fmt == "jsonl":
            return readers.read_jsonl_labeled(src, label_set=label_set, **self._reader_kw)
        if self._fmt == "csv":
            return readers.read_csv_labeled(src, label_set=label_set, **self._reader_kw)
        if not isinstance(src, Mapping):
            raise ValueError(f"fmt='text' needs {{label: path}} per split, got {src!r} for split {split!r}")
        return readers.read_text_files_labeled(src, label_set=label_set)

    def _info(self):
        return self._make_info(
            "Labeled text (jsteer).",
            {
                "text": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=self._label_names),
                "line": np.int32,
            },
        )

    def _split_names(self):
        return list(self._splits)

    def _generate_examples(self, split):
        for i, r in enumerate(self._read(split, self._label_names)):
            yield i, {"text": r.text, "label": r.label, "line": r.line}


class Lama(_SourceBuilder):
    """Raw LAMA facts (T-REx / Google-RE JSON lines), one split per group of files.

    Args:
      splits: ``{split: [paths]}`` (or one path), one file per relation as LAMA lays them out:
        a fact's ``relation`` is its file's stem without ``_test`` (``P19``, ``place_of_birth``).
      templates: ``{relation: template}`` or a path to ``relations.jsonl``; Google-RE
        templates are added. A fact whose relation has no template gets ``prompt`` "".

    Features: ``relation``, ``sub_label``, ``obj_label``, ``prompt`` (template with the
    subject filled and ``[MASK]`` for the object), ``masked_sentences`` [n], ``uuid``, ``line``.
    """

    name = "jsteer_lama"

    def __init__(
        self, *, splits: Mapping[str, Any], templates: Union[None, PathLike, Mapping[str, str]] = None, **kwargs
    ):
        self._splits = {
            k: [v] if isinstance(v, (str, os.PathLike)) else list(v) for k, v in _check_splits(splits).items()
        }
        tmpl = dict(readers.GOOGLE_RE_TEMPLATES)
        files = [f for v in self._splits.values() for f in v]
        if isinstance(templates, (str, os.PathLike)):
            files.append(templates)
            tmpl.update(readers.read_lama_relations(templates))
        elif templates is not None:
            tmpl.update(templates)
        self._templates = tmpl
        names = {k: [pathlib.Path(f).name for f in v] for k, v in self._splits.items()}  # relations come from them
        super().__init__(
            source_files=files, options=dict(templates=tmpl, splits=names), split_files=self._splits, **kwargs
        )

    def _info(self):
        return self._make_info(
            "LAMA facts (jsteer).",
            {
                "relation": tfds.features.Text(),
                "sub_label": tfds.features.Text(),
                "obj_label": tfds.features.Text(),
                "prompt": tfds.features.Text(),
                "masked_sentences": tfds.features.Tensor(shape=(None,), dtype=np.object_),
                "uuid": tfds.features.Text(),
                "line": np.int32,
            },
        )

    def _split_names(self):
        return list(self._splits)

    def _generate_examples(self, split):
        i = 0
        for path in self._splits[split]:
            relation = readers.lama_file_relation(path)
            for f in readers.read_lama_jsonl(path, relation=relation):
                t = self._templates.get(f.relation)
                yield (
                    i,
                    {
                        "relation": f.relation,
                        "sub_label": f.sub_label,
                        "obj_label": f.obj_label,
                        "prompt": f.prompt(t) if t else "",
                        "masked_sentences": np.asarray(f.masked_sentences, dtype=np.object_).reshape(-1),
                        "uuid": f.uuid,
                        "line": f.line,
                    },
                )
                i += 1


class TypedLama(_SourceBuilder):
    """Type-grouped LAMA cloze prompts (``synth_<Type>/<corpus>/<relation>.csv``).

    Args:
      root: the ``processed_lama`` folder; all its CSVs form split ``"test"``.
      types: optionally only these types.

    Features: ``sent``, ``gold``, ``type`` (class id over the types found), ``relation``,
    ``corpus``, ``line``. Type, corpus and relation come from each file's path. Rows are kept as
    written: a ``sent`` without exactly one ``[MASK]`` or an empty gold is the consumer's to count
    (``jsteer typevec probe`` reports them as skipped prompts).
    """

    name = "jsteer_typed_lama"

    def __init__(self, *, root: PathLike, types: Optional[Sequence[str]] = None, **kwargs):
        self._root = pathlib.Path(root)
        self._types = None if types is None else list(types)
        # The file list and the types come from the paths: opening a prepared set parses nothing.
        self._files = readers.typed_lama_files(self._root, self._types)
        self._type_names = sorted({f.parts[-3][len("synth_") :] for f in self._files})
        rel = [f.relative_to(self._root).as_posix() for f in self._files]
        super().__init__(
            source_files=self._files,
            options=dict(types=self._type_names, files=rel),
            split_files={"test": self._files},
            **kwargs,
        )

    def _info(self):
        return self._make_info(
            "LAMA prompts grouped by answer type (jsteer).",
            {
                "sent": tfds.features.Text(),
                "gold": tfds.features.Text(),
                "type": tfds.features.ClassLabel(names=self._type_names),
                "relation": tfds.features.Text(),
                "corpus": tfds.features.Text(),
                "line": np.int32,
            },
        )

    def _split_names(self):
        return ["test"]

    def _generate_examples(self, split):
        i = 0
        for f in self._files:
            for p in readers.read_typed_lama_csv(f, check_prompts=False):
                yield (
                    i,
                    {
                        "sent": p.sent,
                        "gold": p.gold,
                        "type": p.type_name,
                        "relation": p.relation,
                        "corpus": p.corpus,
                        "line": p.line,
                    },
                )
                i += 1


class PreparedDataset(dict):
    """``{split: data source}`` plus ``info`` (tfds DatasetInfo), ``label_names``,
    ``builder_dir``, and ``name`` / ``data_dir``: what ``tfds.builder(name, data_dir=data_dir)``
    (and ``--tfds NAME --tfds-data-dir DIR`` in the CLI) open it by.

    A data source supports ``len(src)``, ``src[i]`` (dict of numpy arrays / bytes) and
    ``src.__getitems__([i, j])``; slicing does not work (TFDS limitation without TF).
    """

    def __init__(self, builder):
        super().__init__(builder.as_data_source())
        self.info = builder.info
        self.builder_dir = str(builder.data_dir)
        self.label_names = _label_names(builder.info)
        parts = builder.info.full_name.split("/")  # name[/config]/version
        self.name = "/".join(parts[:-1])
        self.data_dir = str(pathlib.Path(self.builder_dir).parents[len(parts) - 1])


def _label_names(info) -> Optional[list[str]]:
    meta = info.metadata or {}
    if "label_names" in meta:
        return list(meta["label_names"])
    for key in ("label", "type"):
        if key in info.features.keys() and isinstance(info.features[key], tfds.features.ClassLabel):
            return list(info.features[key].names)
    return None


@contextlib.contextmanager
def quiet_tfds():
    """TFDS's chatter off: its absl warnings ("Using custom data configuration ...") and the
    "Downloading and preparing dataset Unknown size" lines it prints to stdout, where the
    CLI's results go."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl.setLevel(level)


def prepare(builder_cls, data_dir: Optional[PathLike] = None, *, progress: bool = False, **builder_kwargs):
    """Build (once; later calls reuse the cache) and open every split -> :class:`PreparedDataset`."""
    if not progress:
        tfds.disable_progress_bar()
    with quiet_tfds():
        builder = builder_cls(data_dir=data_dir, **builder_kwargs)
        if not builder.is_prepared():
            _log.info("preparing %s in %s", builder.info.full_name, builder.data_dir)
        builder.download_and_prepare()
        return PreparedDataset(builder)


def load_prepared(builder_dir: PathLike):
    """Open a prepared builder directory (``<data_dir>/<name>/<config>/<version>``) without its sources."""
    with quiet_tfds():
        return PreparedDataset(tfds.builder_from_directory(builder_dir))


# ----------------------------------------------------------------------------- presets


def conll2003(root: PathLike, data_dir: Optional[PathLike] = None) -> PreparedDataset:
    """CoNLL-2003 from ``root/eng.{train,testa,testb}`` -> splits train/validation/test, IOB2 tags."""
    root = pathlib.Path(root)
    return prepare(
        ConllNer,
        data_dir,
        splits={"train": root / "eng.train", "validation": root / "eng.testa", "test": root / "eng.testb"},
        scheme="iob1",
        label_names=ner_lib.CONLL2003_LABELS,
    )


def ncbi_disease(root: PathLike, data_dir: Optional[PathLike] = None) -> PreparedDataset:
    """NCBI-Disease from ``root/{train,devel,test}.tsv`` -> splits train/validation/test."""
    root = pathlib.Path(root)
    return prepare(
        ConllNer,
        data_dir,
        splits={"train": root / "train.tsv", "validation": root / "devel.tsv", "test": root / "test.tsv"},
        scheme="iob2",
        delimiter="\t",
        label_names=ner_lib.NCBI_DISEASE_LABELS,
    )


def sst5(root: PathLike, data_dir: Optional[PathLike] = None) -> PreparedDataset:
    """SST-5 from ``root/{train,dev,test}.jsonl``; labels "0".."4" (ids equal the label)."""
    root = pathlib.Path(root)
    return prepare(
        LabeledText,
        data_dir,
        splits={"train": root / "train.jsonl", "validation": root / "dev.jsonl", "test": root / "test.jsonl"},
        fmt="jsonl",
        label_names=[str(i) for i in range(5)],
    )


def jigsaw(path: PathLike, data_dir: Optional[PathLike] = None, split: str = "test") -> PreparedDataset:
    """The balanced Jigsaw subset CSV (``text,label``, no header); label 1 = toxic."""
    return prepare(LabeledText, data_dir, splits={split: path}, fmt="csv", label_names=["0", "1"])


def lama(root: PathLike, data_dir: Optional[PathLike] = None) -> PreparedDataset:
    """LAMA ``root/TREx/*.jsonl`` and ``root/Google_RE/*.jsonl`` as splits trex / google_re."""
    root = pathlib.Path(root)
    return prepare(
        Lama,
        data_dir,
        splits={
            "trex": sorted((root / "TREx").glob("*.jsonl")),
            "google_re": sorted((root / "Google_RE").glob("*.jsonl")),
        },
        templates=root / "relations.jsonl",
    )


def text(value) -> str:
    """Decode a Text feature value (bytes from a data source) to str."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
