"""KALA: Knowledge-Augmented Language model Adaptation (Kang et al., 2022) on jsteer's BERT.

Pieces (each module's docstring has the details):

- :mod:`~jsteer.kala.formats`   JSON Lines mentions (text, start, end, id) and facts (h, r, t),
                                validated with errors naming file, line and field.
- :mod:`~jsteer.kala.builder`   offline graph builder for a CoNLL file: mined lexicon (or
                                spaCy), entity ids by normalised surface form, pattern facts;
                                :mod:`~jsteer.kala.qa_builder` the same for SQuAD contexts.
- :mod:`~jsteer.kala.entities`  entity / relation vocabularies, per-example subgraphs, entity
                                memory initialised from contextual mention features.
- :mod:`~jsteer.kala.graph`     relation-aware GATv2 on ``jraph.GraphsTuple``, null masking,
                                graph batching padded to static buckets.
- :mod:`~jsteer.kala.kfm`       knowledge-conditioned feature modulation -> ``jsteer.hooks.FiLM``.
- :mod:`~jsteer.kala.model`     ``KalaModel`` (NER / QA) and the baselines (fine-tuning, +1 layer,
                                point-wise, relational).
- :mod:`~jsteer.kala.data`, :mod:`~jsteer.kala.qa`, :mod:`~jsteer.kala.metrics`,
  :mod:`~jsteer.kala.train`, :mod:`~jsteer.kala.pipeline`, :mod:`~jsteer.kala.cli`,
  :mod:`~jsteer.kala.runs`      tasks, metrics, training on ``jsteer.train.Trainer``, CLI and its
                                run folders (run.json: no mixing of runs on resume).
- :mod:`~jsteer.kala.protocol`, :mod:`~jsteer.kala.report`  the NER experiments' protocol (data
                                sets, variants, graphs, caches, one run) and their results report.

NER and extractive QA run from the shell (``jsteer kala build-graph / train / eval`` on CoNLL
or SQuAD v1.1 files, :mod:`~jsteer.kala.cli`) or from Python (:mod:`~jsteer.kala.pipeline`).
For QA, ``build-graph`` mines mentions in the contexts (:mod:`~jsteer.kala.qa_builder`); by
hand it takes a SQuAD v1.1 file, a mentions file keyed by question id (character offsets,
:mod:`~jsteer.kala.formats`) and facts::

    import jax, jsteer
    from jsteer.kala import KalaConfig, KalaModel, init_params, qa, read_facts, read_mentions, train
    from jsteer.kala.entities import EntityVocab, KnowledgeGraph, RelationVocab

    enc = jsteer.load("minilm")
    examples = qa.read_squad("squad.json")
    mentions = read_mentions("squad.mentions.jsonl", {e.qid: e.context for e in examples})
    facts = read_facts("facts.jsonl")
    vocab, relations = EntityVocab.from_mentions(mentions.values()), RelationVocab.from_facts(facts)
    kg = KnowledgeGraph(facts, relations)
    feats = [f for e in examples for f in qa.encode_qa(e, enc.tokenizer, mentions.get(e.qid, ()), vocab, kg)]
    model = KalaModel(enc.config, KalaConfig(num_entities=len(vocab), num_relations=len(relations)), task="qa")
    params = init_params(model, jax.random.PRNGKey(0), encoder_params=enc.params["encoder"])
    fit = train.fit(model, params, feats, train.TrainConfig(), task="qa")
    train.evaluate_qa(model, fit.params, feats, examples)      # {"exact_match": ..., "f1": ...} in percent

(Use separate train / test files in practice; build the vocabularies from the training mentions.)
"""

from jsteer.kala.formats import Fact, FormatError, Mention, read_facts, read_mentions  # noqa: F401
from jsteer.kala.model import METHODS, KalaConfig, KalaModel, default_layers, init_params  # noqa: F401
