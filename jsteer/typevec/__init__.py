"""jsteer.typevec: Type Embeddings (Saeed & Papotti, "You Are My Type!").

A type vector TE is built from a few example tokens (SVD of their input embeddings, or their
mean) and added with strength lambda to input embeddings to steer which *type* of token a
model predicts. Modules: :mod:`~jsteer.typevec.core` (vectors), :mod:`~jsteer.typevec.sampling`
(examples from KG lists), :mod:`~jsteer.typevec.inject` (hooks), :mod:`~jsteer.typevec.probe`
(LAMA probing; its prompts in :mod:`~jsteer.typevec.lama`, its scoring in
:mod:`~jsteer.typevec.scoring`), :mod:`~jsteer.typevec.protocol` (lambda units, hold-out layer choice),
:mod:`~jsteer.typevec.analysis`, :mod:`~jsteer.typevec.artifact`; the experiments' runs and reports in
:mod:`~jsteer.typevec.lama_experiment` and :mod:`~jsteer.typevec.analysis_report` (not imported here).

Quick start (from the repository root; the KG lists are in ``../shared/data``)::

    import jsteer, jsteer.typevec as tv
    lm = jsteer.load("smollm2-135m")
    s = tv.sampling.sample_type("../shared/data/type_embedding/kg_samples", "City", lm.tokenizer)
    te = tv.make(lm.input_embeddings(), s.token_ids)             # [D], unit norm
    ids, mask = lm.encode_batch(["Dante was born in"])
    where = tv.inject.last_positions(mask)                       # [B, T]: the predicting position
    hooks = tv.inject(te, 2.0, where)                            # lambda 2.0 (experiments: 0..5)
    logits = lm.forward(ids, mask, hooks=hooks).logits[:, -1]    # next-token logits [B, V]

The submodules are attributes of the package; ``tv.inject`` is the module
:mod:`jsteer.typevec.inject` and, called, its function :func:`~jsteer.typevec.inject.inject`.
"""

from jsteer.typevec import analysis, artifact, core, inject, probe, sampling  # noqa: F401
from jsteer.typevec.core import combine, make, make_all, normalize, project_out  # noqa: F401
from jsteer.typevec.inject import generation_hooks, mask_positions, offset, residual_hooks, row_norm_unit, step_offset  # noqa: F401
