"""LAMA cloze probing with type embeddings: data, encoding, batched jitted scoring, P@k.

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

Scoring
  Rows (example, lambda, type vector) are bucketed by length (multiples of 8), padded to a
  fixed batch, and scored by one jitted function per bucket shape: lambda and the type
  vector are traced per row, so a whole lambda grid, several relations and several types
  share batches and compile once. Output per row: the gold's rank among non-special tokens
  (P@k = rank < k), the PostTE ranks for a grid of weights, and the top-1 id.

Methods (paper, Tables 4/7/8)
  * B: plain prompt; * BTo: type words before the answer, "the <type> [MASK]" (the paper's)
    or "the <type> of [MASK]" / "the <type> called [MASK]" (:data:`BTO_FORMS`), the form tuned
    per relation on the hold-out like TE's lambda (a decoder rarely continues "... born in the
    city" with the name, so the paper's form alone makes BTo a straw man there);
  * PostTE: scores + w * cos(E_v, TE), w tuned on the hold-out over 0..30;
  * TE: lambda * TE added at the [MASK] (MLM) / predicting position or all prompt tokens
    (decoders), lambda tuned on a 5% hold-out over 0..5 and reported on the rest.
    Decoders also have ``mode="layer"`` (not in the paper): lambda * TE added to the residual
    stream of the predicting position after decoder layer ``layer`` (see
    :mod:`jsteer.typevec.inject`). ``lam_unit`` rescales the grid (lambda_abs = value * unit)
    so a grid can be given in units of the embedding-row norm or of the residual norm.
  Tuning picks the best hold-out P@1, ties broken by the mean of P@10/50/100, then the smaller
  value. (The paper's script picks the smallest lambda reaching the largest gain in *any*
  P@k; we tune for P@1, the headline metric.)
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import json
import math
import pathlib
import re
import warnings
import zlib
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.data import buckets
from jsteer.hooks import FiLM, Hooks
from jsteer.typevec.inject import inject, one_hot_positions, residual_hooks
from jsteer.typevec.sampling import single_token_id, space_sensitive

Array = jnp.ndarray

MASK = "[MASK]"
KS = (1, 10, 50, 100)
LAMBDA_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
POST_GRID = (0.0, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
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
    root: str | pathlib.Path, types: Optional[Mapping[str, str]] = None
) -> tuple[dict[str, list[Prompt]], dict[str, str]]:
    """Raw LAMA: ``root/relations.jsonl`` plus fact files ``root/<src>/<rel>.jsonl`` (or
    ``root/<rel>.jsonl``; ``_test`` is dropped from the stem).

    types: {relation: answer type}, default :data:`LAMA_TYPES`.
    -> ({"<Type>/<rel>": prompts}, {relation: why it was skipped}); a relation is skipped when
    it has no type or no template."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"LAMA folder not found: {root}")
    relations = load_relations(root / "relations.jsonl")
    types = LAMA_TYPES if types is None else types
    files = sorted(p for p in [*root.glob("*.jsonl"), *root.glob("*/*.jsonl")] if p.name != "relations.jsonl")
    if not files:
        raise FileNotFoundError(f"no <relation>.jsonl fact files under {root}")
    groups, skipped, seen = {}, {}, {}
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
            groups[f"{types[rel]}/{rel}"] = load_lama_jsonl(f, relations=relations, type_name=types[rel])
    return dict(sorted(groups.items())), skipped


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


def load_typed_dataset(root: str | pathlib.Path) -> dict[str, list[Prompt]]:
    """All ``synth_<Type>/<src>/<rel>.csv`` under ``root`` -> {"<Type>/<rel>": prompts}, sorted."""
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"typed LAMA folder not found: {root}")
    out = {}
    for p in sorted(root.glob("synth_*/*/*.csv")):
        t = p.parent.parent.name[len("synth_") :]
        out[f"{t}/{p.stem.replace('_test', '')}"] = load_typed_csv(p, t)
    if not out:
        raise FileNotFoundError(f"no synth_<Type>/<source>/<relation>.csv files under {root}")
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


# ----------------------------------------------------------------------------- model adapter


@dataclasses.dataclass(frozen=True, eq=False)
class ProbeModel:
    """What probing needs from a backbone.

    forward(params, ids [B,T], attention_mask [B,T], hooks) -> ModelOutput;
    head(params, h [B,D]) -> logits [B,V] at the predicting positions;
    input_embedding(params) -> [V,D] (type vectors are built from and injected into this space).
    """

    kind: str  # "mlm" | "decoder"
    forward: Callable
    head: Callable
    input_embedding: Callable
    params: Any
    tokenizer: Any
    identity: str = ""
    excluded_ids: tuple[int, ...] = ()
    init_cache: Optional[Callable] = None  # decoders: (batch, slots) -> KVCache

    @functools.cached_property
    def score_fn(self):
        return jax.jit(
            functools.partial(_score_rows, self.forward, self.head, self.input_embedding),
            static_argnames=("mode", "layer"),
        )

    @functools.cached_property
    def grid_fn(self):
        if self.init_cache is None:
            raise ValueError("this model has no KV cache: use score_rows")
        return jax.jit(
            functools.partial(_score_grid, self.forward, self.head, self.input_embedding, self.init_cache),
            static_argnames=("layer",),
        )

    def embedding(self) -> Array:
        return self.input_embedding(self.params)


