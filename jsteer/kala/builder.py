"""Offline knowledge builder: a CoNLL file in, entity mentions and a fact graph out.

KALA's original used an entity linker and a relation extractor trained on Wikidata; neither
is available offline, so this builder derives both from raw text. **Task labels are never
read** (only the first, token column of a CoNLL file; token-only files work too).

Steps 1-3 (a lexicon mined from the text, mentions matched with it, facts between them; or
spaCy's entities and dependency verbs) are :mod:`jsteer.kala.mining`'s. This module reads the
files, runs them and writes a graph folder:

    <file name>.mentions.jsonl   per input file: {sentence index: [Mention]} (word spans)
    facts.jsonl                  the facts (h, r, t, weight)
    lexicon.tsv                  the mined lexicon (none with spaCy)
    summary.json                 counts per file, relations, fact entities found among mentions

4. Annotate only (``lexicon_path``, ``build-graph --lexicon``): new files are matched with an
   existing ``lexicon.tsv``; nothing is mined and the graph's facts stay as they are, so a
   trained run's knowledge can be applied to files it has not seen.

:func:`build_folder` is the flow this builder and :mod:`jsteer.kala.qa_builder`'s share:
check, read, annotate, write; :class:`GraphOptions` their options.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import warnings
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from jsteer import progress
from jsteer.kala.formats import Fact, Mention, read_facts, write_facts, write_mentions
from jsteer.kala.mining import Lexicon, extract_facts, load_spacy, mine_lexicon, spacy_annotate

PathLike = Union[str, os.PathLike]
GRAPH_FILES = ("facts.jsonl", "lexicon.tsv", "summary.json")  # plus <file>.mentions.jsonl


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    """How a graph is built: the keyword options of :func:`build_graph` and
    :func:`jsteer.kala.qa_builder.build_qa_graph`.

    ``facts_path``: a triple file that replaces the extracted facts; ``corpus_paths``: extra text
    files, one sentence a line, for lexicon mining only; ``strategy`` / ``min_count`` /
    ``max_len``: the mining (:func:`jsteer.kala.mining.mine_lexicon`); ``spacy_model``: spaCy's
    entities and relations instead; ``lexicon_path``: annotate only (see :func:`build_graph`);
    ``overwrite``: replace a graph already in the folder."""

    facts_path: Optional[PathLike] = None
    corpus_paths: Sequence[PathLike] = ()
    strategy: str = "capitalised"
    min_count: int = 2
    max_len: int = 4
    spacy_model: Optional[str] = None
    lexicon_path: Optional[PathLike] = None
    overwrite: bool = False


#: ``per_file(mentions_flat, knowledge)`` -> {file name: (its mentions by key, its summary entry)}
PerFile = Callable[[list, dict], Mapping[str, tuple[dict, dict]]]


def read_sentences(path: PathLike) -> list[list[str]]:
    """Token column (the first) of a CoNLL file, read by :func:`jsteer.data.readers.read_conll`
    without tags: labels are never read, so a file may have one column only (tokens), and the
    sentences are those, in that order, that ``read_conll`` finds in the labelled file (mention
    keys are sentence indices). Problems raise DataError naming file and line."""
    from jsteer.data.readers import read_conll

    return [list(s.tokens) for s in read_conll(path, tag_column=None)]


def read_text_corpus(path: PathLike, split: Optional[Callable[[str], list[list[str]]]] = None) -> list[list[str]]:
    """Sentences of an extra text file (``--corpus``), one a line: its whitespace-separated
    words (CoNLL graphs: CoNLL text is tokenised so), or ``split(line)``'s sentences of words (SQuAD
    graphs split the corpus as their contexts, so ``Bonn,`` is ``Bonn`` ``,`` in both)."""
    with open(path, encoding="utf-8") as f:
        if split is None:
            return [line.split() for line in f if line.strip()]
        return [list(s) for line in f if line.strip() for s in split(line)]


def check_unique_names(conll_paths: Sequence[PathLike]) -> None:
    """Mentions files are named after the CoNLL file's basename; refuse two inputs sharing one."""
    seen: dict[str, str] = {}
    for p in conll_paths:
        name = pathlib.Path(p).name
        if name in seen:
            raise ValueError(
                f"{seen[name]} and {p} share the file name {name!r}, but mentions files are named "
                f"<file name>.mentions.jsonl; rename one of them (or build separate graph folders)"
            )
        seen[name] = str(p)


