"""K-BERT (Liu et al., AAAI 2020) as a KALA-harness variant: facts injected as a sentence tree.

Data side (:func:`build_tree`, :func:`encode_ner`): after the last token of every mention the
facts (relation, neighbour entity) of its entity are inserted as *branches* of word pieces::

    [CLS] Tim Cook is visiting Beijing now [SEP]
                 +- CEO Apple        +- capital China

    tokens:   [CLS] Tim Cook CEO Apple is visiting Beijing capital China now [SEP]
    soft pos:   0    1    2   3    4    3     4       5       6      7     6    7
    branch:     0    0    0   1    1    0     0       0       2      2     0    0
    owner:      0    1    1   1    1    0     0       2       2      2     0    0

Soft positions continue from the entity into its branch, and the sentence resumes as if the
branch were not there. ``branch`` numbers the branches (0 = the sentence, the "trunk");
``owner`` is the mention a token belongs to (trunk) or hangs from (branch), 0 for none.

Model side (:func:`visible_matrix`): token i may attend to token j iff

    both are trunk tokens                       (the sentence sees itself, never branches)
    or both are in the same branch              (a fact sees itself)
    or one is a branch token and the other a trunk token of the mention it hangs from
                                                (a fact and its entity see each other)

passed to the unmodified backbone as ``Hooks(attn_bias=0 | -inf, position_ids=soft positions)``.
K-BERT adds no parameters; branch tokens carry label -100 and word index -1, so the harness'
loss and word-level evaluation ignore them.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jsteer.backbones.base import NEG_INF
from jsteer.backbones.bert import BertConfig
from jsteer.data import ner as ner_lib
from jsteer.hooks import Hooks
from jsteer.kala import data as kdata
from jsteer.kala.entities import EntityVocab, KnowledgeGraph, mention_entities
from jsteer.kala.formats import Mention
from jsteer.kala.variants.common import VariantModel

Array = jnp.ndarray
TREE_KEYS = ("soft_position", "tree_branch", "tree_owner")


# ----------------------------------------------------------------------------------------------
# the sentence tree (NumPy, host side)


def mention_runs(token_node: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of tokens pointing at the same node: [(start, end_exclusive, node)]."""
    runs, i, n = [], 0, len(token_node)
    while i < n:
        node = int(token_node[i])
        if node < 0:
            i += 1
            continue
        j = i + 1
        while j < n and int(token_node[j]) == node:
            j += 1
        runs.append((i, j, node))
        i = j
    return runs


def build_tree(
    example: Mapping[str, np.ndarray], branches: Mapping[int, Sequence[Sequence[int]]], max_len: Optional[int] = None
) -> dict:
    """Insert branches into an encoded example (see the module docstring).

    example: a harness-encoded example (``input_ids``, ``labels``, ``word_index``,
      ``token_node``, ``token_entity``, ...; 1-D arrays of the trunk length L).
    branches: {local node: [token ids of one branch, ...]}; each mention run of that node gets
      the node's branches after its last token.
    max_len: total length cap; branches that would cross it are dropped whole (the sentence is
      never cut here).
    Returns a new example: the 1-D arrays expanded (branch tokens: label -100, word index -1,
    token node -1, token entity 0) plus int32 ``soft_position``, ``tree_branch``,
    ``tree_owner`` [L'] and ``n_branch_tokens``. Other keys are copied.
    """
    ids = np.asarray(example["input_ids"])
    length = len(ids)
    per_token = {
        k: np.asarray(v) for k, v in example.items() if isinstance(v, np.ndarray) and v.ndim == 1 and len(v) == length
    }
    fill = {"labels": ner_lib.IGNORE_INDEX, "word_index": -1, "token_node": -1, "token_entity": 0}
    cap = max_len if max_len is not None else 1 << 30
    runs = mention_runs(per_token["token_node"])
    after: dict[int, list[tuple[int, list[int]]]] = {}  # trunk index -> [(mention id, branch)]
    budget = cap - length
    for m, (_s, e, node) in enumerate(runs, start=1):
        for br in branches.get(node, ()):
            br = [int(x) for x in br]
            if br and len(br) <= budget:
                after.setdefault(e - 1, []).append((m, br))
                budget -= len(br)
    owner_of = np.zeros(length, np.int32)
    for m, (s, e, _node) in enumerate(runs, start=1):
        if any(mm == m for mm, _ in after.get(e - 1, ())):
            owner_of[s:e] = m
    cols: dict[str, list] = {k: [] for k in per_token}
    soft, branch_id, owner = [], [], []
    n_branch = 0
    for i in range(length):
        for k in per_token:
            cols[k].append(per_token[k][i])
        pos = i  # trunk tokens keep their sentence position
        soft.append(pos)
        branch_id.append(0)
        owner.append(int(owner_of[i]))
        for m, br in after.get(i, ()):
            n_branch += 1
            for step, tok in enumerate(br, start=1):
                for k in per_token:
                    cols[k].append(tok if k == "input_ids" else fill.get(k, 0))
                soft.append(pos + step)
                branch_id.append(n_branch)
                owner.append(m)
    out = {k: v for k, v in example.items() if k not in per_token}
    out.update({k: np.asarray(v, np.int32) for k, v in cols.items()})
    out["soft_position"] = np.asarray(soft, np.int32)
    out["tree_branch"] = np.asarray(branch_id, np.int32)
    out["tree_owner"] = np.asarray(owner, np.int32)
    out["n_branch_tokens"] = int(len(soft) - length)
    return out


