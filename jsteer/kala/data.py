"""NER examples with knowledge: tokenisation, mention -> token alignment, batching.

An encoded example is a dict of NumPy arrays (unpadded, length L <= max_len)::

    input_ids, labels (-100 = ignored), word_index (-1 = special token)  int32 [L]
    token_node    int32 [L]  local graph node of the entity mentioned at the token, -1 none
    token_entity  int32 [L]  its entity-vocabulary index (0 none / null)
    graph         ExampleGraph
    n_unseen      number of distinct mentioned entities outside the training vocabulary
    pad_id        the tokenizer's padding id (:func:`collate` pads input_ids with it)

Special tokens follow the tokenizer's own framing (:func:`framing`: ``[CLS] ... [SEP]`` for
BERT, ``<s> ... </s>`` for RoBERTa) and words are encoded one at a time, as HF's
``tokenizer(words, is_split_into_words=True)``: byte-level BPE (RoBERTa) words with a leading
space, as with HF's ``add_prefix_space=True``.

:func:`batches` pads examples to a static batch size and a length bucket and batches their
graphs to node / edge buckets chosen per length bucket (:func:`graph_buckets`,
:func:`jsteer.kala.graph.stack_graphs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from jsteer.data import ner as ner_lib
from jsteer.data.buckets import KALA_LENGTHS, bucket
from jsteer.kala.entities import EntityVocab, KnowledgeGraph, mention_entities
from jsteer.kala.formats import Mention, describe, first_overlap
from jsteer.kala.graph import GRAPH_KEYS, ExampleGraph, graph_need, stack_graphs


def raw_tokenizer(tok):
    """The ``tokenizers.Tokenizer`` inside a jsteer Tokenizer (or the object itself)."""
    for attr in ("_tk", "tokenizer", "_tokenizer"):
        inner = getattr(tok, attr, None)
        if inner is not None and hasattr(inner, "encode_batch"):
            return inner
    if hasattr(tok, "encode_batch"):
        return tok
    raise TypeError(f"expected a tokenizers.Tokenizer or a jsteer Tokenizer, got {type(tok).__name__}")


@dataclasses.dataclass(frozen=True)
class Framing:
    """How a tokenizer frames one sequence and a pair with special tokens, and how it takes
    pre-split words: what HF's ``tokenizer(words, is_split_into_words=True)`` and
    ``tokenizer(question, context)`` give (see :func:`framing`).

    BERT WordPiece: ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]``, token types 0 then 1.
    RoBERTa-family (byte-level BPE; XLM-R / CamemBERT SentencePiece): ``<s> A </s>`` and
    ``<s> A </s></s> B </s>``, every token type 0 (their type_vocab_size is 1).
    """

    kind: str  # the tokenizer kind, for messages: "WordPiece", "byte-level BPE", "Unigram", ...
    prefix: tuple[int, ...]  # before the sequence (single and pair): (cls,)
    suffix: tuple[int, ...]  # after a single sequence: (sep,)
    middle: tuple[int, ...]  # between the two sequences of a pair: (sep,) BERT, (sep, sep) RoBERTa
    end: tuple[int, ...]  # after the second sequence of a pair: (sep,)
    types: tuple  # token types of the pair: (prefix's, A's, middle's, B's, end's), specials' as tuples
    unk_id: Optional[int]
    pad_id: int
    word_prefix: str = ""  # put before each pre-split word: " " for byte-level BPE (HF's add_prefix_space=True)

    def pair(self, a: Sequence[int], b: Sequence[int]) -> tuple[list[int], list[int]]:
        """(ids, token types) of the pair ``a``, ``b`` (ids without special tokens); ``b``
        starts at ``len(prefix) + len(a) + len(middle)``."""
        t_pre, t_a, t_mid, t_b, t_end = self.types
        ids = [*self.prefix, *a, *self.middle, *b, *self.end]
        return ids, [*t_pre, *[t_a] * len(a), *t_mid, *[t_b] * len(b), *t_end]


def tokenizer_kind(raw) -> str:
    """A ``tokenizers.Tokenizer``'s kind, for messages: its model ("WordPiece", "BPE",
    "Unigram", ...), "byte-level BPE" behind a byte-level pre-tokenizer."""
    model = type(raw.model).__name__
    return f"byte-level {model}" if _byte_level(raw) else model


def _byte_level(raw) -> bool:
    """Whether the pre-tokenizer is byte-level (GPT-2 / RoBERTa), alone or in a sequence."""
    pre = raw.pre_tokenizer
    if pre is None:
        return False
    state = json.loads(pre.__getstate__())
    parts = state.get("pretokenizers", []) if state.get("type") == "Sequence" else [state]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _role(tok, raw, role: str, names: Sequence[str]) -> Optional[int]:
    """A special token's id: a jsteer Tokenizer's own role id, else the first of ``names`` in the vocabulary."""
    roles = getattr(tok, "special_ids", None)
    if isinstance(roles, Mapping) and roles.get(role) is not None:
        return int(roles[role])
    return next((raw.token_to_id(t) for t in names if raw.token_to_id(t) is not None), None)


_PROBES = ("a", "A", "1", ".", "the", "[UNK]", "<unk>")  # texts framed to see a tokenizer's special tokens


def _shape(enc) -> str:
    """An encoding's layout, one letter a token: s special, a first sequence, b second."""
    return "".join("s" if i is None else "ab"[i] for i in enc.sequence_ids)


