"""LAMA cloze prompts for type-embedding probing: reading the data sets, encoding prompts.

Data
  * raw LAMA JSON lines (``lama/TREx/P19.jsonl``, ``lama/Google_RE/*.jsonl``) with the
    relation templates of ``lama/relations.jsonl`` (Google-RE's three templates are fixed
    here as in LAMA): prompt = template with [X] -> sub_label, [Y] -> [MASK]; gold = obj_label;
  * the type-grouped CSVs ``type_embedding/processed_lama/synth_<Type>/<src>/<rel>.csv``
    (``,sent,gold,filename``), which also name the expected answer type.

Encoding (every dropped prompt is counted by reason in a :class:`Skips`, never silent)
  * MLM encoders: the prompt must hold exactly one [MASK], written in the data as the literal
    ``[MASK]`` and replaced by the tokenizer's own mask token (:func:`mask_token`: ``[MASK]``
    for BERT WordPiece, ``<mask>`` for RoBERTa); the gold must be one token. In a
    space-sensitive vocabulary (byte-level BPE: RoBERTa) a [MASK] after a space stands for the
    leading-space form of the answer (" Florence", "ĠFlorence"), as in pretraining and HF's
    fill-mask with "in <mask>": the gold is looked up in that form and the space before the
    mask is left out of the encoded text (it is the answer's), so the mask token follows "Ġin"
    directly whether or not the tokenizer's mask strips spaces on its left (roberta-base's
    does). A [MASK] right after non-space text (or first) takes the no-space form. WordPiece
    vocabularies (no leading-space forms) are encoded as written.
  * Decoders: the prompt is cut before [MASK] and the answer is the next token, so a prompt
    qualifies only when nothing but punctuation follows [MASK] (``"[X] was born in [Y] ."``
    does; ``"[X] plays in [Y] position ."`` does not) and the gold is a single token in its
    leading-space form (" Paris"). :func:`decoder_qualifies` is the rule; the experiment
    writes the resulting list of relations.

A :class:`Prompt` is one cloze sentence with its gold answer; an :class:`Example` is an encoded
prompt: token ids (a tuple of ints, unpadded), the predicting position and the gold token id.
:mod:`jsteer.typevec.scoring` scores examples, :mod:`jsteer.typevec.probe` runs the methods.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import pathlib
import re
from typing import Callable, Mapping, Optional, Sequence

from jsteer.typevec.sampling import single_token_id, space_sensitive

MASK = "[MASK]"
BTO_FORMS = ("the {type}", "the {type} of", "the {type} called")  # the paper's first
GOOGLE_RE_TEMPLATES = {
    "place_of_birth": "[X] was born in [Y] .",
    "date_of_birth": "[X] (born [Y]).",
    "place_of_death": "[X] died in [Y] .",
}

# ----------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str  # cloze text with one [MASK]
    gold: str  # answer surface form
    relation: str = ""  # e.g. "P19", "place_of_birth"
    type_name: str = ""  # e.g. "City" (from the type-grouped CSVs)
    subject: str = ""


def load_relations(path: str | pathlib.Path) -> dict[str, str]:
    """relations.jsonl -> {relation id: template}, plus the Google-RE templates."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LAMA relations file not found: {path}")
    out = dict(GOOGLE_RE_TEMPLATES)
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out[d["relation"]] = d["template"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}:{i}: bad relation line ({e})") from None
    return out


def fill_template(template: str, subject: str) -> str:
    if "[X]" not in template or "[Y]" not in template:
        raise ValueError(f"template must contain [X] and [Y]: {template!r}")
    return template.replace("[X]", subject).replace("[Y]", MASK)


