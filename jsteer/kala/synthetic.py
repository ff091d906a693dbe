"""A synthetic NER task whose test labels are learnable only through the entity graph.

Sentences are random filler words with one or two entity mentions; an entity's label (PER or
LOC) is its hidden class. Test sentences mention only *unseen* entities: new surface tokens
(never in training, so a plain token classifier cannot know their class) that are outside the
training entity vocabulary (null entity), but each is linked in the knowledge graph to
``links`` training entities of its own class. Relational KALA can read the class off those
neighbours; point-wise KALA sees only the null entity; plain fine-tuning sees an unknown token.

Used by the end-to-end test, the notebook's tiny rerun and the benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jsteer.kala.formats import Fact, Mention

LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CLASSES = ("PER", "LOC")


@dataclasses.dataclass
class SyntheticNER:
    vocab: list[str]
    train: list[tuple[list[str], list[str], list[Mention]]]  # words, tags, mentions
    test: list[tuple[list[str], list[str], list[Mention]]]
    facts: list[Fact]

    def tokenizer(self):
        """A word-level ``tokenizers.Tokenizer`` over this task's vocabulary."""
        return word_tokenizer(self.vocab)


def word_tokenizer(vocab: Sequence[str]):
    """A word-level ``tokenizers.Tokenizer``: whitespace-split words, ids their places in ``vocab``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tk.pre_tokenizer = WhitespaceSplit()
    return tk


def link_facts(rng: np.random.Generator, ents, by_class: dict, links: int) -> list[Fact]:
    """For each (entity, class) of ``ents``, ``same_type`` facts to ``links`` distinct other
    entities of its class in ``by_class`` ({class: entities}), drawn from ``rng``."""
    return [
        Fact(e, "same_type", str(nb))
        for e, c in ents
        for nb in rng.choice([x for x in by_class[c] if x != e], size=links, replace=False)
    ]


def random_sentence(rng: np.random.Generator, fillers: Sequence[str], ents) -> tuple[list, list, list]:
    """5-8 filler words with one or two of ``ents`` ((entity, class) pairs) at random places,
    drawn from ``rng`` -> (words, tags ``B-<class>`` / ``O``, one-word mentions)."""
    n = int(rng.integers(5, 9))
    words = [str(w) for w in rng.choice(fillers, size=n)]
    tags = ["O"] * n
    k = int(rng.integers(1, 3))
    picks = [ents[i] for i in rng.choice(len(ents), size=k, replace=False)]
    mentions = []
    for (e, c), pos in zip(picks, sorted(rng.choice(n, size=k, replace=False))):
        words[pos], tags[pos] = e, "B-" + c
        mentions.append(Mention(e, int(pos), int(pos) + 1, e))
    return words, tags, mentions


def make_task(
    seed: int = 0,
    n_train_entities: int = 24,
    n_test_entities: int = 12,
    n_fillers: int = 30,
    n_train: int = 256,
    n_test: int = 128,
    links: int = 2,
) -> SyntheticNER:
    rng = np.random.default_rng(seed)
    train_ents = [(f"ent{i}", CLASSES[i % 2]) for i in range(n_train_entities)]
    test_ents = [(f"new{i}", CLASSES[i % 2]) for i in range(n_test_entities)]
    fillers = [f"w{i}" for i in range(n_fillers)]
    vocab = list(SPECIAL) + fillers + [e for e, _ in train_ents + test_ents]
    by_class = {c: [e for e, k in train_ents if k == c] for c in CLASSES}
    # training entities also have same-class neighbours
    facts = link_facts(rng, test_ents, by_class, links) + link_facts(rng, train_ents, by_class, links)
    train = [random_sentence(rng, fillers, train_ents) for _ in range(n_train)]
    test = [random_sentence(rng, fillers, test_ents) for _ in range(n_test)]
    return SyntheticNER(vocab=vocab, train=train, test=test, facts=facts)