def graph_files(out_dir: PathLike) -> list[str]:
    """Names of the graph files (facts, lexicon, summary, mentions) already in ``out_dir``."""
    out = pathlib.Path(out_dir)
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name in GRAPH_FILES or p.name.endswith(".mentions.jsonl"))


def check_graph_out(
    paths: Sequence[PathLike], out_dir: PathLike, *, overwrite: bool = False, lexicon_path: Optional[PathLike] = None
) -> list[str]:
    """Refuse to mine a new graph from ``paths`` (no ``lexicon_path``) over one already in
    ``out_dir`` unless ``overwrite``: it would replace the facts.jsonl and lexicon.tsv that models
    trained on the folder use. Returns the mentions files already there (for
    :func:`remove_stale_mentions`)."""
    out = pathlib.Path(out_dir)
    if overwrite and lexicon_path is not None:
        raise ValueError(
            "--overwrite has no use with --lexicon (annotate only: the graph's lexicon and facts are "
            "kept, and only the given files' mentions are written)"
        )
    existing = graph_files(out)
    if existing and lexicon_path is None and not overwrite:
        shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
        lexicon = out / "lexicon.tsv"
        keep = (
            f"to add these files to the graph, keeping its lexicon and facts: jsteer kala build-graph "
            f"{' '.join(map(str, paths))} --lexicon {lexicon} --out {out}; "
            if lexicon.is_file()
            else ""
        )
        raise ValueError(
            f"--out {out} already holds a graph ({shown}); building there without --lexicon would "
            f"mine a new lexicon and replace its facts.jsonl and lexicon.tsv, which models trained on "
            f"this folder use. {keep}to replace the graph: add --overwrite (overwrite=True), or choose "
            f"a new --out"
        )
    return [n for n in existing if n.endswith(".mentions.jsonl")]


def remove_stale_mentions(paths: Sequence[PathLike], out_dir: PathLike, before: Sequence[str]) -> list[str]:
    """After a graph was replaced: delete the mentions files ``before`` (the old graph's) that
    were not written for ``paths`` now, as they were matched with the old lexicon; warns naming
    them. Returns their names."""
    written = {f"{pathlib.Path(p).name}.mentions.jsonl" for p in paths}
    stale = [n for n in before if n not in written]
    for n in stale:
        (pathlib.Path(out_dir) / n).unlink()
    if stale:
        warnings.warn(
            f"--overwrite: deleted the replaced graph's mentions of files not given now: {', '.join(stale)}",
            stacklevel=3,
        )
    return stale


def fact_match(facts: Sequence[Fact], mentions: Iterable[Sequence[Mention]]) -> tuple[int, int]:
    """(entities named by the facts, how many of them are the id of some mention)."""
    in_facts = {f.h for f in facts} | {f.t for f in facts}
    mentioned = {m.id for ms in mentions for m in ms}
    return len(in_facts), len(in_facts & mentioned)


def _copy(src: Optional[pathlib.Path], dst: pathlib.Path) -> None:
    """Copy ``src`` to ``dst`` unless there is no ``src`` or ``dst`` already is that file."""
    if src is not None and not (dst.exists() and src.resolve() == dst.resolve()):
        shutil.copyfile(src, dst)


def _same_content(a: pathlib.Path, b: pathlib.Path) -> bool:
    return a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()


