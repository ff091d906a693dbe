"""KALA: Knowledge-Augmented Language model Adaptation (Kang et al., 2022) on jsteer's BERT.

Pieces (each module's docstring has the details):

- :mod:`~jsteer.kala.formats`   JSON Lines mentions (text, start, end, id) and facts (h, r, t),
                                validated with errors naming file, line and field.
- :mod:`~jsteer.kala.builder`   offline graph builder for a CoNLL file: mined lexicon (or
                                spaCy), entity ids by normalised surface form, pattern facts.
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
"""

from jsteer.kala.formats import Fact, FormatError, Mention, read_facts, read_mentions  # noqa: F401
from jsteer.kala.model import METHODS, KalaConfig, KalaModel, default_layers, init_params  # noqa: F401
