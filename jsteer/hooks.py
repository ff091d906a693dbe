"""Hook points shared by every jsteer backbone.

A method never forks a backbone: it builds a :class:`Hooks` value and passes it to the
backbone's ``__call__`` (or to ``generate``). Every field is optional; a ``None`` field is
skipped entirely in Python, so ``Hooks()`` and ``hooks=None`` leave outputs bit-identical.

All fields are JAX pytrees: values (strengths, offsets, eps) are traced, so changing them
never recompiles; only *which* fields / layers are present is static structure.
Zero-valued fields (e.g. ``embed_offset`` of zeros) compute the same function but are not
guaranteed bit-identical to an absent field (~1e-6: XLA fuses the extra ops differently).

Shapes (B batch, T tokens, D hidden, S steers, R rank):

- ``embed_offset``  [B, T, D]  added right after the token-embedding lookup
                               (Type Embeddings). During decoding it covers the prompt.
- ``step_offset``   [B, D]     added to the embedding of every *generated* token
                               (Type Embeddings "all tokens" mode while generating).
- ``film``          {layer: FiLM}  per-layer, per-token feature modulation (KALA's KFM).
                               Keys are 0-based layer indices in range(num_layers); a
                               backbone raises ValueError for any other key.
- ``attn_bias``     [B, T, T]  additive attention bias (0 visible, large negative hidden),
                               applied on top of the padding / causal mask (K-BERT).
- ``position_ids``  [B, T]     explicit positions (K-BERT soft positions).
- ``steer``         :class:`Steer`  LM-Steer transform of the final hidden state before the
                               output embedding (decoders), and its baselines: a hidden
                               offset, a logit offset (soft word blacklist).
- ``interventions`` {site: Intervention | tuple}  functions of the activation at a named site
                               (:mod:`jsteer.interventions`), applied in a forward, the
                               prefill and every decode step.

The fields above are the simple cases of interventions at the sites: ``embed_offset`` /
``step_offset`` act at ``embed``, FiLM ``in`` at ``ffn_in.i`` and ``out`` at ``resid_post.i``,
``steer`` at ``final``; built-ins run before a site's ``interventions``.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax.numpy as jnp
import numpy as np

from jsteer.interventions import compose_interventions

Array = jnp.ndarray


@flax.struct.dataclass
class FiLM:
    """Feature-wise modulation of one layer: h -> (1 + gamma) * h + beta, per token.

    ``*_in`` act on the hidden state entering the FFN (after the attention block's
    LayerNorm in post-LN BERT; the normalised FFN input in pre-LN decoders); ``*_out``
    act on the layer output (after the FFN block's LayerNorm in BERT; the residual stream
    after the FFN add in pre-LN decoders). Each is [B, T, D] or None.
    """

    gamma_in: Optional[Array] = None
    beta_in: Optional[Array] = None
    gamma_out: Optional[Array] = None
    beta_out: Optional[Array] = None


@flax.struct.dataclass
class Steer:
    """LM-Steer: c' = c + sum_i eps_i W_i c, then logits = c' E^T.

    Low rank: W_i = P1_i P2_i^T with ``p1``/``p2`` [S, D, R]. Full rank: ``w`` [S, D, D]
    (``p1``/``p2`` None). ``eps`` is [S] (shared by all rows) or [B, S] (per row).

    The paper's baselines use the same S steers and eps: ``vec`` [S, D] adds sum_i eps_i v_i
    to c (context-vector offset); ``bias`` [S, V] adds sum_i eps_i b_i to the logits (soft word
    blacklist). Fields may be combined (a stacked bilinear steer and baseline); a steer that a
    field does not describe has zeros there.
    """

    eps: Array
    p1: Optional[Array] = None
    p2: Optional[Array] = None
    w: Optional[Array] = None
    vec: Optional[Array] = None
    bias: Optional[Array] = None


@flax.struct.dataclass
class Hooks:
    embed_offset: Optional[Array] = None
    step_offset: Optional[Array] = None
    film: Optional[dict] = None
    attn_bias: Optional[Array] = None
    position_ids: Optional[Array] = None
    steer: Optional[Steer] = None
    interventions: Optional[dict] = None


def _film_one(h: Array, gamma: Optional[Array], beta: Optional[Array]) -> Array:
    if gamma is not None:
        h = h * (1.0 + gamma.astype(h.dtype))
    if beta is not None:
        h = h + beta.astype(h.dtype)
    return h


def apply_embed(x: Array, hooks: Optional[Hooks]) -> Array:
    """x: [B, T, D] token embeddings -> x + embed_offset."""
    if hooks is None or hooks.embed_offset is None:
        return x
    off = hooks.embed_offset
    if off.shape[-1] != x.shape[-1] or off.ndim != 3:
        raise ValueError(f"hooks.embed_offset must be [B, T, {x.shape[-1]}], got {off.shape}")
    if off.shape[1] != x.shape[1]:
        raise ValueError(f"hooks.embed_offset covers {off.shape[1]} tokens but the input has {x.shape[1]}")
    return x + off.astype(x.dtype)


def apply_step_embed(x: Array, hooks: Optional[Hooks]) -> Array:
    """x: [B, 1, D] embedding of a generated token -> x + step_offset."""
    if hooks is None or hooks.step_offset is None:
        return x
    off = hooks.step_offset
    if off.ndim != 2 or off.shape[1] != x.shape[-1] or off.shape[0] not in (1, x.shape[0]):
        raise ValueError(
            f"hooks.step_offset must be [B={x.shape[0]}, D={x.shape[-1]}] (one offset per row "
            f"for every generated token), got {tuple(off.shape)}"
        )
    return x + off[:, None, :].astype(x.dtype)


def check_encoder_hooks(hooks: Optional[Hooks]) -> None:
    """Encoders have no output-embedding head to steer and no generated tokens: a steer or
    step offset handed to one is an error, not silently dropped."""
    if hooks is not None and (hooks.steer is not None or hooks.step_offset is not None):
        which = "steer" if hooks.steer is not None else "step_offset"
        raise ValueError(
            f"hooks.{which} acts on a decoder's next-token head; encoder (BERT-family) models "
            "take embed_offset, film, attn_bias and position_ids only"
        )


def check_film_layers(hooks: Optional[Hooks], num_layers: int) -> None:
    """Raise ValueError unless every ``hooks.film`` key is an int in range(num_layers).

    Negative keys are refused rather than normalised: ``-1`` and ``num_layers - 1`` would be
    distinct dict keys, so :func:`compose` would not chain them.
    """
    if hooks is None or hooks.film is None:
        return
    for key in hooks.film:
        is_int = isinstance(key, (int, np.integer)) and not isinstance(key, bool)
        if is_int and 0 <= key < num_layers:
            continue
        hint = ""
        if is_int and -num_layers <= key < 0:
            hint = f"; negative indices are not supported: write {num_layers + key} for layer {key}"
        raise ValueError(
            f"hooks.film has key {key!r}: keys must be int layer indices in "
            f"range({num_layers}) (this model has {num_layers} layers){hint}"
        )


def apply_film(h: Array, hooks: Optional[Hooks], layer: int, where: str) -> Array:
    """h: [B, T, D]; where in {'in', 'out'}. Identity when no FiLM for this layer."""
    if hooks is None or hooks.film is None or layer not in hooks.film:
        return h
    f = hooks.film[layer]
    if where == "in":
        return _film_one(h, f.gamma_in, f.beta_in)
    if where == "out":
        return _film_one(h, f.gamma_out, f.beta_out)
    raise ValueError(f"where must be 'in' or 'out', got {where!r}")


def _steer_count(steer: Steer) -> int:
    """S, checked to agree across the Steer's fields."""
    ranks = {"w": 3, "p1": 3, "p2": 3, "vec": 2, "bias": 2}
    present = {name: getattr(steer, name) for name in ranks if getattr(steer, name) is not None}
    if not present or (steer.p1 is None) != (steer.p2 is None):
        raise ValueError("Steer needs w [S,D,D], both p1 and p2 [S,D,R], vec [S,D] or bias [S,V]")
    for name, x in present.items():
        if x.ndim != ranks[name]:
            want = {"w": "[S, D, D]", "p1": "[S, D, R]", "p2": "[S, D, R]", "vec": "[S, D]", "bias": "[S, V]"}[name]
            raise ValueError(f"Steer.{name} must be {want} (one row per steer), got shape {tuple(x.shape)}")
    sizes = {name: x.shape[0] for name, x in present.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"Steer fields disagree on the number of steers S: {sizes}")
    return next(iter(sizes.values()))