def _lexicon_facts(
    lexicon_path: pathlib.Path, out: pathlib.Path, facts_path: Optional[PathLike]
) -> tuple[Optional[list[Fact]], Optional[pathlib.Path]]:
    """Facts of an annotate-only build: (facts, the file to copy into ``out``, None: leave it).

    ``--facts`` if given, else ``out``'s own facts.jsonl (kept as it is), else the facts.jsonl
    beside the lexicon (the graph the lexicon was mined with), else none."""
    if facts_path is not None:
        return read_facts(facts_path), pathlib.Path(facts_path)
    if (out / "facts.jsonl").is_file():
        return read_facts(out / "facts.jsonl"), None
    beside = lexicon_path.parent / "facts.jsonl"
    if beside.is_file():
        return read_facts(beside), beside
    warnings.warn(
        f"no facts: {out} has no facts.jsonl, nor has the lexicon's folder {lexicon_path.parent}; "
        f"training and evaluation need one (pass --facts)",
        stacklevel=3,
    )
    return None, None


def build_folder(
    paths: Sequence[PathLike],
    out_dir: PathLike,
    read: Callable[[Sequence[PathLike]], tuple[list[list[str]], PerFile]],
    options: GraphOptions,
    corpus_split: Optional[Callable[[str], list[list[str]]]] = None,
) -> dict:
    """The steps every graph build takes. Refuses inputs sharing a file name and, unless
    ``options`` allow it, a graph already in ``out_dir`` (:func:`check_graph_out`); then
    ``read(paths)`` -> (the sentences to annotate, as lists of words; ``per_file``), annotates
    them (:func:`annotate_sentences`, ``corpus_split`` as there), writes the knowledge, each
    file's ``<name>.mentions.jsonl`` and ``summary.json`` (its ``files`` entries from
    ``per_file``), and with ``overwrite`` deletes the replaced graph's other mentions files.
    Every input is read and checked before ``out_dir`` is created or written. Returns the summary."""
    check_unique_names(paths)
    before = check_graph_out(paths, out_dir, overwrite=options.overwrite, lexicon_path=options.lexicon_path)
    out = pathlib.Path(out_dir)
    sentences, per_file = read(paths)
    mentions_flat, knowledge = annotate_sentences(sentences, out, options, corpus_split)
    summary = write_knowledge(out, knowledge, mentions_flat, [f"{pathlib.Path(p).name}.mentions.jsonl" for p in paths])
    for name, (mentions, entry) in per_file(mentions_flat, knowledge).items():
        write_mentions(out / f"{name}.mentions.jsonl", mentions)
        summary["files"][name] = {**entry, "mentions_file": f"{name}.mentions.jsonl"}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if options.overwrite:
        remove_stale_mentions(paths, out, before)
    return summary


def build_graph(conll_paths: Sequence[PathLike], out_dir: PathLike, **options) -> dict:
    """Write ``<name>.mentions.jsonl`` per CoNLL file, ``facts.jsonl``, ``lexicon.tsv`` and a
    ``summary.json`` under ``out_dir``. Returns the summary. ``options``: the fields of
    :class:`GraphOptions`.

    An ``out_dir`` that already holds a graph is refused (ValueError naming its files) unless
    ``overwrite`` (replace it: the mentions files of inputs not given now are deleted, warned) or
    ``lexicon_path``: a new lexicon and facts would replace those its trained models use.

    ``lexicon_path``: annotate only -- match this lexicon (a ``lexicon.tsv``) instead of mining
    one, and keep the graph's facts: ``facts_path`` if given, else ``out_dir``'s facts.jsonl
    untouched, else the facts.jsonl beside the lexicon (copied). New files of a trained run are
    annotated this way without changing the facts and lexicon its model was trained with; an
    existing summary.json gains the new files.

    Every input is read and checked before ``out_dir`` is created or written. The summary's
    ``fact_entities`` / ``fact_entities_in_mentions`` count the entities the facts name and how
    many of them are mention ids (in any of the graph's mentions files, those of earlier
    annotate-only runs included; a ``files`` entry's ``fact_entities_in_mentions`` counts its
    own mentions); with none in the files given, no mention gets a neighbour (warned).
    """

    def read(paths):
        sentences = {pathlib.Path(p).name: read_sentences(p) for p in paths}

        def per_file(mentions_flat, knowledge):
            files, k = {}, 0
            for name, sents in sentences.items():
                ms = {i: mentions_flat[k + i] for i in range(len(sents))}
                k += len(sents)
                files[name] = (
                    ms,
                    {
                        "sentences": len(sents),
                        "mentions": sum(len(m) for m in ms.values()),
                        "fact_entities_in_mentions": file_fact_entities(knowledge, ms.values()),
                    },
                )
            return files

        return [s for ss in sentences.values() for s in ss], per_file

    return build_folder(conll_paths, out_dir, read, GraphOptions(**options))