def load_lama_jsonl(
    path: str | pathlib.Path,
    template: Optional[str] = None,
    relations: Optional[Mapping[str, str]] = None,
    type_name: str = "",
) -> list[Prompt]:
    """Raw LAMA facts -> prompts. The template comes from ``template`` or from ``relations``
    keyed by the file stem (``P19``, ``place_of_birth`` for ``place_of_birth_test``);
    ``type_name`` is the answer type recorded in every prompt."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LAMA file not found: {path}")
    rel = path.stem.replace("_test", "")
    if template is None:
        if relations is None or rel not in relations:
            raise ValueError(f"{path}: no template for relation {rel!r}")
        template = relations[rel]
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            sub, obj = d["sub_label"], d["obj_label"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}:{i}: bad LAMA fact ({e})") from None
        out.append(Prompt(fill_template(template, sub), str(obj), rel, type_name, sub))
    return out


# The answer type of each LAMA relation, as in the type-grouped CSVs (synth_<Type>/<src>/<rel>.csv).
LAMA_TYPES = {
    **{
        r: "City"
        for r in (
            "P19",
            "P20",
            "P36",
            "P47",
            "P131",
            "P159",
            "P190",
            "P276",
            "P740",
            "P937",
            "place_of_birth",
            "place_of_death",
        )
    },
    **{r: "Country" for r in ("P17", "P27", "P495", "P530", "P1001", "P1376")},
    **{r: "Language" for r in ("P37", "P103", "P364", "P407", "P1412")},
    **{r: "Organization" for r in ("P108", "P178")},
    "P30": "Continent",
    "P413": "Football Position",
    "P136": "Genre",
    "P463": "Group",
    "P176": "Manufacturer",
    "P1303": "Musical Instrument",
    "P106": "Occupation",
    "P264": "Record Label",
    "P140": "Religion",
    "P39": "Religious Position",
    "P101": "Specialization",
    "P449": "TV Network",
    "date_of_birth": "Year",
}


def load_lama_dataset(
    root, types: Optional[Mapping[str, str]] = None, data_dir=None
) -> tuple[dict[str, list[Prompt]], dict[str, str]]:
    """Raw LAMA: ``root/relations.jsonl`` plus fact files ``root/<src>/<rel>.jsonl`` (or
    ``root/<rel>.jsonl``; ``_test`` is dropped from the stem), read through the TFDS layer
    (prepared once by :class:`jsteer.data.tfds_builders.Lama` into ``data_dir``); or a
    :class:`jsteer.data.sources.Split` with the LAMA features (``relation``, ``sub_label``,
    ``obj_label``, ``prompt``).

    types: {relation: answer type}, default :data:`LAMA_TYPES`.
    -> ({"<Type>/<rel>": prompts}, {relation: why it was skipped}); a relation is skipped when
    it has no type or no template."""
    from jsteer.data import sources

    types = LAMA_TYPES if types is None else types
    by_rel: dict[str, list[Prompt]] = {}
    skipped: dict[str, str] = {}
    if isinstance(root, sources.Split):
        facts, no_template = sources.lama_facts(root), f"in {root.describe()} (its prompts are empty)"
    else:
        facts, skipped = _lama_folder_facts(pathlib.Path(root), types, data_dir)
        no_template = ""
    for fact, prompt in facts:
        rel = fact.relation
        if rel in skipped:
            continue
        if rel not in types:
            skipped[rel] = f"no answer type for relation {rel} (give one with --lama-type {rel}=TYPE)"
        elif not prompt:
            skipped[rel] = f"no template for relation {rel} {no_template}"
        else:
            by_rel.setdefault(rel, []).append(Prompt(prompt, fact.obj_label, rel, types[rel], fact.sub_label))
    groups = {f"{types[rel]}/{rel}": ps for rel, ps in by_rel.items()}
    return dict(sorted(groups.items())), skipped


def _lama_folder_facts(root: pathlib.Path, types: Mapping[str, str], data_dir) -> tuple[list, dict[str, str]]:
    """A raw LAMA folder's facts with their prompts, and the relations skipped by their file
    names alone (no type, no template): only the other files are prepared and read."""
    from jsteer.data import sources, tfds_builders

    if not root.is_dir():
        raise FileNotFoundError(f"LAMA folder not found: {root}")
    relations = load_relations(root / "relations.jsonl")
    files = sorted(p for p in [*root.glob("*.jsonl"), *root.glob("*/*.jsonl")] if p.name != "relations.jsonl")
    if not files:
        raise FileNotFoundError(f"no <relation>.jsonl fact files under {root}")
    keep, skipped, seen = [], {}, {}
    for f in files:
        rel = f.stem.replace("_test", "")
        if rel in seen:
            raise ValueError(f"relation {rel} has two fact files: {seen[rel]} and {f}")
        seen[rel] = f
        if rel not in types:
            skipped[rel] = f"no answer type for relation {rel} (give one with --lama-type {rel}=TYPE)"
        elif rel not in relations:
            skipped[rel] = f"no template for relation {rel} in {root / 'relations.jsonl'}"
        else:
            keep.append(f)
    if not keep:
        return [], skipped
    split = sources.prepared(tfds_builders.Lama, keep, data_dir, templates=root / "relations.jsonl")
    return sources.lama_facts(split), skipped


def load_typed_csv(path: str | pathlib.Path, type_name: Optional[str] = None) -> list[Prompt]:
    """One type-grouped CSV (``,sent,gold,filename``) -> prompts. The type is read from the
    ``synth_<Type>`` folder when not given."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"typed LAMA CSV not found: {path}")
    if type_name is None:
        m = [p.name[len("synth_") :] for p in path.parents if p.name.startswith("synth_")]
        type_name = m[0] if m else ""
    rel = path.stem.replace("_test", "")
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for col in ("sent", "gold"):
            if reader.fieldnames is None or col not in reader.fieldnames:
                raise ValueError(f"{path}: missing column {col!r} (header: {reader.fieldnames})")
        for line, row in enumerate(reader, start=2):
            sent, gold = row["sent"], row["gold"]
            if sent is None or gold is None:
                raise ValueError(f"{path}:{line}: row has too few fields")
            out.append(Prompt(sent, gold.strip(), rel, type_name))
    return out