def _eps_scale(eps: Array, n_steers: int, lead: tuple, ndim: int) -> Array:
    """eps [S] or [B, S] -> a scale that broadcasts against [..., S] with ``ndim`` leading dims
    (leading shape ``lead``)."""
    if eps.ndim == 1:
        if eps.shape[0] != n_steers:
            raise ValueError(f"steer eps has shape {eps.shape}, expected [{n_steers}] or [B, {n_steers}]")
        return eps
    if eps.ndim == 2:
        if eps.shape[1] != n_steers or not lead or eps.shape[0] != lead[0]:
            b = lead[0] if lead else "B"
            raise ValueError(f"steer eps has shape {eps.shape}, expected [{b}, {n_steers}] (batch, steers)")
        return eps.reshape(eps.shape[:1] + (1,) * (ndim - 1) + eps.shape[1:])
    raise ValueError(f"steer eps must be [S] or [B, S], got shape {eps.shape}")


def steer_delta(h: Array, steer: Steer) -> Array:
    """sum_i eps_i (W_i h + v_i) for h [..., D] (leading dim B when eps is [B, S]) -> [..., D]."""
    n_steers = _steer_count(steer)
    scale = _eps_scale(steer.eps, n_steers, h.shape[:1] if h.ndim >= 2 else (), h.ndim - 1).astype(h.dtype)
    terms, proj = [], None
    if steer.w is not None:
        proj = jnp.einsum("...d,sed->...se", h, steer.w.astype(h.dtype))  # W_i h
    elif steer.p1 is not None:
        # (P1 P2^T) h = P1 (P2^T h)
        low = jnp.einsum("...d,sdr->...sr", h, steer.p2.astype(h.dtype))
        proj = jnp.einsum("...sr,sdr->...sd", low, steer.p1.astype(h.dtype))
    if proj is not None:
        terms.append(jnp.einsum("...sd,...s->...d", proj, scale))
    if steer.vec is not None:
        if steer.vec.shape[-1] != h.shape[-1]:
            raise ValueError(f"steer vec must be [S, {h.shape[-1]}], got {tuple(steer.vec.shape)}")
        terms.append(jnp.einsum("...s,sd->...d", scale, steer.vec.astype(h.dtype)))
    if not terms:  # a logit-only (blacklist) steer
        return jnp.zeros_like(h)
    return jnp.broadcast_to(sum(terms[1:], terms[0]), h.shape)