@functools.lru_cache(maxsize=16)  # per tokenizer: encode_ner / encode_qa ask once an example
def framing(tok, task: str = "NER") -> Framing:
    """The :class:`Framing` of a tokenizer (a jsteer Tokenizer or a ``tokenizers.Tokenizer``).

    The special tokens and token types are read off the tokenizer's own post-processor (a probe
    sequence and pair encoded with special tokens), so inputs are framed as HF's tokenizer
    frames them. A tokenizer without a post-processor (a bare ``tokenizers.Tokenizer``) gets
    BERT's framing with its ``[CLS]`` / ``[SEP]`` (a jsteer Tokenizer's cls / sep roles); one with
    neither, or with a framing other than ``prefix A suffix`` / ``prefix A middle B end``, is
    refused (ValueError naming its kind and ``task``). Byte-level BPE tokenizers get a space
    before each pre-split word (HF's token-classification recipe for RoBERTa,
    ``add_prefix_space=True``: every word, the first included, takes its in-sentence form)."""
    raw = raw_tokenizer(tok)
    kind = tokenizer_kind(raw)
    pad = _role(tok, raw, "pad", ("[PAD]", "<pad>"))
    common = dict(
        unk_id=_role(tok, raw, "unk", ("[UNK]", "<unk>")),
        pad_id=0 if pad is None else pad,
        word_prefix=" " if _byte_level(raw) else "",
    )
    probe = next((t for t in _PROBES if raw.encode(t, add_special_tokens=False).ids), None)
    if probe is None:
        raise ValueError(
            f"the {kind} tokenizer encodes none of {list(_PROBES)} to a token (an empty vocabulary?); "
            f"KALA's {task} input cannot be tokenized with it"
        )
    single, pair = raw.encode(probe, add_special_tokens=True), raw.encode(probe, probe, add_special_tokens=True)
    if "s" not in _shape(pair):  # no post-processor: BERT's framing with the [CLS] / [SEP] roles
        cls_id, sep_id = _role(tok, raw, "cls", ("[CLS]",)), _role(tok, raw, "sep", ("[SEP]",))
        if cls_id is None or sep_id is None:
            raise ValueError(
                f"the {kind} tokenizer adds no special tokens (no post-processor) and has no [CLS] / "
                f"[SEP] tokens; KALA's {task} input needs a BERT-family framing ([CLS] ... [SEP], or "
                f"RoBERTa's <s> ... </s>): use the model's own tokenizer.json"
            )
        return Framing(
            kind,
            prefix=(cls_id,),
            suffix=(sep_id,),
            middle=(sep_id,),
            end=(sep_id,),
            types=((0,), 0, (0,), 1, (1,)),
            **common,
        )
    m, m1 = re.fullmatch(r"(s*)(a+)(s*)(b+)(s*)", _shape(pair)), re.fullmatch(r"(s*)(a+)(s*)", _shape(single))
    if m is None or m1 is None or single.ids[: m1.end(1)] != pair.ids[: m.end(1)]:
        raise ValueError(
            f"the {kind} tokenizer frames a pair as {pair.tokens} and one sequence as {single.tokens}; "
            f"KALA's {task} input needs a BERT-family framing ([CLS] A [SEP] B [SEP], or RoBERTa's "
            f"<s> A </s></s> B </s>)"
        )
    ids, tt = pair.ids, pair.type_ids
    part = lambda k: tuple(ids[m.start(k) : m.end(k)])  # noqa: E731
    types = lambda k: tuple(tt[m.start(k) : m.end(k)])  # noqa: E731
    return Framing(
        kind,
        prefix=part(1),
        suffix=tuple(single.ids[m1.start(3) :]),
        middle=part(3),
        end=part(5),
        types=(types(1), tt[m.start(2)], types(3), tt[m.start(4)], types(5)),
        **common,
    )