def load_typed_dataset(root, data_dir=None) -> dict[str, list[Prompt]]:
    """All ``synth_<Type>/<src>/<rel>.csv`` under ``root`` -> {"<Type>/<rel>": prompts}, in file
    order (a later file of the same type and relation replaces an earlier one). Read through the
    TFDS layer (prepared once by :class:`jsteer.data.tfds_builders.TypedLama` into ``data_dir``);
    or a :class:`jsteer.data.sources.Split` with ``sent``, ``gold``, ``type``, ``relation``."""
    from jsteer.data import sources

    if not isinstance(root, sources.Split):
        root = pathlib.Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"typed LAMA folder not found: {root}")
        if not any(root.glob("synth_*/*/*.csv")):
            raise FileNotFoundError(f"no synth_<Type>/<source>/<relation>.csv files under {root}")
        from jsteer.data import tfds_builders

        ds = tfds_builders.prepare(tfds_builders.TypedLama, data_dir, root=root)
        files = tuple(str(p) for p in sorted(root.glob("synth_*/*/*.csv")))
        root = sources.Split(ds["test"], ds.info, ds.name, "test", ds.data_dir, files)
    out: dict[str, list[Prompt]] = {}
    last: dict[str, tuple[str, int]] = {}  # group -> (corpus, line) of its latest record
    for p in sources.typed_prompts(root):
        key = f"{p.type_name}/{p.relation}"
        prev = last.get(key)
        if prev is None or prev[0] != p.corpus or p.line <= prev[1]:  # the first record of a file
            out[key] = []
        last[key] = (p.corpus, p.line)
        out[key].append(Prompt(p.sent, p.gold.strip(), p.relation, p.type_name))
    if not out:
        raise ValueError(f"{root.describe()}: no prompts")
    return out


def bto_text(text: str, type_name: str, form: str = BTO_FORMS[0]) -> str:
    """BTo baseline prompt: ``form`` (with ``{type}``) before the answer, e.g. "... the city
    [MASK] ..." or with "the {type} of": "... the city of [MASK] ..."."""
    if "{type}" not in form:
        raise ValueError(f"BTo form {form!r} has no {{type}} slot")
    word = type_name.replace("_", " ").lower()
    return text.replace(MASK, f"{form.format(type=word)} {MASK}", 1)


# ----------------------------------------------------------------------------- encoding

_PUNCT_ONLY = re.compile(r"^[\s\.\,\;\:\!\?\)\(\"'\-]*$")


def decoder_qualifies(text: str) -> bool:
    """A cloze prompt can be asked of a decoder when nothing but punctuation follows [MASK]
    and something precedes it."""
    if text.count(MASK) != 1:
        return False
    pre, post = text.split(MASK)
    return bool(pre.strip()) and bool(_PUNCT_ONLY.match(post))


def decoder_prefix(text: str) -> str:
    """The prompt truncated before [MASK] (trailing spaces removed: the answer token carries
    its own leading space)."""
    return text.split(MASK)[0].rstrip()