def apply_steer(h: Array, hooks: Optional[Hooks]) -> Array:
    """Final hidden states [B, T, D] -> steered hidden states c + sum_i eps_i (W_i c + v_i)."""
    if hooks is None or hooks.steer is None:
        return h
    s = hooks.steer
    if s.w is None and s.p1 is None and s.vec is None:  # logit-only: apply_steer_logits
        return h
    return h + steer_delta(h, s)


def apply_steer_logits(logits: Array, hooks: Optional[Hooks]) -> Array:
    """Logits [B, T, V] -> logits + sum_i eps_i b_i (the soft-blacklist baseline); identity
    without a ``bias``."""
    if hooks is None or hooks.steer is None or hooks.steer.bias is None:
        return logits
    steer = hooks.steer
    if steer.bias.shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"steer bias must be [S, {logits.shape[-1]}] (one offset per vocabulary entry), "
            f"got {tuple(steer.bias.shape)}"
        )
    scale = _eps_scale(steer.eps, _steer_count(steer), logits.shape[:1], logits.ndim - 1)
    return logits + jnp.einsum("...s,sv->...v", scale.astype(logits.dtype), steer.bias.astype(logits.dtype))


def compose(*hooks: Optional[Hooks]) -> Optional[Hooks]:
    """Combine several hooks into one: offsets add, FiLMs chain, steers stack.

    FiLM chaining: (1+g2)((1+g1)h + b1) + b2 = (1 + g) h + b with
    g = g1 + g2 + g1 g2 and b = (1 + g2) b1 + b2. Attention biases add; position ids
    must not be given twice.
    """
    hs = [h for h in hooks if h is not None]
    if not hs:
        return None
    out = hs[0]
    for h in hs[1:]:
        out = _compose2(out, h)
    return out


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _chain_gamma(g1, g2):
    if g1 is None:
        return g2
    if g2 is None:
        return g1
    return g1 + g2 + g1 * g2