def _special_ids(tokenizer) -> tuple[int, ...]:
    ids = []
    for role in ("pad", "bos", "eos", "unk", "mask", "cls", "sep"):
        i = getattr(tokenizer, f"{role}_id", None)
        if i is not None:
            ids.append(int(i))
    return tuple(sorted(set(ids)))


def for_bert_mlm(module, params, tokenizer, identity: str = "") -> ProbeModel:
    """ProbeModel for a :class:`jsteer.backbones.bert.BertForMaskedLM` (params with "head")."""
    from jsteer.backbones import bert

    if "head" not in params:
        raise ValueError(
            "MLM probing needs a BERT with an MLM head (params['head'] missing); "
            "MiniLM has none - use it for retrieval / analysis only"
        )
    cfg = module.config
    head_mod = bert.MLMHead(cfg)

    def forward(p, ids, mask, hooks, **kw):
        return module.apply({"params": p}, ids, attention_mask=mask, hooks=hooks, **kw)

    def head(p, h):
        emb = p["encoder"]["embeddings"]["word"]["embedding"] if cfg.tie_word_embeddings else None
        return head_mod.apply({"params": p["head"]}, h[:, None, :], emb)[:, 0]

    return ProbeModel("mlm", forward, head, bert.input_embeddings, params, tokenizer, identity, _special_ids(tokenizer))


def for_decoder(module, params, tokenizer, family: str, config, identity: str = "") -> ProbeModel:
    """ProbeModel for a decoder (``family`` "decoder"): logits = h @ E_out^T at the
    predicting position only (the full [B,T,V] logits are never needed, and XLA drops them)."""
    from jsteer.backbones import get_family

    fam = get_family(family)

    def forward(p, ids, mask, hooks, **kw):
        return module.apply({"params": p}, ids, attention_mask=mask, hooks=hooks, **kw)

    def head(p, h):
        return jnp.einsum("bd,vd->bv", h, fam.output_embeddings(p, config).astype(h.dtype))

    return ProbeModel(
        "decoder",
        forward,
        head,
        fam.input_embeddings,
        params,
        tokenizer,
        identity,
        _special_ids(tokenizer),
        init_cache=lambda b, s: config.init_cache(b, s),
    )


def from_lm(lm) -> ProbeModel:
    """ProbeModel from a :func:`jsteer.load` result."""
    if lm.family == "bert":
        return for_bert_mlm(lm.module, lm.params, lm.tokenizer, lm.identity)
    return for_decoder(lm.module, lm.params, lm.tokenizer, lm.family, lm.config, lm.identity)


# ----------------------------------------------------------------------------- jitted scoring


def _score_rows(
    forward,
    head,
    input_embedding,
    params,
    ids,
    attn,
    pos,
    gold,
    te,
    lam,
    post_w,
    excluded,
    *,
    mode: str,
    layer: Optional[int] = None,
):
    """One padded batch.

    ids/attn [B,T]; pos, gold [B]; te [B,D]; lam [B]; post_w [W]; excluded [V] bool.
    mode: "pos" (offset at the predicting position) | "all" (every real prompt token) |
    "layer" (residual stream after decoder layer ``layer``, predicting position).
    Returns rank [B] (number of allowed tokens scoring above the gold), post_rank [W,B], top1 [B].
    """
    t = ids.shape[1]
    where = attn.astype(jnp.float32) if mode == "all" else one_hot_positions(pos, t)
    hooks = residual_hooks(te, lam, where, layer) if mode == "layer" else inject(te, lam, where)
    out = forward(params, ids, attn, hooks)
    h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]  # [B, D]
    return _rank_and_post(head, input_embedding, params, h, gold, te, post_w, excluded)


