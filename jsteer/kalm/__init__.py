"""jsteer.kalm: KALM's typed-vocabulary output head (Liu et al., NAACL 2019) on jsteer decoders.

- :mod:`jsteer.kalm.head`: ``KalmHead``, ``TypedVocab``, the mixture P(y|c) = sum_j P(j|c) P(y|j,c)
- :mod:`jsteer.kalm.model`: ``KalmLM`` (LLaMA backbone + head, optional type input)
- :mod:`jsteer.kalm.train`: LM training, perplexity, context type distributions
- :mod:`jsteer.kalm.decode`: type priors and unsupervised typing
- :mod:`jsteer.kalm.data`: the recipe data (``kalm_namedentitylm``)
"""

from jsteer.kalm.head import KalmConfig, KalmHead, KalmOutput, TypedVocab, token_log_prob, word_log_probs
from jsteer.kalm.model import KalmLM

__all__ = ["KalmConfig", "KalmHead", "KalmLM", "KalmOutput", "TypedVocab", "token_log_prob", "word_log_probs"]