class Skips:
    """Counts of prompts left out, by reason, with a few examples each."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, reason: str, example: str):
        self.counts[reason] += 1
        if len(self.examples[reason]) < 3:
            self.examples[reason].append(example)

    def merge(self, other: "Skips") -> "Skips":
        for r, n in other.counts.items():
            self.counts[r] += n
            self.examples[r].extend(other.examples[r][: max(0, 3 - len(self.examples[r]))])
        return self

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self) -> dict:
        return {
            "total": self.total,
            "by_reason": dict(self.counts),
            "examples": {k: v for k, v in self.examples.items()},
        }


@dataclasses.dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]  # full input ids
    pos: int  # predicting position ([MASK] for MLM, last token for decoders)
    gold: int
    prompt: Prompt


def mask_token(tokenizer) -> str:
    """The tokenizer's own mask token (``[MASK]`` for BERT WordPiece, ``<mask>`` for RoBERTa),
    from its ``mask_id``; the literal ``[MASK]`` when it names none."""
    mask_id = getattr(tokenizer, "mask_id", None)
    to_token = getattr(tokenizer, "id_to_token", None)
    tok = to_token(int(mask_id)) if mask_id is not None and to_token is not None else None
    return tok if tok else MASK


def mlm_text(text: str, tokenizer, space_sensitive_vocab: Optional[bool] = None) -> tuple[str, bool]:
    """A cloze text with one literal [MASK] -> (the text to encode, with the tokenizer's mask
    token, and whether the gold takes its leading-space form).

    In a space-sensitive vocabulary a [MASK] after whitespace stands for " answer": that
    whitespace is dropped from the text (the answer token carries it) and the gold is looked up
    with its space. WordPiece: the text as written, the gold without a space."""
    if space_sensitive_vocab is None:
        space_sensitive_vocab = space_sensitive(tokenizer)
    pre, post = text.split(MASK, 1)
    lead = bool(space_sensitive_vocab and pre[-1:].isspace())
    if lead:
        pre = pre.rstrip()
    return pre + mask_token(tokenizer) + post, lead


def encode_prompts(
    prompts: Sequence[Prompt],
    tokenizer,
    kind: str,
    *,
    max_len: int = 512,
    skips: Optional[Skips] = None,
    text_fn: Optional[Callable[[Prompt], str]] = None,
) -> tuple[list[Example], Skips]:
    """Prompts -> examples for ``kind`` "mlm" or "decoder", with counted skips.

    MLM: the literal [MASK] becomes the tokenizer's mask token, and in a space-sensitive
    vocabulary a [MASK] after a space asks for the gold's leading-space form (:func:`mlm_text`).
    Decoders: the gold's leading-space form in a space-sensitive vocabulary.
    ``text_fn`` rewrites a prompt's text first (e.g. :func:`bto_text`)."""
    if kind not in ("mlm", "decoder"):
        raise ValueError(f"kind must be 'mlm' or 'decoder', got {kind!r}")
    skips = skips if skips is not None else Skips()
    out = []
    lead = space_sensitive(tokenizer)
    mask_id = getattr(tokenizer, "mask_id", None)
    if mask_id is None and hasattr(tokenizer, "token_to_id"):
        mask_id = tokenizer.token_to_id(MASK)
    if kind == "mlm" and mask_id is None:
        raise ValueError("MLM probing needs a tokenizer with a mask token ([MASK], <mask>)")
    gold_cache: dict[tuple[str, bool], Optional[int]] = {}
    for p in prompts:
        text = text_fn(p) if text_fn is not None else p.text
        n_mask = text.count(MASK)
        if n_mask == 0:
            skips.add("no [MASK] in prompt", text)
            continue
        if n_mask > 1:
            skips.add("several [MASK] in prompt", text)
            continue
        if kind == "mlm":
            enc_text, gold_lead = mlm_text(text, tokenizer, lead)
        else:
            enc_text, gold_lead = text, lead
        key = (p.gold, gold_lead)
        if key not in gold_cache:
            gold_cache[key] = single_token_id(tokenizer, p.gold, leading_space=gold_lead)
        gold = gold_cache[key]
        if gold is None:
            skips.add("gold is not a single token", p.gold)
            continue
        if kind == "mlm":
            ids = _encode_full(tokenizer, enc_text)
            where = [i for i, t in enumerate(ids) if t == mask_id]
            if len(where) != 1:
                skips.add("[MASK] not kept as one token by the tokenizer", text)
                continue
            pos = where[0]
        else:
            if not decoder_qualifies(text):
                skips.add("text after [MASK] (not answerable as the next token)", text)
                continue
            ids = _encode_full(tokenizer, decoder_prefix(text))
            if not ids:
                skips.add("empty prompt", text)
                continue
            pos = len(ids) - 1
        if len(ids) > max_len:
            skips.add(f"longer than {max_len} tokens", text)
            continue
        out.append(Example(tuple(int(i) for i in ids), pos, int(gold), p))
    return out, skips


def _encode_full(tokenizer, text: str) -> list[int]:
    out = tokenizer.encode(text, add_special_tokens=True)
    return list(out.ids) if hasattr(out, "ids") else list(out)