def _rank_and_post(head, input_embedding, params, h, gold, te, post_w, excluded):
    logits = head(params, h).astype(jnp.float32)  # [R, V]
    logits = jnp.where(excluded[None, :], -jnp.inf, logits)
    g = jnp.take_along_axis(logits, gold[:, None], axis=1)
    rank = jnp.sum(logits > g, axis=1)
    emb = input_embedding(params).astype(jnp.float32)
    en = emb / jnp.maximum(jnp.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    tn = te / jnp.maximum(jnp.linalg.norm(te, axis=1, keepdims=True), 1e-12)
    cos = jnp.einsum("vd,rd->rv", en, tn.astype(jnp.float32))
    post = logits[None] + post_w[:, None, None] * cos[None]  # [W, R, V]
    pg = jnp.take_along_axis(post, jnp.broadcast_to(gold[None, :, None], post.shape[:2] + (1,)), axis=2)
    return rank, jnp.sum(post > pg, axis=2), jnp.argmax(logits, axis=1)


def _score_grid(
    forward,
    head,
    input_embedding,
    init_cache,
    params,
    ids,
    attn,
    gold,
    te,
    lam,
    post_w,
    excluded,
    *,
    layer: Optional[int] = None,
):
    """Decoders, TE at the predicting position (input embedding, or the residual stream after
    decoder layer ``layer`` when given), a grid of L lambdas per prompt.

    ids/attn [B,T] left-padded (the predicting position is column T-1); gold [B]; te [B,D];
    lam [B,L]. The prefix (columns 0..T-2) does not depend on lambda, so it runs once into a KV
    cache; only the last token runs for each of the B*L (prompt, lambda) rows.
    Returns rank [B,L], post_rank [W,B,L], top1 [B,L].
    """
    b, t = ids.shape
    n_l = lam.shape[1]
    cache = init_cache(b, t)
    cache = forward(params, ids[:, :-1], attn[:, :-1], None, cache=cache).cache

    def rep(x):
        return jnp.repeat(x, n_l, axis=0)

    cache = cache.replace(
        k=jax.tree.map(rep, cache.k), v=jax.tree.map(rep, cache.v), mask=rep(cache.mask), pos=rep(cache.pos)
    )
    te_r = rep(te)
    off = (lam.reshape(-1)[:, None] * te_r)[:, None, :]  # [B*L, 1, D]
    hooks = Hooks(embed_offset=off) if layer is None else Hooks(film={layer: FiLM(beta_out=off)})
    out = forward(params, rep(ids[:, -1:]), jnp.ones((b * n_l, 1), jnp.int32), hooks, cache=cache)
    rank, post_rank, top1 = _rank_and_post(
        head, input_embedding, params, out.hidden[:, 0], rep(gold), te_r, post_w, excluded
    )
    return rank.reshape(b, n_l), post_rank.reshape(-1, b, n_l), top1.reshape(b, n_l)


def _length_batches(lengths: Sequence[int], multiple: int, batch_size: int):
    """Yield (T, chunk, idx): rows grouped by length T rounded up to a multiple of ``multiple``
    (:data:`jsteer.data.buckets.PROBE` for 8; shortest first, stable), in chunks of <=
    ``batch_size``; ``idx`` is ``chunk`` padded to ``batch_size`` with its first row."""
    groups = collections.defaultdict(list)
    for j in np.argsort(np.asarray(lengths, np.int64), kind="stable"):
        groups[buckets.bucket(int(lengths[j]), (multiple,), "multiple")].append(int(j))
    for t, rows in sorted(groups.items()):
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            yield t, chunk, chunk + [chunk[0]] * (batch_size - len(chunk))


@dataclasses.dataclass
class RowResult:
    rank: np.ndarray  # [R]
    post_rank: np.ndarray  # [W, R]
    top1: np.ndarray  # [R]
    n_batches: int
    n_padded_rows: int


def _store_batch(out, chunk: np.ndarray, rank: np.ndarray, post_rank: np.ndarray, top1: np.ndarray) -> int:
    """Writes the real rows of one batch's (rank, post_rank, top1) output (padded to the batch
    size) into the result arrays at rows ``chunk`` (post_rank [W, ...]: at [:, chunk]);
    -> the number of real rows."""
    rk, prk, tp = (np.asarray(o) for o in out)
    k = len(chunk)
    rank[chunk], post_rank[:, chunk], top1[chunk] = rk[:k], prk[:, :k], tp[:k]
    return k


def score_rows(
    model: ProbeModel,
    examples: Sequence[Example],
    row_example: Sequence[int],
    row_lam: Sequence[float],
    row_te: Sequence[int],
    tes: Array,
    *,
    mode: str = "pos",
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    bucket: int = buckets.PROBE.sizes[0],
    progress: Optional[Callable[[int, int], None]] = None,
    layer: Optional[int] = None,
) -> RowResult:
    """Score R rows: row r asks ``examples[row_example[r]]`` with ``row_lam[r] * tes[row_te[r]]``.

    tes: [K, D] type vectors. mode: "pos" | "all" | "layer" (decoders; MLM uses "pos" = the
    [MASK]); ``layer``: the decoder layer for mode "layer".
    """
    _check_mode(mode, layer, model.kind)
    row_example = np.asarray(row_example, np.int64)
    row_lam = np.asarray(row_lam, np.float32)
    row_te = np.asarray(row_te, np.int64)
    r = len(row_example)
    if not (len(row_lam) == len(row_te) == r):
        raise ValueError("row_example, row_lam and row_te must have the same length")
    tes = jnp.asarray(tes, jnp.float32)
    if tes.ndim != 2:
        raise ValueError(f"tes must be [K, D], got shape {tes.shape}")
    excluded, post_w, pad_id = _score_constants(model, post_grid)

    rank = np.zeros((r,), np.int64)
    post_rank = np.zeros((len(post_grid), r), np.int64)
    top1 = np.zeros((r,), np.int64)
    lengths = [len(examples[i].ids) for i in row_example]
    n_batches = done = 0
    for t, chunk, idx in _length_batches(lengths, bucket, batch_size):
        ids = np.full((batch_size, t), pad_id, np.int32)
        attn = np.zeros((batch_size, t), np.int32)
        pos = np.zeros((batch_size,), np.int32)
        gold = np.zeros((batch_size,), np.int32)
        for b, j in enumerate(idx):
            ex = examples[row_example[j]]
            ids[b, : len(ex.ids)] = ex.ids
            attn[b, : len(ex.ids)] = 1
            pos[b], gold[b] = ex.pos, ex.gold
        out = model.score_fn(
            model.params,
            jnp.asarray(ids),
            jnp.asarray(attn),
            jnp.asarray(pos),
            jnp.asarray(gold),
            tes[jnp.asarray(row_te[idx])],
            jnp.asarray(row_lam[idx]),
            post_w,
            excluded,
            mode=mode,
            layer=layer,
        )
        done += _store_batch(out, chunk, rank, post_rank, top1)
        n_batches += 1
        if progress is not None:
            progress(done, r)
    return RowResult(rank, post_rank, top1, n_batches, n_batches * batch_size - r)


@dataclasses.dataclass
class GridResult:
    rank: np.ndarray  # [N, L]
    post_rank: np.ndarray  # [W, N, L]
    top1: np.ndarray  # [N, L]
    n_batches: int
    n_padded_rows: int


def score_grid(
    model: ProbeModel,
    examples: Sequence[Example],
    ex_idx: Sequence[int],
    lams,
    te_idx: Sequence[int],
    tes: Array,
    *,
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    bucket: int = buckets.PROBE.sizes[0],
    progress: Optional[Callable[[int, int], None]] = None,
    layer: Optional[int] = None,
) -> GridResult:
    """Decoders, TE at the predicting position (``layer``: in the residual stream after that
    layer): prompt n is asked with each of ``lams[n]`` ([N, L], or [L] for all) times
    ``tes[te_idx[n]]``. The lambda-independent prefix runs once per prompt (KV cache), then the
    last token for every lambda. ``batch_size`` prompts per call."""
    ex_idx = np.asarray(ex_idx, np.int64)
    n = len(ex_idx)
    lams = np.asarray(lams, np.float32)
    if lams.ndim == 1:
        lams = np.broadcast_to(lams, (n, lams.shape[0]))
    if lams.shape[0] != n or len(te_idx) != n:
        raise ValueError(f"lams {lams.shape} and te_idx ({len(te_idx)}) must have one row per prompt ({n})")
    te_idx = np.asarray(te_idx, np.int64)
    tes = jnp.asarray(tes, jnp.float32)
    n_l = lams.shape[1]
    excluded, post_w, pad_id = _score_constants(model, post_grid)
    rank = np.zeros((n, n_l), np.int64)
    post_rank = np.zeros((len(post_grid), n, n_l), np.int64)
    top1 = np.zeros((n, n_l), np.int64)
    lengths = [len(examples[i].ids) for i in ex_idx]
    n_batches = done = 0
    for t, chunk, idx in _length_batches(lengths, bucket, batch_size):
        ids = np.full((batch_size, t), pad_id, np.int32)
        attn = np.zeros((batch_size, t), np.int32)
        gold = np.zeros((batch_size,), np.int32)
        for b, j in enumerate(idx):
            ex = examples[ex_idx[j]]
            if ex.pos != len(ex.ids) - 1:
                raise ValueError("score_grid needs decoder examples (predicting position = last token)")
            ids[b, t - len(ex.ids) :] = ex.ids
            attn[b, t - len(ex.ids) :] = 1
            gold[b] = ex.gold
        out = model.grid_fn(
            model.params,
            jnp.asarray(ids),
            jnp.asarray(attn),
            jnp.asarray(gold),
            tes[jnp.asarray(te_idx[idx])],
            jnp.asarray(lams[idx]),
            post_w,
            excluded,
            layer=layer,
        )
        done += _store_batch(out, chunk, rank, post_rank, top1)
        n_batches += 1
        if progress is not None:
            progress(done, n)
    return GridResult(rank, post_rank, top1, n_batches, n_batches * batch_size - n)


def score(
    model: ProbeModel,
    examples: Sequence[Example],
    ex_idx: Sequence[int],
    lams,
    te_idx: Sequence[int],
    tes: Array,
    *,
    mode: str = "pos",
    post_grid: Sequence[float] = POST_GRID,
    batch_size: int = 32,
    layer: Optional[int] = None,
) -> GridResult:
    """Prompt x lambda grid, by the fastest exact route: :func:`score_grid` for decoders with TE
    at the predicting position, else :func:`score_rows` on the flattened (prompt, lambda) rows."""
    _check_mode(mode, layer, model.kind)
    if model.kind == "decoder" and mode in ("pos", "layer") and model.init_cache is not None:
        return score_grid(
            model,
            examples,
            ex_idx,
            lams,
            te_idx,
            tes,
            post_grid=post_grid,
            batch_size=batch_size,
            layer=layer if mode == "layer" else None,
        )
    ex_idx = np.asarray(ex_idx, np.int64)
    n = len(ex_idx)
    lams = np.asarray(lams, np.float32)
    if lams.ndim == 1:
        lams = np.broadcast_to(lams, (n, lams.shape[0]))
    n_l = lams.shape[1]
    res = score_rows(
        model,
        examples,
        np.repeat(ex_idx, n_l),
        lams.reshape(-1),
        np.repeat(np.asarray(te_idx), n_l),
        tes,
        mode=mode,
        post_grid=post_grid,
        batch_size=batch_size,
        layer=layer,
    )
    return GridResult(
        res.rank.reshape(n, n_l),
        res.post_rank.reshape(len(post_grid), n, n_l),
        res.top1.reshape(n, n_l),
        res.n_batches,
        res.n_padded_rows,
    )


def _check_mode(mode: str, layer: Optional[int], kind: str) -> None:
    if mode not in ("pos", "all", "layer"):
        raise ValueError(f"mode must be 'pos', 'all' or 'layer', got {mode!r}")
    if mode == "all" and kind == "mlm":
        # every attended token of an MLM prompt includes [CLS] / [SEP]; the paper puts TE at [MASK]
        raise ValueError("mode 'all' is for decoders only; an MLM takes the TE at its [MASK] (mode 'pos')")
    if mode == "layer":
        if kind != "decoder":
            raise ValueError("mode 'layer' (residual-stream TE) is for decoders only")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"mode 'layer' needs a non-negative int layer, got {layer!r}")
    elif layer is not None:
        raise ValueError(f"layer={layer} is only used with mode 'layer' (got mode {mode!r})")