def example_knowledge(
    mentions: Sequence[Mention], vocab: EntityVocab, kg: Optional[KnowledgeGraph], max_neighbors: int
) -> tuple[ExampleGraph, dict[str, int]]:
    """Graph of one example and {entity id: local node}. Overlapping mentions raise ValueError
    (each token is mapped to one mention's node)."""
    clash = first_overlap(mentions)
    if clash is not None:
        a, b = (mentions[i] for i in clash)
        raise ValueError(f"mentions {describe(a)} and {describe(b)} overlap (a token can belong to one mention only)")
    local = mention_entities(mentions)
    if kg is None:
        from jsteer.kala.graph import add_self_loops

        z = np.zeros(0, np.int32)
        g = add_self_loops(ExampleGraph(np.asarray([vocab(e) for e in local], np.int32), z, z, z, len(local)))
    else:
        g = kg.subgraph(local, vocab, max_neighbors)
    return g, {e: i for i, e in enumerate(local)}


def encode_ner(
    words: Sequence[str],
    tags: Sequence[str],
    mentions: Sequence[Mention],
    tokenizer,
    label_names: Sequence[str],
    vocab: EntityVocab,
    kg: Optional[KnowledgeGraph] = None,
    max_len: int = 128,
    max_neighbors: int = 4,
) -> dict:
    """One sentence -> an encoded example (see the module docstring). Word-level mention spans."""
    fr = framing(tokenizer, "NER")
    if len(fr.prefix) > 1 or len(fr.suffix) > 1:
        raise ValueError(
            f"the {fr.kind} tokenizer puts {len(fr.prefix)} / {len(fr.suffix)} special tokens before / "
            f"after a sentence; KALA's NER input takes one each ([CLS] ... [SEP] or <s> ... </s>)"
        )
    pieces = [fr.word_prefix + w for w in words] if fr.word_prefix else words
    enc = ner_lib.encode_tagged(
        raw_tokenizer(tokenizer),
        pieces,
        ner_lib.label_encoder(label_names)(tags),
        max_len=max_len,
        cls_id=fr.prefix[0] if fr.prefix else None,
        sep_id=fr.suffix[0] if fr.suffix else None,
        unk_id=fr.unk_id,
    )
    graph, node_of = example_knowledge(mentions, vocab, kg, max_neighbors)
    word_node = np.full(len(words), -1, np.int32)
    for m in mentions:
        if m.end > len(words):
            raise ValueError(f"mention {m.text!r} [{m.start}:{m.end}] is past the sentence's {len(words)} words")
        word_node[m.start : m.end] = node_of[m.id]
    widx = enc["word_index"]
    token_node = np.where(widx >= 0, word_node[np.maximum(widx, 0)], -1).astype(np.int32)
    token_entity = np.where(token_node >= 0, graph.entity[np.maximum(token_node, 0)] if graph.n_node else 0, 0)
    enc.update(
        token_node=token_node,
        token_entity=token_entity.astype(np.int32),
        graph=graph,
        n_unseen=sum(1 for e in node_of if vocab(e) == 0),
        num_words=len(words),
        pad_id=fr.pad_id,
    )
    return enc