def annotate_sentences(
    all_sents: Sequence[Sequence[str]],
    out: pathlib.Path,
    options: GraphOptions,
    corpus_split: Optional[Callable[[str], list[list[str]]]] = None,
) -> tuple[list, dict]:
    """Mentions per sentence (token lists) and the graph's knowledge, with ``options``: spaCy,
    annotate-only with ``lexicon_path``, else a lexicon mined from the sentences
    (+ ``corpus_paths``, split into words by :func:`read_text_corpus` with ``corpus_split``: the
    splitter that made ``all_sents``, or None for whitespace) and facts extracted between mentions
    (``facts_path`` replaces them).
    Reads and checks everything, writes nothing. Returns (mentions_flat, knowledge) for
    :func:`write_knowledge`."""
    o = options
    facts_path, lexicon_path, spacy_model = o.facts_path, o.lexicon_path, o.spacy_model
    if spacy_model is not None and lexicon_path is not None:
        raise ValueError("--spacy and --lexicon are alternatives: give one")
    if lexicon_path is not None and o.corpus_paths:
        raise ValueError("--corpus only feeds lexicon mining; it has no use with --lexicon (annotate only)")
    copy_facts = None
    if spacy_model is not None:
        mentions_flat, facts = spacy_annotate(all_sents, load_spacy(spacy_model))
        lexicon = None
    elif lexicon_path is not None:
        lexicon_path = pathlib.Path(lexicon_path)
        lexicon = Lexicon.load(lexicon_path)
        if (out / "lexicon.tsv").is_file() and not _same_content(out / "lexicon.tsv", lexicon_path):
            raise ValueError(
                f"{out / 'lexicon.tsv'} differs from --lexicon {lexicon_path}: annotating this graph "
                f"folder with another lexicon would mix two graphs; choose another --out"
            )
        mentions_flat = [lexicon.match(s) for s in progress.bar(all_sents, desc="annotate mentions", unit="sentence")]
        facts, copy_facts = _lexicon_facts(lexicon_path, out, facts_path)
    else:
        corpus = list(all_sents)
        for p in o.corpus_paths:
            corpus += read_text_corpus(p, corpus_split)
        lexicon = mine_lexicon(corpus, o.strategy, o.min_count, o.max_len)
        mentions_flat = [lexicon.match(s) for s in progress.bar(all_sents, desc="annotate mentions", unit="sentence")]
        facts = extract_facts(all_sents, mentions_flat)
    if facts_path is not None and lexicon_path is None:
        facts = read_facts(facts_path)
    return mentions_flat, {
        "facts": facts,
        "lexicon": lexicon,
        "lexicon_path": lexicon_path,
        "copy_facts": copy_facts,
        "facts_path": facts_path,
        "strategy": "spacy:" + spacy_model if spacy_model else o.strategy,
    }


