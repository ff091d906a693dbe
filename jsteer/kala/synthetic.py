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

import numpy as np

from jsteer.kala.formats import Fact, Mention

LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclasses.dataclass
class SyntheticNER:
    vocab: list[str]
    train: list[tuple[list[str], list[str], list[Mention]]]  # words, tags, mentions
    test: list[tuple[list[str], list[str], list[Mention]]]
    facts: list[Fact]

    def tokenizer(self):
        """A word-level ``tokenizers.Tokenizer`` over this task's vocabulary."""
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        tk = Tokenizer(WordLevel({w: i for i, w in enumerate(self.vocab)}, unk_token="[UNK]"))
        tk.pre_tokenizer = WhitespaceSplit()
        return tk


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
    classes = ("PER", "LOC")
    train_ents = [(f"ent{i}", classes[i % 2]) for i in range(n_train_entities)]
    test_ents = [(f"new{i}", classes[i % 2]) for i in range(n_test_entities)]
    fillers = [f"w{i}" for i in range(n_fillers)]
    vocab = list(SPECIAL) + fillers + [e for e, _ in train_ents + test_ents]
    facts = []
    by_class = {c: [e for e, k in train_ents if k == c] for c in classes}
    for e, c in test_ents:
        for nb in rng.choice(by_class[c], size=links, replace=False):
            facts.append(Fact(e, "same_type", str(nb)))
    for e, c in train_ents:  # training entities also have same-class neighbours
        for nb in rng.choice([x for x in by_class[c] if x != e], size=links, replace=False):
            facts.append(Fact(e, "same_type", str(nb)))

    def sentence(ents):
        n = int(rng.integers(5, 9))
        words = [str(w) for w in rng.choice(fillers, size=n)]
        tags = ["O"] * n
        k = int(rng.integers(1, 3))
        picks = [ents[i] for i in rng.choice(len(ents), size=k, replace=False)]
        mentions = []
        slots = sorted(rng.choice(n, size=k, replace=False))
        for (e, c), pos in zip(picks, slots):
            words[pos] = e
            tags[pos] = "B-" + c
            mentions.append(Mention(e, int(pos), int(pos) + 1, e))
        return words, tags, mentions

    train = [sentence(train_ents) for _ in range(n_train)]
    test = [sentence(test_ents) for _ in range(n_test)]
    return SyntheticNER(vocab=vocab, train=train, test=test, facts=facts)