def collate(
    examples: Sequence[dict],
    batch_size: int,
    length: Optional[int] = None,
    keys: Sequence[str] = ("input_ids", "labels"),
    graph_min: Union[tuple[int, ...], Mapping[int, tuple[int, ...]]] = (0, 0),
    graph_rungs: int = 0,
) -> dict:
    """Pad a list of encoded examples to [batch_size, length] arrays + a padded graph batch.

    Missing rows (a short last batch) are empty examples: no tokens, labels ignored, no graph.
    ``input_ids`` are padded with the examples' ``pad_id`` (the tokenizer's: 0 for BERT's
    ``[PAD]``, 1 for RoBERTa's ``<pad>``, whose position ids count the tokens that are not it).
    ``graph_min``: node / edge (/ mentioned-node) buckets, one tuple or one per length bucket
    (see :func:`graph_buckets`); ``graph_rungs``: how many smaller node / edge buckets a batch with
    a small graph may take (``smaller`` of :func:`jsteer.kala.graph.stack_graphs`).
    With per-length buckets (and no fixed ``length``), a batch whose graph overflows its length
    bucket's graph buckets is padded to the next longer length bucket whose graph buckets hold it
    (padding tokens change nothing), a shape the run compiles anyway; only where none holds it do
    the graph buckets double (a new shape: a compile, which on CPU costs tens of steps).
    Returns int32 NumPy arrays with a leading batch axis: "input_ids", "attention_mask", <keys>,
    "token_node" (node of the padded batch graph per token, -1 none), "token_entity", "example_mask" (1 for real
    rows) and the stacked graph arrays of :func:`jsteer.kala.graph.stack_graphs`.
    """
    if len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples do not fit batch_size={batch_size}")
    t = length or KALA_LENGTHS(max(len(e["input_ids"]) for e in examples))
    if length is None and isinstance(graph_min, Mapping) and t in graph_min:
        t = _length_for_graph(examples, t, graph_min)
    pad = int(examples[0].get("pad_id", 0)) if examples else 0
    fill = {
        "input_ids": pad,
        "labels": ner_lib.IGNORE_INDEX,
        "token_type_ids": 0,
        "token_node": -1,
        "token_entity": 0,
        "word_index": -1,
        "start_positions": 0,
        "end_positions": 0,
    }
    out = {}
    for k in list(keys) + ["token_node", "token_entity"]:
        if examples[0][k].ndim == 0:
            arr = np.zeros((batch_size,), np.int32)
            for i, e in enumerate(examples):
                arr[i] = e[k]
        else:
            arr = np.full((batch_size, t), fill.get(k, 0), np.int32)
            for i, e in enumerate(examples):
                arr[i, : len(e[k])] = e[k]
        out[k] = arr
    mask = np.zeros((batch_size, t), np.int32)
    for i, e in enumerate(examples):
        mask[i, : len(e["input_ids"])] = 1
    out["attention_mask"] = mask
    if "input_ids" not in out:
        out["input_ids"] = np.full((batch_size, t), pad, np.int32)
    graphs = [e["graph"] for e in examples] + [ExampleGraph.empty()] * (batch_size - len(examples))
    if isinstance(graph_min, Mapping):
        graph_min = graph_min.get(t, (0, 0))
    out.update(stack_graphs(graphs, out["token_node"], *graph_min, smaller=graph_rungs))
    out["example_mask"] = (np.arange(batch_size) < len(examples)).astype(np.int32)
    return out


def _length_for_graph(examples: Sequence[dict], t: int, graph_min: Mapping[int, tuple[int, ...]]) -> int:
    """``t``, or the shortest longer length bucket of ``graph_min`` whose graph buckets hold the
    batch's graph when ``t``'s do not (``t`` again when none does)."""
    need = graph_need([e["graph"] for e in examples], [e["token_node"] for e in examples])
    fits = lambda mins: all(m >= n for m, n in zip(mins, need))  # noqa: E731
    if fits(graph_min[t]):
        return t
    return next((u for u in sorted(graph_min) if u > t and fits(graph_min[u])), t)


def batches(
    examples: Sequence[dict],
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    keys: Sequence[str] = ("input_ids", "labels"),
    length: Optional[int] = None,
    group_by_length: bool = False,
    graph_min: Union[None, tuple[int, ...], Mapping[int, tuple[int, ...]]] = None,
    graph_rungs: int = 0,
    graph: bool = True,
) -> Iterator[tuple[np.ndarray, dict]]:
    """Yield (indices of the examples in the batch, collated batch). Without shuffle the order
    is the input order; the last batch is padded with empty rows. ``group_by_length`` (with
    shuffle): sort each run of 16 batches' worth of shuffled examples by length and shuffle the
    resulting batches, so most batches land in a short length bucket. ``graph_min``: graph
    buckets, default :func:`graph_buckets` of the examples; ``graph_rungs``: see
    :func:`collate`. ``graph=False`` (a model that ignores the graph, e.g. fine-tuning): no graph
    buckets, so no batch is padded to a longer length for its graph's sake and the batches'
    token arrays do not depend on the graphs."""
    if not graph:
        graph_min = (0, 0)
    elif graph_min is None:
        graph_min = graph_buckets(examples, batch_size, length=length)
    order = np.arange(len(examples))
    rng = np.random.default_rng(seed)
    if shuffle:
        order = rng.permutation(len(examples))
    groups = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    if shuffle and group_by_length:
        chunk = 16 * batch_size
        groups = []
        for s in range(0, len(order), chunk):
            part = sorted(order[s : s + chunk], key=lambda i: len(examples[i]["input_ids"]))
            groups += [np.asarray(part[k : k + batch_size]) for k in range(0, len(part), batch_size)]
        groups = [groups[i] for i in rng.permutation(len(groups))]
    for idx in groups:
        yield idx, collate([examples[i] for i in idx], batch_size, length, keys, graph_min, graph_rungs)