def write_knowledge(out: pathlib.Path, knowledge: dict, mentions_flat, mentions_files: Sequence[str] = ()) -> dict:
    """Create ``out`` and write (or, annotating only, copy) its facts.jsonl and lexicon.tsv from
    :func:`annotate_sentences`' result. Returns the summary so far (an annotate-only run extends
    the folder's existing one); its ``files`` entries are the caller's to add (with
    :func:`file_fact_entities`).

    The summary's ``fact_entities_in_mentions`` is graph-wide: annotating only, it counts the
    mentions of ``mentions_flat`` and of the folder's other mentions files (``mentions_files``:
    the names of those the caller is about to write, whose old versions do not count)."""
    facts, lexicon, lexicon_path = knowledge["facts"], knowledge["lexicon"], knowledge["lexicon_path"]
    other_ids = _folder_mention_ids(out, set(mentions_files)) if lexicon_path is not None else set()
    out.mkdir(parents=True, exist_ok=True)
    if lexicon_path is None:
        write_facts(out / "facts.jsonl", facts)
        if lexicon is not None:
            lexicon.save(out / "lexicon.tsv")
        summary = {"strategy": knowledge["strategy"]}
    else:
        _copy(knowledge["copy_facts"], out / "facts.jsonl")
        _copy(lexicon_path, out / "lexicon.tsv")
        old = out / "summary.json"
        summary = json.loads(old.read_text()) if old.is_file() else {"strategy": f"lexicon:{lexicon_path}"}
    summary.setdefault("files", {})
    summary.update(_knowledge_summary(facts, lexicon, mentions_flat, knowledge["facts_path"], other_ids))
    return summary


def file_fact_entities(knowledge: dict, mentions: Iterable[Sequence[Mention]]) -> int:
    """How many entities named by the graph's facts are ids of ``mentions`` (one file's: its
    ``files`` entry's ``fact_entities_in_mentions``)."""
    return fact_match(knowledge["facts"] or [], mentions)[1]


def _folder_mention_ids(out: pathlib.Path, skip: set[str]) -> set[str]:
    """Entity ids of the mentions in ``out``'s ``*.mentions.jsonl`` files, but those named in ``skip``."""
    from jsteer.kala.formats import read_mentions

    if not out.is_dir():
        return set()
    return {
        m.id
        for p in sorted(out.glob("*.mentions.jsonl"))
        if p.name not in skip
        for ms in read_mentions(p).values()
        for m in ms
    }


def _knowledge_summary(
    facts: Optional[list[Fact]],
    lexicon: Optional[Lexicon],
    mentions_flat,
    facts_path,
    other_ids: set[str] = frozenset(),
) -> dict:
    """Summary fields on the facts and lexicon, ``fact_entities_in_mentions`` over the mentions of
    ``mentions_flat`` and the ids ``other_ids`` (the graph's other files); warns when facts exist
    but no entity of theirs is the id of a mention of ``mentions_flat`` (the files annotated now;
    typically a user triple file keyed by other ids than the mentions)."""
    facts = facts or []
    n_ent, n_match = fact_match(facts, mentions_flat)
    n_all = len(
        ({f.h for f in facts} | {f.t for f in facts}) & ({m.id for ms in mentions_flat for m in ms} | other_ids)
    )
    if facts and n_match == 0:
        where = f"the facts of {facts_path}" if facts_path is not None else "the facts"
        warnings.warn(
            f"none of the {n_ent} entities named by {where} is the id of a mention in the annotated "
            f"files, so no mention gets a neighbour: facts and mentions must use the same entity ids "
            f"(the builder's ids are normalised surface forms such as 'european union')",
            stacklevel=3,
        )
    return {
        "n_facts": len(facts),
        "lexicon_size": len(lexicon) if lexicon else None,
        "relations": dict(collections.Counter(f.r for f in facts).most_common()),
        "fact_entities": n_ent,
        "fact_entities_in_mentions": n_all,
    }