def _score_constants(model: ProbeModel, post_grid: Sequence[float]):
    vocab = model.embedding().shape[0]
    excluded = np.zeros((vocab,), bool)
    excluded[[i for i in model.excluded_ids if i < vocab]] = True
    pad_id = getattr(model.tokenizer, "pad_id", None)
    return jnp.asarray(excluded), jnp.asarray(post_grid, jnp.float32), 0 if pad_id is None else int(pad_id)


# ----------------------------------------------------------------------------- metrics & tuning


def precision_at(ranks: Sequence[int] | np.ndarray, ks: Sequence[int] = KS) -> dict[str, float]:
    """{"P@k": fraction of ranks < k}; rank 0 = the gold is the top prediction."""
    ranks = np.asarray(ranks)
    if ranks.size == 0:
        return {f"P@{k}": float("nan") for k in ks}
    return {f"P@{k}": float(np.mean(ranks < k)) for k in ks}


def macro(per_group: Mapping[str, Mapping[str, float]], ks: Sequence[int] = KS) -> dict[str, float]:
    """Unweighted mean over groups of each P@k (groups with no examples are left out)."""
    out = {}
    for k in ks:
        vals = [v[f"P@{k}"] for v in per_group.values() if not math.isnan(v[f"P@{k}"])]
        out[f"P@{k}"] = float(np.mean(vals)) if vals else float("nan")
    return out