def visible_matrix_np(branch: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """bool [L, L] reference of :func:`visible_matrix` for one example (NumPy)."""
    branch, owner = np.asarray(branch), np.asarray(owner)
    trunk = branch == 0
    both_trunk = trunk[:, None] & trunk[None, :]
    same_branch = (branch[:, None] == branch[None, :]) & ~trunk[:, None]
    same_owner = (owner[:, None] == owner[None, :]) & (owner[:, None] > 0)
    anchor = same_owner & (trunk[:, None] != trunk[None, :])
    return both_trunk | same_branch | anchor


def visible_matrix(branch: Array, owner: Array) -> Array:
    """bool [B, T, T] from ``tree_branch`` / ``tree_owner`` [B, T] (see the module docstring)."""
    trunk = branch == 0
    both_trunk = trunk[:, :, None] & trunk[:, None, :]
    same_branch = (branch[:, :, None] == branch[:, None, :]) & ~trunk[:, :, None]
    same_owner = (owner[:, :, None] == owner[:, None, :]) & (owner[:, :, None] > 0)
    anchor = same_owner & (trunk[:, :, None] != trunk[:, None, :])
    return both_trunk | same_branch | anchor


def tree_hooks(config: BertConfig, soft_position: Array, branch: Array, owner: Array) -> Hooks:
    """Hooks carrying the visible matrix as an additive bias and the soft positions (RoBERTa
    layouts shift positions by ``pad_token_id + 1`` as their tables expect)."""
    bias = jnp.where(visible_matrix(branch, owner), 0.0, NEG_INF).astype(jnp.float32)
    offset = config.pad_token_id + 1 if config.layout == "roberta" else 0
    return Hooks(attn_bias=bias, position_ids=soft_position.astype(jnp.int32) + offset)


# ----------------------------------------------------------------------------------------------
# facts as text


def fact_text(relation: str, entity: str) -> str:
    """Branch text of a fact: relation name (underscores as spaces) then the entity text."""
    return f"{relation.replace('_', ' ')} {entity}".strip()


def entity_branches(
    entity_id: str, kg: Optional[KnowledgeGraph], max_branches: int, entity_text: Optional[Mapping[str, str]] = None
) -> list[str]:
    """Up to ``max_branches`` facts of an entity as text, most frequent neighbours first."""
    if kg is None:
        return []
    out = []
    for nb in kg.neighbors.get(entity_id, ())[:max_branches]:
        rid = kg.relation(entity_id, nb)
        rel = kg.relations.names[rid] if rid is not None else ""
        out.append(fact_text(rel, (entity_text or {}).get(nb, nb)))
    return out


def encode_ner(
    words: Sequence[str],
    tags: Sequence[str],
    mentions: Sequence[Mention],
    tokenizer,
    label_names: Sequence[str],
    vocab: EntityVocab,
    kg: Optional[KnowledgeGraph] = None,
    max_len: int = 128,
    max_neighbors: int = 8,
    max_branches: int = 2,
    branch_tokens: int = 8,
    tree_max_len: Optional[int] = None,
    entity_text: Optional[Mapping[str, str]] = None,
) -> dict:
    """The harness encoding (:func:`jsteer.kala.data.encode_ner`) + the sentence tree.

    Each mentioned entity gets up to ``max_branches`` facts from ``kg`` (its most frequent
    neighbours), each at most ``branch_tokens`` word pieces; the total is capped at
    ``tree_max_len`` (default ``max_len + 32``).
    """
    enc = kdata.encode_ner(words, tags, mentions, tokenizer, label_names, vocab, kg, max_len, max_neighbors)
    raw = kdata.raw_tokenizer(tokenizer)
    branches = {}
    for node, eid in enumerate(mention_entities(mentions)):
        texts = entity_branches(eid, kg, max_branches, entity_text)
        branches[node] = [raw.encode(tx, add_special_tokens=False).ids[:branch_tokens] for tx in texts]
    return build_tree(enc, branches, tree_max_len if tree_max_len is not None else max_len + 32)


# ----------------------------------------------------------------------------------------------
# model


class KBertModel(VariantModel):
    """The unmodified BERT encoder run on the sentence tree through hooks + task head.

    Needs ``extras`` with the :data:`TREE_KEYS` arrays [B, T]; ``graph`` / ``token_node`` are
    accepted (harness protocol) and unused.
    """

    method = "kbert"

    def setup_knowledge(self):
        pass  # knowledge arrives in the sentence tree: no parameters of its own

    def hooks(self, input_ids: Array, graph, token_node, deterministic: bool, extras: Optional[dict]) -> Hooks:
        missing = [k for k in TREE_KEYS if extras is None or k not in extras]
        if missing:
            raise ValueError(f"kbert needs extras {list(TREE_KEYS)} (from kbert.encode_ner); missing {missing}")
        for k in TREE_KEYS:
            if extras[k].shape != input_ids.shape:
                raise ValueError(f"extras[{k!r}] must be {input_ids.shape} like input_ids, got {extras[k].shape}")
        return tree_hooks(self.config, extras["soft_position"], extras["tree_branch"], extras["tree_owner"])
