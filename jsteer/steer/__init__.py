"""jsteer.steer: LM-Steer (Han et al., "Word Embeddings Are Steers for Language Models").

    logits = c^T (I + sum_i eps_i W_i) E,   computed as  c' = c + sum_i eps_i W_i c,  c' E^T

Modules: head (the steer math and baselines), train (frozen-backbone training on cached
hidden states), transfer (map a steer to another model), interpret (SVD of W),
highlight (per-token log-ratio and best span), artifact (save / load), cli. The experiments'
pieces: data (SST-5 / Jigsaw splits, prompts, on-policy texts, caches), evaluate (fine-tuned
MiniLM evaluators, perplexity, diversity, sampling), protocol (choice rules, detox readings,
sweep recipes), report (results tables and plots).
"""

from jsteer.steer.head import (  # noqa: F401
    apply,
    full_matrix,
    init,
    init_blacklist,
    init_offset,
    logit_bias,
    make_eps,
    steer_hidden,
    to_hooks,
    to_steer,
)