def _chain_beta(b1, g2, b2):
    if b1 is not None and g2 is not None:
        b1 = b1 * (1.0 + g2)
    return _add(b1, b2)


def _compose_film(f1: FiLM, f2: FiLM) -> FiLM:
    return FiLM(
        gamma_in=_chain_gamma(f1.gamma_in, f2.gamma_in),
        beta_in=_chain_beta(f1.beta_in, f2.gamma_in, f2.beta_in),
        gamma_out=_chain_gamma(f1.gamma_out, f2.gamma_out),
        beta_out=_chain_beta(f1.beta_out, f2.gamma_out, f2.beta_out),
    )


def _stack_steers(s1: Steer, s2: Steer) -> Steer:
    """Steers of s1 then of s2, one eps; a field only one of them has is zero for the other's."""
    n1, n2 = _steer_count(s1), _steer_count(s2)

    def as_full(s: Steer) -> Optional[Array]:
        if s.w is not None:
            return s.w
        return None if s.p1 is None else jnp.einsum("sdr,ser->sde", s.p1, s.p2)

    def cat(a: Optional[Array], b: Optional[Array]) -> Optional[Array]:
        if a is None and b is None:
            return None
        ref = a if a is not None else b
        a = jnp.zeros((n1,) + ref.shape[1:], ref.dtype) if a is None else a
        b = jnp.zeros((n2,) + ref.shape[1:], ref.dtype) if b is None else b
        return jnp.concatenate([a, b])

    def eps2(e, other):
        return e if e.ndim == other.ndim else (jnp.broadcast_to(e, (other.shape[0],) + e.shape) if e.ndim == 1 else e)

    e1, e2 = eps2(s1.eps, s2.eps), eps2(s2.eps, s1.eps)
    if e1.ndim == 2 and e1.shape[0] != e2.shape[0]:
        raise ValueError(
            f"cannot compose steers with per-row eps of different batch sizes: eps {tuple(s1.eps.shape)} "
            f"and {tuple(s2.eps.shape)} ([B, S] each, the same B)"
        )
    out = Steer(eps=jnp.concatenate([e1, e2], axis=-1), vec=cat(s1.vec, s2.vec), bias=cat(s1.bias, s2.bias))
    if s1.w is None and s2.w is None and (s1.p1 is None or s2.p1 is None or s1.p1.shape[-1] == s2.p1.shape[-1]):
        if s1.p1 is None and s2.p1 is None:
            return out
        return out.replace(p1=cat(s1.p1, s2.p1), p2=cat(s1.p2, s2.p2))
    return out.replace(w=cat(as_full(s1), as_full(s2)))


def _compose2(a: Hooks, b: Hooks) -> Hooks:
    if a.position_ids is not None and b.position_ids is not None:
        raise ValueError("cannot compose two hooks that both set position_ids")
    film = None
    if a.film is not None or b.film is not None:
        film = dict(a.film or {})
        for layer, f in (b.film or {}).items():
            film[layer] = _compose_film(film[layer], f) if layer in film else f
    steer = a.steer if b.steer is None else (b.steer if a.steer is None else _stack_steers(a.steer, b.steer))
    return Hooks(
        embed_offset=_add(a.embed_offset, b.embed_offset),
        step_offset=_add(a.step_offset, b.step_offset),
        film=film,
        attn_bias=_add(a.attn_bias, b.attn_bias),
        position_ids=a.position_ids if b.position_ids is None else b.position_ids,
        steer=steer,
        interventions=compose_interventions(a.interventions, b.interventions),
    )
