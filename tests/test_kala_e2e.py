"""End to end: a planted entity -> label correlation that only the graph can carry.

Test sentences mention unseen entities (new tokens, null entity) whose class is visible only
through their knowledge-graph neighbours (see jsteer.kala.synthetic). Relational KALA must
beat plain fine-tuning by a wide margin.
"""

import jax

from jsteer.backbones.bert import BertConfig
from jsteer.kala import data as kdata
from jsteer.kala import entities, synthetic
from jsteer.kala import train as ktrain
from jsteer.kala.model import KalaConfig, KalaModel, init_params


def encoded_task(seed: int, n_train: int, n_test: int):
    """The synthetic task encoded for KALA -> (task, entity vocab, relation vocab, train, test)."""
    task = synthetic.make_task(seed, n_train=n_train, n_test=n_test)
    tok = task.tokenizer()
    vocab = entities.EntityVocab.from_mentions([m for _, _, m in task.train])
    rels = entities.RelationVocab.from_facts(task.facts)
    kg = entities.KnowledgeGraph(task.facts, rels)

    def enc(split):
        return [kdata.encode_ner(w, t, m, tok, synthetic.LABELS, vocab, kg, max_len=16) for w, t, m in split]

    return task, vocab, rels, enc(task.train), enc(task.test)


# the task, model and training settings of both tests: the step-memory test then compiles the very
# train steps the end-to-end test trained with (a persistent-cache hit when they run in one session)
TASK = dict(seed=0, n_train=192, n_test=64)
TRAIN = dict(lr=2e-3, kala_lr=2e-3, batch_size=32, epochs=30, warmup_ratio=0.1)


def tiny_bert(task):
    return BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )


def test_graph_carries_unseen_entity_labels():
    task, vocab, rels, train, test = encoded_task(**TASK)
    assert all(e["n_unseen"] == e["graph"].n_local > 0 for e in test)  # every test entity is null
    assert all(vocab(m.id) == 0 for _, _, ms in task.test for m in ms)
    bert = tiny_bert(task)
    cfg = ktrain.TrainConfig(**TRAIN)
    gold = [t for _, t, _ in task.test]
    f1 = {}
    for method in ("finetune", "relational"):
        model = KalaModel(
            bert,
            KalaConfig(method=method, num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
            num_labels=len(synthetic.LABELS),
        )
        fit = ktrain.fit(model, init_params(model, jax.random.PRNGKey(0)), train, cfg)
        assert fit.losses[-1] < fit.losses[0]
        f1[method] = ktrain.evaluate_ner(model, fit.params, test, gold, synthetic.LABELS, batch_size=32)["f1"]
    assert f1["relational"] >= 70.0, f1
    assert f1["relational"] >= f1["finetune"] + 40.0, f1


def test_step_memory_is_measured_without_training_and_grows_with_the_graph():
    """Table 11's memory column: an ahead-of-time compile of one train step per method."""
    task, vocab, rels, train, _ = encoded_task(**TASK)
    bert = tiny_bert(task)
    cfg = ktrain.TrainConfig(**TRAIN)
    mem = {}
    for method in ("finetune", "relational"):
        model = KalaModel(
            bert,
            KalaConfig(method=method, num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
            num_labels=len(synthetic.LABELS),
        )
        params = init_params(model, jax.random.PRNGKey(0))
        mem[method] = ktrain.measure_step_memory(model, params, train, cfg)
        count = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        assert mem[method] > 3 * count, (method, mem[method], count)  # params + grads + 2 Adam moments at least
    assert mem["relational"] > mem["finetune"], mem
