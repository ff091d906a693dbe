"""Knowledge-conditioned Feature Modulation (KALA section 3.2).

For a layer l with KFM, the entity representation e_t of the entity mentioned at token t
(zero where no entity is mentioned) gives four per-token vectors through four independent
Linear-ReLU-Linear maps::

    gamma_in  = f1(e_t),  beta_in  = f2(e_t)     act on the FFN input  (after the attention LN)
    gamma_out = f3(e_t),  beta_out = f4(e_t)     act on the layer output (after the output LN)

and the backbone applies ``h -> (1 + gamma) * h + beta`` through :class:`jsteer.hooks.FiLM`.
Every vector is multiplied by the token's mention indicator, so tokens outside mentions see
the identity. ``use_gamma`` / ``use_beta`` switch the scale / shift off (the paper's Table 3).

``zero_init`` (default on; the original used PyTorch's default init) starts each map's second
Linear at zero, so a fresh KFM is the identity and the pretrained features are not perturbed
by random modulation at the start of a short fine-tuning run; the first Linear still gets
gradients as soon as the second moves.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jsteer.backbones.matmul import Dense
from jsteer.hooks import FiLM

Array = jnp.ndarray


class MLP(nn.Module):
    """Linear(De -> D) - ReLU - Linear(D -> D); ``zero_init`` starts the second Linear at 0."""

    hidden: int
    zero_init: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = nn.relu(Dense(self.hidden, name="fc1")(x))
        init = nn.initializers.zeros if self.zero_init else nn.initializers.lecun_normal()
        return Dense(self.hidden, kernel_init=init, name="fc2")(x)


class KFM(nn.Module):
    """Four maps from entity representations to one layer's FiLM.

    hidden: backbone hidden size D.
    """

    hidden: int
    use_gamma: bool = True
    use_beta: bool = True
    zero_init: bool = True

    @nn.compact
    def __call__(self, entity: Array, mention_mask: Array) -> FiLM:
        """entity [B, T, De] per-token entity representation, mention_mask [B, T] (1 on
        mention tokens) -> FiLM with [B, T, D] fields (None for switched-off ones)."""
        m = mention_mask[..., None].astype(entity.dtype)
        out = {}
        for name in ("gamma_in", "beta_in", "gamma_out", "beta_out"):
            on = self.use_gamma if name.startswith("gamma") else self.use_beta
            out[name] = MLP(self.hidden, self.zero_init, name=name)(entity) * m if on else None
        return FiLM(**out)
