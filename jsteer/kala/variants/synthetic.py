"""A tiny NER task that plain fine-tuning cannot solve but every knowledge variant can.

Entities have a hidden class (PER or LOC). *Known* entities are mentioned in labelled training
sentences. *Novel* entities are mentioned in the test sentences and, during training, only in
**unlabelled** sentences (every label -100: a plain tagger gets no signal from them) where
they are nevertheless linked to their entity ids -- the role an entity-linked corpus plays for
Entities-as-Experts pre-training. The knowledge sources say what a novel entity is:

- the entity memory (a stand-in for pretrained KG embeddings such as ERNIE's TransE vectors):
  ``memory[e] = class_vector(e) + noise``, for known and novel entities alike;
- the knowledge graph: each novel entity is linked (relation ``same_type``) to ``links`` known
  entities of its class (what K-BERT injects as branches and relational KALA aggregates).

Plain fine-tuning sees an untrained token at test time; ERNIE / the adapter / KALA read the
memory row of the linked entity; EaE retrieves it (its entity-linking loss learns the novel
entities from the unlabelled, linked sentences); K-BERT reads the known neighbours' tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab
from jsteer.kala.formats import Fact, Mention
from jsteer.kala.synthetic import CLASSES, LABELS, SPECIAL, link_facts, random_sentence, word_tokenizer

RELATION_WORDS = ("same", "type")


@dataclasses.dataclass
class KnowledgeTask:
    vocab: list[str]
    train: list[tuple[list[str], list[str], list[Mention], bool]]  # words, tags, mentions, labelled
    test: list[tuple[list[str], list[str], list[Mention], bool]]
    facts: list[Fact]
    entities: EntityVocab
    memory: np.ndarray  # [len(entities), entity_dim], row 0 (null) zero

    def tokenizer(self):
        """A word-level ``tokenizers.Tokenizer`` over the task's vocabulary."""
        return word_tokenizer(self.vocab)

    def knowledge_graph(self) -> KnowledgeGraph:
        return KnowledgeGraph(self.facts, RelationVocab.from_facts(self.facts))

    def encode(self, split: str, encode_fn, tokenizer=None, kg=None, max_len: int = 32) -> list[dict]:
        """Encode a split with ``encode_fn(words, tags, mentions, tokenizer, labels, vocab, kg,
        max_len)`` (e.g. ``functools.partial(registry.encode_ner, method)``); the labels of
        unlabelled sentences become -100."""
        tokenizer = tokenizer or self.tokenizer()
        kg = kg or self.knowledge_graph()
        out = []
        for words, tags, mentions, labelled in getattr(self, split):
            enc = encode_fn(words, tags, mentions, tokenizer, LABELS, self.entities, kg, max_len)
            if not labelled:
                enc["labels"] = np.full_like(enc["labels"], -100)
            out.append(enc)
        return out


def make_task(
    seed: int = 0,
    n_known: int = 16,
    n_novel: int = 8,
    n_fillers: int = 20,
    n_train: int = 160,
    n_unlabelled: int = 64,
    n_test: int = 64,
    entity_dim: int = 32,
    links: int = 2,
    noise: float = 0.5,
) -> KnowledgeTask:
    rng = np.random.default_rng(seed)
    known = [(f"ent{i}", CLASSES[i % 2]) for i in range(n_known)]
    novel = [(f"new{i}", CLASSES[i % 2]) for i in range(n_novel)]
    fillers = [f"w{i}" for i in range(n_fillers)]
    vocab = list(SPECIAL) + list(RELATION_WORDS) + fillers + [e for e, _ in known + novel]
    by_class = {c: [e for e, k in known if k == c] for c in CLASSES}
    facts = link_facts(rng, novel, by_class, links)

    def sentence(ents: Sequence[tuple[str, str]], labelled: bool):
        return (*random_sentence(rng, fillers, ents), labelled)

    train = [sentence(known, True) for _ in range(n_train)] + [sentence(novel, False) for _ in range(n_unlabelled)]
    order = rng.permutation(len(train))
    train = [train[i] for i in order]
    test = [sentence(novel, True) for _ in range(n_test)]
    entities = EntityVocab([e for e, _ in known + novel])
    class_vec = {c: rng.normal(size=entity_dim) for c in CLASSES}
    memory = np.zeros((len(entities), entity_dim), np.float32)
    for e, c in known + novel:
        memory[entities(e)] = class_vec[c] + noise * rng.normal(size=entity_dim)
    return KnowledgeTask(vocab=vocab, train=train, test=test, facts=facts, entities=entities, memory=memory)


def run_small(methods=("finetune", "ernie", "kbert", "eae", "adapter"), steps: int = 40, seed: int = 0) -> dict:
    """:func:`make_task` (novel entities known only through knowledge) with a tiny random BERT,
    ``steps`` updates per method: {method: {"f1", "train_seconds", "steps"}} on the test split.
    The tiny rerun of ``experiments/kala_variants.py --small`` and notebooks/knowledge_comparison.ipynb."""
    import functools

    import jax

    from jsteer.backbones.bert import BertConfig
    from jsteer.kala.variants import registry
    from jsteer.kala.variants import train as vtrain

    task = make_task(seed)
    cfg = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    tc = vtrain.TrainConfig(lr=3e-3, kala_lr=3e-3, batch_size=32, max_steps=steps, warmup_ratio=0.1, seed=seed)
    gold = [tags for _, tags, _, _ in task.test]
    kg = task.knowledge_graph()
    out = {}
    for method in methods:
        model = registry.build_model(
            method,
            cfg,
            num_labels=len(LABELS),
            num_entities=len(task.entities),
            **({"entity_heads": 2} if method == "ernie" else {}),
        )
        encode = functools.partial(registry.encode_ner, method)
        train, test = task.encode("train", encode, kg=kg), task.encode("test", encode, kg=kg)
        memory = task.memory if method in ("pointwise", "relational", "ernie", "eae", "adapter") else None
        params = registry.init_params(model, jax.random.PRNGKey(seed), memory=memory, seq_len=16)
        fit = vtrain.fit(model, params, train, tc)
        out[method] = {
            "f1": vtrain.evaluate_ner(model, fit.params, test, gold, LABELS)["f1"],
            "train_seconds": fit.train_seconds,
            "steps": fit.steps,
        }
    return out
