"""Type Embeddings on LAMA with SmolLM2-135M (decoder): the paper's Tables 4/7/8 (B, BTo,
PostTE, TE per relation and macro) and Table 6 (type switching).

    # the committed lama_smollm2.json (the paper's absolute lambda grid 0..5; the defaults are in row-norm units):
    .venv/bin/python experiments/typevec_lama.py --lambda-unit abs --lambdas 0,0.5,1,1.5,2,2.5,3,3.5,4,4.5,5
    .venv/bin/python experiments/typevec_lama.py --small     # tiny run for CI / notebooks (lama_smollm2_small)
    .venv/bin/python experiments/typevec_lama.py --switch-only [--tag smollm2]   # Table 6 only, see below
    .venv/bin/python experiments/typevec_lama.py --mode layer --layers 16,22,26,29 --lambda-unit resid \
        --lambdas 0,0.1,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6 --tag smollm2_layersel
    .venv/bin/python experiments/typevec_lama.py --mode layer --layers 16,22,26,29 --lambda-unit resid \
        --lambdas 0,0.02,0.04,0.06,0.08,0.1,0.125,0.15,0.175,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6 \
        --tag smollm2_layersel_fine

Writes experiments/results/typevec/lama_<tag>.json, .md and .png (``--tag``, default smollm2).
The experiment, its tables and its plot are :mod:`jsteer.typevec.lama_experiment`
(notebooks/type_embeddings.ipynb shows the same).

Protocol (deviations from the paper, which used BERT, are listed in the JSON under "protocol"):
* data: the type-grouped LAMA CSVs (``type_embedding/processed_lama``). A decoder answers
  with the next token after the prompt cut before [MASK], so a relation qualifies when its
  prompts have nothing but punctuation after [MASK]; gold answers must be one token in their
  leading-space form (" Paris"). Every skipped prompt is counted by reason.
* type vectors: 10 examples per type drawn from the KG list weighted by degree (seed 0),
  single-token entries only; TE = -v1 (unit norm, oriented towards the examples).
* TE is added at the predicting position (``--mode pos``; ``all`` = every prompt token;
  ``layer`` = the residual stream of the predicting position after decoder layer ``--layer``,
  a decoder adaptation that is not in the paper; ``--layers 16,22,26,29`` chooses the layer
  on the hold-out, see :func:`jsteer.typevec.protocol.select_layer`), lambda tuned per
  relation on a seeded 5% hold-out over ``--lambdas`` by P@1, reported on the rest.
  ``--lambda-unit`` (:func:`jsteer.typevec.protocol.lambda_unit`): ``abs`` (lambda multiplies
  the unit TE), ``row_norm`` (units of the mean input-embedding row norm, 3.20 for
  SmolLM2-135M) or ``resid`` (units of the mean residual-stream norm after ``--layer`` at the
  predicting position, measured on the hold-out prompts only). ``jsteer typevec probe`` takes
  the same ``--mode layer --layers ... --lambda-unit resid``. PostTE re-ranks the plain model's
  scores by w * cos(E_v, TE), w tuned on the same hold-out over 0..30. BTo inserts type words
  before the answer: "the <type>" (the paper's), "the <type> of" or "the <type> called", the
  form chosen per relation on the same hold-out
  (``probe.BTO_FORMS``; with "the <type>" alone a decoder continues "... born in the city" with
  "of" or a comma, and BTo scored 0.001 macro P@1).
* CPU budget: at most ``--max-test`` reported prompts per relation (seeded subsample); the
  hold-out is 5% of the full relation.
* type switching (Table 6): Google-RE place-of-birth facts asked with the date-of-birth
  template "[X] (born [Y])."; TEs E_city and E_city^optim = E_city minus its projection on
  E_year. SmolLM2 has no year token: " 1985" is " " + "1" + "9" + "8" + "5". E_year is the
  type vector of the ten digit tokens "0".."9", the tokens every year answer is written with
  (:func:`jsteer.typevec.lama_experiment.year_examples`; checked against every KG year
  label). Runs before this change built E_year from the first token of 10 sampled year labels,
  which is the whitespace token " " (id 216) for every year: one example, labelled "2012" in
  their JSON.
  ``--switch-only`` re-runs just this part with the City vector, mode, layer and lambda unit
  / grid of the existing ``lama_<tag>.json`` and replaces its ``type_switching`` (and the .md).
"""

from __future__ import annotations

import sys

from jsteer.typevec.lama_experiment import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