def choose(values: Sequence[float], ranks_per_value: Sequence[np.ndarray]) -> tuple[float, dict]:
    """Best value by P@1, then mean(P@10, P@50, P@100), then the smaller value."""
    best, best_key, table = None, None, {}
    for v, rk in zip(values, ranks_per_value):
        p = precision_at(rk)
        table[str(v)] = p
        key = (p["P@1"], (p["P@10"] + p["P@50"] + p["P@100"]) / 3.0, -v)
        if best_key is None or key > best_key:
            best, best_key = v, key
    return float(best), table


def split_holdout(n: int, frac: float, seed: int, group: str) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic per-group split -> (holdout idx, rest idx); at least 1 hold-out when n >= 2
    and frac > 0; none when frac == 0."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"hold-out fraction must be in [0, 1), got {frac}")
    rng = np.random.default_rng([seed, zlib.crc32(group.encode())])
    perm = rng.permutation(n)
    h = 0 if n < 2 or frac == 0 else max(1, int(round(frac * n)))
    return np.sort(perm[:h]), np.sort(perm[h:])


# ----------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class GroupData:
    examples: list[Example]
    bto: list[list[Optional[int]]]  # per BTo form, per example: index into the BTo examples (None: skipped)
    holdout: np.ndarray  # global example indices
    test: np.ndarray
    offset: int  # global index of this group's first example