def graph_buckets(
    examples: Sequence[dict], batch_size: int, buckets: Sequence[int] = KALA_LENGTHS.sizes, length: Optional[int] = None
) -> dict[int, tuple[int, ...]]:
    """Smallest node / edge / mentioned-node buckets per length bucket, for batches of these
    examples (see :func:`jsteer.kala.graph.stack_graphs`).

    Graph size grows with sentence length, so one pair for every batch would pad the many short
    batches to the size of the long ones (on NCBI-Disease, 4-5x more nodes and edges than they
    have). Per length bucket t: the mean total of a batch of the examples whose length bucket
    is t plus two standard deviations of that total (or, if larger, the 98th percentile of the
    totals of B examples adjacent in length, as length-grouped batches are), rounded up to a
    quarter octave (2^k x 1, 1.25, 1.5 or 1.75). Most batches of a length bucket then share one
    graph shape; a rare larger one (about 2%) moves to a longer length bucket (:func:`collate`)
    or, failing that, doubles all three sizes (:func:`jsteer.kala.graph.stack_graphs`), so the
    number of compiled shapes stays bounded. Moving is the dear case -- twice the tokens cost the
    backbone about twice as much, while a quarter octave more graph padding costs at most about 2%
    of a relational KALA step (MiniLM, CPU) -- hence 98% rather than 95%: on CoNLL-2003 (3000
    sentences, B = 16, 2 epochs) 9-12 of the ~296 short batches of a run moved at 95%, 0-5 at 98%.
    ``length``: every batch padded to this length instead (one group).
    Returns {length bucket: (node, edge, mentioned-node buckets)}.
    """
    by_t: dict[int, list[dict]] = {}
    for e in examples:
        by_t.setdefault(length or bucket(len(e["input_ids"]), buckets), []).append(e)
    out = {}
    for t, group in sorted(by_t.items()):
        group = sorted(group, key=lambda e: len(e["input_ids"]))
        sizes = np.asarray(
            [
                (e["graph"].n_node, e["graph"].n_edge, np.unique(e["token_node"][e["token_node"] >= 0]).size)
                for e in group
            ],
            np.float64,
        )
        # a batch of B random examples of the group exceeds this in about 2% of batches ...
        high = sizes.mean(0) * batch_size + 2.0 * sizes.std(0) * np.sqrt(batch_size)
        if len(group) > batch_size:  # ... and length-grouped batches (neighbours in length) too
            windows = np.stack([np.convolve(sizes[:, j], np.ones(batch_size), "valid") for j in range(3)], 1)
            high = np.maximum(high, np.percentile(windows, 98, axis=0))
        out[t] = tuple(quarter_octave(int(v) + 1, batch_size) for v in high)
    return out


def quarter_octave(n: int, minimum: int = 1) -> int:
    """Smallest 2^k x (1, 1.25, 1.5 or 1.75) that is >= max(n, minimum) and an integer."""
    n = max(n, minimum, 1)
    base = 1 << max(n.bit_length() - 3, 0)  # 2^k / 4 with 2^k <= n < 2^(k+1), for k >= 2
    return -(-n // base) * base


def device_batch(batch: Mapping, graph: bool = True) -> dict:
    """The arrays a model step needs (drops host bookkeeping; with ``graph=False`` also the
    padded graph arrays, whose shapes would make a jitted step of a model that ignores them
    recompile for every graph bucket)."""
    drop = ("word_index", "offsets") + (() if graph else GRAPH_KEYS)
    return {k: v for k, v in batch.items() if k not in drop}
