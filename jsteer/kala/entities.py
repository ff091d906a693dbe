"""Entity and relation vocabularies, per-example graphs, and the entity-memory initialisation.

- :class:`EntityVocab`: entity ids seen in the *training* mentions; index 0 is the null
  entity (``[NULL]``) that every other id (dev / test-only entities) maps to. Its memory row
  is zero and stays zero (the lookup masks it).
- :class:`RelationVocab`: relation names; 0 = self loop (``None`` in KALA's label_map.json),
  1 = unknown relation (``[UNK]``).
- :class:`KnowledgeGraph`: the facts, indexed by entity; :meth:`KnowledgeGraph.subgraph`
  builds one example's :class:`~jsteer.kala.graph.ExampleGraph`: its mentioned (local)
  entities in order of first mention, then up to ``max_neighbors`` 1-hop neighbours of each
  (most frequent facts first) that are in the entity vocabulary -- an unknown neighbour would
  be a null node that carries nothing to its receivers --, and every fact among those nodes as
  edges in *both* directions with the fact's relation id (information flows either way), plus
  self loops.
- :func:`init_memory`: the entity memory initialised from the backbone's contextual features:
  for each (example, entity) the mean hidden state over its mention tokens, then the mean
  over the training examples that mention the entity.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from jsteer.kala.formats import Fact, Mention
from jsteer.kala.graph import ExampleGraph, add_self_loops

PathLike = Union[str, os.PathLike]
NULL = "[NULL]"
SELF = "None"
UNK_REL = "[UNK]"


class EntityVocab:
    """Entity id (str) <-> index; 0 is the null entity."""

    def __init__(self, ids: Sequence[str]):
        ids = [i for i in ids if i != NULL]
        if len(set(ids)) != len(ids):
            raise ValueError("EntityVocab: duplicate entity ids")
        self.ids = [NULL] + list(ids)
        self.index = {e: i for i, e in enumerate(self.ids)}

    @classmethod
    def from_mentions(cls, mentions: Iterable[Sequence[Mention]], min_count: int = 1) -> "EntityVocab":
        """Entities mentioned at least ``min_count`` times, most frequent first (ties by id)."""
        counts = collections.Counter(m.id for ms in mentions for m in ms)
        return cls(sorted((e for e, c in counts.items() if c >= min_count), key=lambda e: (-counts[e], e)))

    def __len__(self) -> int:
        return len(self.ids)

    def __call__(self, entity_id: str) -> int:
        """Index of an entity id, 0 (null) when unknown."""
        return self.index.get(entity_id, 0)

    def save(self, path: PathLike) -> None:
        pathlib.Path(path).write_text(json.dumps(self.ids[1:], ensure_ascii=False))

    @classmethod
    def load(cls, path: PathLike) -> "EntityVocab":
        return cls(json.loads(pathlib.Path(path).read_text()))


class RelationVocab:
    """Relation name <-> index; 0 = self loop, 1 = unknown relation."""

    def __init__(self, names: Sequence[str] = ()):
        self.names = [SELF, UNK_REL] + [n for n in names if n not in (SELF, UNK_REL)]
        self.index = {n: i for i, n in enumerate(self.names)}

    @classmethod
    def from_label_map(cls, path: PathLike) -> "RelationVocab":
        """KALA's ``label_map.json`` ({"None": 0, "[UNK]": 1, "P17": 2, ...})."""
        m = json.loads(pathlib.Path(path).read_text())
        return cls([n for n, _ in sorted(m.items(), key=lambda kv: kv[1])])

    @classmethod
    def from_facts(cls, facts: Iterable[Fact]) -> "RelationVocab":
        counts: collections.Counter = collections.Counter()
        for f in facts:
            counts[f.r] += f.weight
        return cls(sorted(counts, key=lambda r: (-counts[r], r)))

    def __len__(self) -> int:
        return len(self.names)

    def __call__(self, name: str) -> int:
        return self.index.get(name, 1)

    def to_list(self) -> list[str]:
        return list(self.names)