def evaluate(
    model: ProbeModel,
    groups: Mapping[str, Sequence[Prompt]],
    tes: Mapping[str, Array],
    *,
    type_names: Optional[Mapping[str, str]] = None,
    mode: str = "pos",
    lam_grid: Sequence[float] = LAMBDA_GRID,
    post_grid: Sequence[float] = POST_GRID,
    holdout: float = 0.05,
    max_test: Optional[int] = None,
    max_holdout: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 32,
    methods: Sequence[str] = ("B", "BTo", "PostTE", "TE"),
    log: Optional[Callable[[str], None]] = None,
    layer: Optional[int] = None,
    lam_unit: float = 1.0,
    bto_forms: Sequence[str] = BTO_FORMS,
) -> dict:
    """Probe every group (relation) with B / BTo / PostTE / TE and return a JSON-able report.

    groups: {name: prompts}; tes: {name: TE [D]} (a group without a TE is probed with B/BTo only);
    type_names: {name: type} for BTo (default: each prompt's ``type_name``); ``bto_forms``: the
    BTo phrasings (:func:`bto_text`), one chosen per group on its hold-out.
    ``max_test`` caps the reported (non-hold-out) prompts per group (seeded subsample);
    ``max_holdout`` caps the hold-out (tiny runs only; the rest of the hold-out is not used).
    ``mode``/``layer``: where TE goes (see :func:`score_rows`); ``lam_unit``: lambda grid values
    are in this unit (absolute lambda = value * lam_unit; the report gives values in units).

    A group with a TE but no hold-out prompt (``holdout=0``, a 1-prompt group) is *untuned*:
    lambda 0 and PostTE weight 0 (so TE = PostTE = B), marked ``"untuned": true`` in
    ``per_group`` and ``tuning``. The macro of every method is over the same groups: those with
    reported prompts and a result for every method (``macro_relations``); groups without a TE
    while TE / PostTE are asked for are listed in ``no_te`` and warned about (through ``log``
    when given, else :func:`warnings.warn`); every group left out of the macro is in
    ``macro_excluded`` with the reason.
    """
    _check_mode(mode, layer, model.kind)
    if not groups:
        raise ValueError("evaluate: no groups (relations) to probe")
    if "BTo" in methods and not bto_forms:
        raise ValueError("BTo needs at least one form in bto_forms")
    lam_unit = float(lam_unit)
    if not lam_unit > 0:
        raise ValueError(f"lam_unit must be positive, got {lam_unit}")
    warn = (lambda s: log("warning: " + s)) if log else (lambda s: warnings.warn(s, stacklevel=3))
    log = log or (lambda s: None)
    kind = model.kind
    lam_grid = sorted({0.0, *(float(x) for x in lam_grid)})  # lambda = 0 is B and tunes PostTE
    post_grid = [float(x) for x in post_grid]
    all_examples: list[Example] = []
    bto_examples: list[Example] = []
    data: dict[str, GroupData] = {}
    skips_report = {}
    for name, prompts in groups.items():
        sk = Skips()
        exs, _ = encode_prompts(prompts, model.tokenizer, kind, skips=sk)
        tname = (type_names or {}).get(name)
        bto_idx: list[list[Optional[int]]] = [[None] * len(exs) for _ in bto_forms]
        if "BTo" in methods:
            sk_b = Skips()
            for f, form in enumerate(bto_forms):
                for j, e in enumerate(exs):
                    t = tname or e.prompt.type_name
                    if not t:
                        raise ValueError(f"group {name}: BTo needs a type name (type_names or Prompt.type_name)")
                    b, _ = encode_prompts(
                        [e.prompt],
                        model.tokenizer,
                        kind,
                        skips=sk_b,
                        text_fn=lambda p, t=t, form=form: bto_text(p.text, t, form),
                    )
                    if b:
                        bto_idx[f][j] = len(bto_examples)
                        bto_examples.extend(b)
            skips_report[f"{name}/BTo"] = sk_b.report()  # summed over the forms
        hold, test = split_holdout(len(exs), holdout, seed, name)
        if max_holdout is not None:
            hold = hold[:max_holdout]
        if max_test is not None and len(test) > max_test:
            rng = np.random.default_rng([seed + 1, zlib.crc32(name.encode())])
            test = np.sort(rng.choice(test, size=max_test, replace=False))
        offset = len(all_examples)
        all_examples.extend(exs)
        data[name] = GroupData(exs, bto_idx, hold + offset, test + offset, offset)
        skips_report[name] = sk.report()
        log(
            f"{name}: {len(exs)} usable / {len(prompts)} prompts, hold-out {len(hold)}, test {len(test)}, "
            f"skipped {sk.total}"
        )

    names_te = [n for n in data if n in tes]
    te_index = {n: i for i, n in enumerate(names_te)}
    d = model.embedding().shape[1]
    te_table = jnp.stack([jnp.asarray(tes[n], jnp.float32) for n in names_te]) if names_te else jnp.zeros((1, d))
    _run = functools.partial(score, model, mode=mode, post_grid=post_grid, batch_size=batch_size, layer=layer)

    def run(exs, idx, lams, te_idx, table, **kw):
        return _run(exs, idx, np.asarray(lams, np.float32) * lam_unit, te_idx, table, **kw)

    # phase 1: hold-out prompts x the lambda grid (lambda = 0, column 0, also tunes PostTE)
    best_lam, best_w, tuning = {}, {}, {}
    grid = lam_grid if "TE" in methods else [0.0]
    hold_idx = [i for n in names_te for i in data[n].holdout]
    if hold_idx:
        hold_grp = np.array([n for n in names_te for _ in data[n].holdout])
        res = run(all_examples, hold_idx, np.asarray(grid, np.float32), [te_index[n] for n in hold_grp], te_table)
        for n in names_te:
            sel = hold_grp == n
            if not sel.any():  # no hold-out prompt in this group: untuned (below)
                continue
            lam_star, lam_table = choose(grid, [res.rank[sel, j] for j in range(len(grid))])
            w_star, w_table = choose(post_grid, [res.post_rank[w, sel, 0] for w in range(len(post_grid))])
            best_lam[n], best_w[n] = lam_star, w_star
            tuning[n] = {
                "lambda": lam_star,
                "lambda_table": lam_table,
                "post_weight": w_star,
                "post_table": w_table,
                "n_holdout": int(sel.sum()),
            }
            log(f"{n}: tuned lambda={lam_star} post_weight={w_star}")
    untuned = [n for n in names_te if n not in best_lam]
    for n in untuned:  # no hold-out prompt: nothing to tune on, so the TE is not applied
        best_lam[n], best_w[n] = 0.0, 0.0
        tuning[n] = {"lambda": 0.0, "post_weight": 0.0, "untuned": True, "n_holdout": 0}
        log(f"{n}: no hold-out prompt, untuned (lambda 0, post_weight 0: TE and PostTE equal B)")

    # phase 2: reported prompts at lambda 0 (B, PostTE) and at the tuned lambda (TE)
    test_idx = [i for g in data.values() for i in g.test]
    test_grp = np.array([n for n, g in data.items() for _ in g.test])
    lam2 = np.array([[0.0, best_lam.get(n, 0.0)] for n in test_grp], np.float32).reshape(-1, 2)
    res = run(all_examples, test_idx, lam2, [te_index.get(n, 0) for n in test_grp], te_table) if test_idx else None
    results: dict[str, dict] = {n: {} for n in data}
    predictions: dict[str, list] = {n: [] for n in data}
    tok = model.tokenizer
    dec = (lambda i: tok.decode([int(i)])) if hasattr(tok, "decode") else int
    for n, g in data.items():
        sel = test_grp == n if res is not None else np.zeros(0, bool)
        rb = res.rank[sel, 0] if res is not None else np.array([])
        results[n]["B"] = precision_at(rb)
        results[n]["n_test"] = int(len(g.test))
        if n in te_index:
            results[n]["untuned"] = n in untuned
        if n in te_index and res is not None:  # res is None when no prompt is reported (max_test=0)
            if "PostTE" in methods:  # weight 0 (untuned) leaves B's scores, whatever post_grid holds
                post = rb if n in untuned else res.post_rank[post_grid.index(best_w[n]), sel, 0]
                results[n]["PostTE"] = precision_at(post)
            if "TE" in methods:
                results[n]["TE"] = precision_at(res.rank[sel, 1])
        for j in np.flatnonzero(sel)[:5]:
            ex = all_examples[test_idx[j]]
            entry = {"prompt": ex.prompt.text, "gold": ex.prompt.gold, "B_top1": dec(res.top1[j, 0])}
            if n in te_index and "TE" in methods:
                entry["TE_top1"] = dec(res.top1[j, 1])
            predictions[n].append(entry)

    if "BTo" in methods:

        def bto_ranks(rows):
            """Gold ranks of (group, global example index, form) rows; a prompt whose BTo form
            could not be encoded is a miss (same denominator as B)."""
            at = [data[n].bto[f][i - data[n].offset] for n, i, f in rows]
            ok = np.array([x is not None for x in at], bool)
            ranks = np.full(len(rows), np.iinfo(np.int32).max, np.int64)
            if ok.any():
                n_ok = int(ok.sum())
                rb = run(
                    bto_examples,
                    [x for x in at if x is not None],
                    np.zeros((n_ok, 1), np.float32),
                    [0] * n_ok,
                    te_table,
                    post_grid=(0.0,),
                )
                ranks[ok] = rb.rank[:, 0]
            return ranks, ok

        form_of = {n: 0 for n in data}
        if len(bto_forms) > 1:  # the phrasing per group, on its hold-out
            rows = [(n, i, f) for n, g in data.items() for f in range(len(bto_forms)) for i in g.holdout]
            ranks, _ = bto_ranks(rows)
            grp, form = np.array([r[0] for r in rows]), np.array([r[2] for r in rows])
            for n, g in data.items():
                if not len(g.holdout):
                    continue
                per = [ranks[(grp == n) & (form == f)] for f in range(len(bto_forms))]
                f_star, table = choose(range(len(bto_forms)), per)
                form_of[n] = int(f_star)
                tuning.setdefault(n, {})["bto_form"] = bto_forms[form_of[n]]
                tuning[n]["bto_table"] = {bto_forms[int(k)]: v for k, v in table.items()}
        rows = [(n, i, form_of[n]) for n, g in data.items() for i in g.test]
        ranks, ok = bto_ranks(rows)
        grp = np.array([n for n, _, _ in rows])
        for n in data:
            sel = grp == n
            results[n]["BTo"] = precision_at(ranks[sel]) if sel.any() else {f"P@{k}": float("nan") for k in KS}
            results[n]["BTo_encoded"] = int(ok[sel].sum())
            results[n]["BTo_form"] = bto_forms[form_of[n]]

    reported = [m for m in ("B", "BTo", "PostTE", "TE") if m in methods]
    excluded = macro_exclusions(results, reported)
    no_te = [n for n in data if n not in te_index] if {"TE", "PostTE"} & set(methods) else []
    if no_te:
        msg = (
            f"{len(no_te)} of {len(data)} groups have no type vector (probed with B/BTo only, not in the "
            f"macro): {no_te}"
        )
        warn(msg)
    in_macro = [n for n in results if n not in excluded]
    macro_all = {m: macro({n: results[n][m] for n in in_macro}) for m in reported}
    return {
        "kind": kind,
        "mode": mode,
        "layer": layer,
        "lambda_unit": lam_unit,
        "identity": model.identity,
        "lambda_grid": list(lam_grid),
        "post_grid": list(post_grid),
        "bto_forms": list(bto_forms),
        "holdout": holdout,
        "max_test": max_test,
        "max_holdout": max_holdout,
        "seed": seed,
        "per_group": results,
        "macro": macro_all,
        "macro_relations": in_macro,
        "macro_excluded": excluded,
        "no_te": no_te,
        "untuned": untuned,
        "tuning": tuning,
        "skips": skips_report,
        "predictions": predictions,
    }


def macro_exclusions(results: Mapping[str, Mapping], methods: Sequence[str]) -> dict[str, str]:
    """{group: why it is left out of the macro}: no reported prompt, or no result for one of
    ``methods`` (every method's macro is then over the same groups)."""
    out = {}
    for n, r in results.items():
        lacking = [m for m in methods if m not in r]
        if r["n_test"] == 0:
            out[n] = "no reported prompt"
        elif lacking:
            out[n] = f"no {'/'.join(lacking)} result (no type vector)"
    return out


# ----------------------------------------------------------------------------- type switching


def switch_prompts(
    pob_prompts: Sequence[Prompt],
    template: str = GOOGLE_RE_TEMPLATES["date_of_birth"],
    source_template: str = GOOGLE_RE_TEMPLATES["place_of_birth"],
) -> list[Prompt]:
    """Type switching (Table 6): place-of-birth facts asked with the date-of-birth template,
    e.g. "Khatchig Mouradian (born [MASK])." with gold "Lebanon". Subjects are recovered from
    prompts written with ``source_template`` (or taken from ``Prompt.subject``)."""
    pre, post = source_template.split("[X]")[0], source_template.split("[X]")[1]
    tail = post.replace("[Y]", MASK)
    out = []
    for p in pob_prompts:
        sub = p.subject
        if not sub:
            if not (p.text.startswith(pre) and p.text.endswith(tail)):
                continue
            sub = p.text[len(pre) : len(p.text) - len(tail)]
        out.append(Prompt(fill_template(template, sub), p.gold, "date_of_birth->place_of_birth", p.type_name, sub))
    return out