class KnowledgeGraph:
    """Facts indexed by entity id, for building per-example subgraphs."""

    def __init__(self, facts: Iterable[Fact], relations: RelationVocab):
        self.relations = relations
        counts: collections.Counter = collections.Counter()
        for f in facts:
            if f.h != f.t:
                counts[(f.h, f.r, f.t)] += f.weight
        self.edges: dict[tuple[str, str], int] = {}  # (a, b) sorted pair -> relation id
        best: dict[tuple[str, str], int] = {}
        nbr_count: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for (h, r, t), c in counts.items():
            key = (h, t) if h <= t else (t, h)
            # keep the most frequent relation per entity pair
            if c > best.get(key, 0):
                self.edges[key] = relations(r)
                best[key] = c
            nbr_count[h][t] += c
            nbr_count[t][h] += c
        self.neighbors = {
            e: [n for n, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))] for e, c in nbr_count.items()
        }

    def relation(self, a: str, b: str) -> Optional[int]:
        return self.edges.get((a, b) if a <= b else (b, a))

    def subgraph(self, local: Sequence[str], vocab: EntityVocab, max_neighbors: int = 4) -> ExampleGraph:
        """One example's graph; ``local`` are its distinct mentioned entity ids (node order)."""
        nodes = list(dict.fromkeys(local))
        n_local = len(nodes)
        seen = set(nodes)
        for e in list(nodes[:n_local]):
            added = 0
            for nb in self.neighbors.get(e, ()):
                if added >= max_neighbors:
                    break
                if nb not in seen and vocab(nb) != 0:
                    seen.add(nb)
                    nodes.append(nb)
                    added += 1
        snd, rcv, rel = [], [], []
        for i, a in enumerate(nodes):
            for j in range(i + 1, len(nodes)):
                r = self.relation(a, nodes[j])
                if r is not None:
                    snd += [i, j]
                    rcv += [j, i]
                    rel += [r, r]
        g = ExampleGraph(
            entity=np.asarray([vocab(e) for e in nodes], np.int32),
            senders=np.asarray(snd, np.int32),
            receivers=np.asarray(rcv, np.int32),
            relation=np.asarray(rel, np.int32),
            n_local=n_local,
        )
        return add_self_loops(g)


def init_memory(
    hidden_fn: Callable[[dict], np.ndarray],
    batches: Iterable[dict],
    num_entities: int,
    dim: int,
    rng: Optional[np.random.Generator] = None,
    scale: float = 0.02,
) -> np.ndarray:
    """Entity memory [num_entities, dim] from contextual mention features.

    hidden_fn: batch -> hidden states [B, T, D] (e.g. the backbone's last layer).
    batches: dicts with ``token_entity`` int [B, T] (vocab index of the entity mentioned at
      each token, 0 none/null) and ``token_node`` int [B, T] (local node, -1 none).
    Entities never mentioned keep a small random row (normal * scale); row 0 is zero.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    sums = np.zeros((num_entities, dim), np.float64)
    counts = np.zeros((num_entities,), np.int64)
    for batch in batches:
        h = np.asarray(hidden_fn(batch), np.float64)
        ent, node = np.asarray(batch["token_entity"]), np.asarray(batch["token_node"])
        for b in range(h.shape[0]):
            for n in np.unique(node[b][node[b] >= 0]):
                sel = node[b] == n
                e = int(ent[b][sel][0])
                if e > 0:
                    sums[e] += h[b][sel].mean(0)
                    counts[e] += 1
    mem = rng.normal(size=(num_entities, dim)) * scale
    hit = counts > 0
    mem[hit] = sums[hit] / counts[hit][:, None]
    mem[0] = 0.0
    return mem.astype(np.float32)


def mention_entities(mentions: Sequence[Mention]) -> list[str]:
    """Distinct entity ids in order of first mention (the local node order)."""
    return list(dict.fromkeys(m.id for m in mentions))


def counts_unseen(mentions: Sequence[Mention], vocab: EntityVocab) -> int:
    """Number of distinct mentioned entities outside the vocabulary."""
    return sum(1 for e in mention_entities(mentions) if vocab(e) == 0)


def load_label_map(path: PathLike) -> Mapping[str, int]:
    return json.loads(pathlib.Path(path).read_text())
