"""Interventions: pure functions that see an activation at a named site and return its replacement.

Every backbone owns one layer loop and passes each activation through its *sites*:

============  ======================================================================  =========
site          activation h                                                            shape
============  ======================================================================  =========
``embed``     token embeddings (after any embedding scale, before positions / layers)  [B, T, D]
``resid_pre`` the residual stream entering layer i (HF's ``hidden_states[i]``)         [B, T, D]
``attn_out``  layer i's attention output, as added to the residual stream             [B, T, D]
``ffn_in``    layer i's FFN input (after its pre-FFN norm, if the family has one)      [B, T, D]
``ffn_hidden`` layer i's FFN hidden pre-activation: the projection the nonlinearity     [B, T, F]
              reads (BERT's ``ffn_in`` dense, a plain MLP's ``up``, a gated one's
              ``gate``)
``ffn_out``   layer i's FFN output, as added to the residual stream                   [B, T, D]
``resid_post`` the residual stream after layer i (HF's ``hidden_states[i + 1]``)       [B, T, D]
``final``     the final-norm output the output embedding reads (decoders); an
              encoder's last hidden state, which its heads read (BERT)                [B, T, D]
============  ======================================================================  =========

Per-layer sites are written ``"resid_post.5"`` (0-based layers); ``embed`` and ``final`` take no
layer. An intervention is a pytree (its arrays are traced: changing a strength never recompiles)
with ``__call__(h, ctx) -> h`` of the same shape and dtype. :class:`SiteContext` tells it the layer,
the positions [B, T], the attention mask [B, T] and whether this call is one decode step
(``ctx.decode``; T = 1) or a full forward / prefill. ``ctx.state`` is one dict shared by every
site of a call (unrolled layer stacks; None under a scanned one): a method whose interventions pass
values between sites (a FiLM computed at ``resid_pre.l`` and applied at ``ffn_in.l``, an entity
stream carried from one fusion layer to the next, a retrieval's logits for an auxiliary loss)
keeps them there under its own keys; the backbone returns it after the call (BERT's
``EncoderOutput.state``). ``Hooks(interventions={site: iv or (iv, ...)})``
carries them to ``forward`` and ``generate``, which apply them identically in a forward, in the
prefill and at every decode step. Ready-made ones: :class:`Add` (a vector, ActAdd / CAA / control
vectors), :class:`Scale`, :class:`Ablate` (project a direction out) and :class:`Fn` (any function
with traced arguments). ``capture=("resid_post.5", ...)`` returns the named activations (after that
site's interventions) in ``out.captured``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

import flax.struct
import jax.numpy as jnp

Array = jnp.ndarray

SITES = ("embed", "resid_pre", "attn_out", "ffn_in", "ffn_hidden", "ffn_out", "resid_post", "final")
LAYER_SITES = frozenset({"resid_pre", "attn_out", "ffn_in", "ffn_hidden", "ffn_out", "resid_post"})


@dataclasses.dataclass(frozen=True)
class SiteContext:
    """What an intervention may read. ``layer``: int (or a traced int32 under a scanned layer
    stack; None at ``embed`` / ``final``); ``positions`` / ``mask`` [B, T] int32; ``decode``:
    True for one decode step with the KV cache, False for a forward or the prefill; ``state``:
    the call's shared dict (module docstring; None under a scanned layer stack)."""

    layer: Any
    positions: Array
    mask: Array
    decode: bool
    state: Optional[dict] = None


class Intervention(flax.struct.PyTreeNode):
    """Base class: subclasses are flax struct dataclasses whose array fields are traced."""

    def __call__(self, h: Array, ctx: SiteContext) -> Array:
        raise NotImplementedError


class Add(Intervention):
    """h + strength * vec. ``vec`` [D] (every position, generated tokens included), [B, D] (per
    row) or [B, T0, D] (per prompt token: the first T0 positions of a forward / prefill; skipped
    at decode steps); ``strength`` a scalar or [B]."""

    vec: Array
    strength: Any = 1.0

    def __call__(self, h, ctx):
        v = jnp.asarray(self.vec)
        if v.ndim == 3 and ctx.decode:
            return h
        s = jnp.asarray(self.strength, jnp.float32)
        s = s.reshape(s.shape + (1,) * (3 - s.ndim)) if s.ndim else s
        if v.ndim == 3 and v.shape[1] < h.shape[1]:
            v = jnp.pad(v, ((0, 0), (0, h.shape[1] - v.shape[1]), (0, 0)))
        v = v if v.ndim != 2 else v[:, None, :]
        return h + (s * v.astype(jnp.float32)).astype(h.dtype)


class Scale(Intervention):
    """h * factor (a scalar, [D] or [B, 1, D]-broadcastable)."""

    factor: Any

    def __call__(self, h, ctx):
        return h * jnp.asarray(self.factor).astype(h.dtype)


class Ablate(Intervention):
    """Remove ``strength`` x the component of h along ``direction`` [D] (unit length is not
    required: it is normalised here). strength 1: directional ablation."""

    direction: Array
    strength: Any = 1.0

    def __call__(self, h, ctx):
        d = jnp.asarray(self.direction, jnp.float32)
        d = d / jnp.linalg.norm(d)
        proj = jnp.einsum("...d,d->...", h.astype(jnp.float32), d)[..., None] * d
        return (h.astype(jnp.float32) - jnp.asarray(self.strength, jnp.float32) * proj).astype(h.dtype)


class Fn(Intervention):
    """Any function ``fn(h, ctx, *args) -> h``: ``fn`` is static (part of the compiled program's
    identity), ``args`` a pytree of traced values."""

    fn: Callable = flax.struct.field(pytree_node=False)
    args: Tuple = ()

    def __call__(self, h, ctx):
        return self.fn(h, ctx, *self.args)


def parse_site(key: str, num_layers: int) -> Tuple[str, Optional[int]]:
    """``"resid_post.5"`` -> ("resid_post", 5); ``"embed"`` -> ("embed", None). ValueError for an
    unknown site, a missing / extra layer, or a layer outside range(num_layers)."""
    if not isinstance(key, str):
        raise ValueError(f"site {key!r} must be a string like 'resid_post.5' or 'embed'")
    name, _, layer = key.partition(".")
    if name not in SITES:
        raise ValueError(f"unknown site {key!r}: sites are {', '.join(SITES)} (per-layer ones as 'resid_post.5')")
    if name not in LAYER_SITES:
        if layer:
            raise ValueError(f"site {key!r}: {name!r} takes no layer index")
        return name, None
    if not layer.isdigit():
        raise ValueError(f"site {key!r}: {name!r} needs a layer index, e.g. '{name}.0'")
    i = int(layer)
    if not 0 <= i < num_layers:
        raise ValueError(
            f"site {key!r}: layer {i} is out of range (the model has {num_layers} layers: 0..{num_layers - 1})"
        )
    return name, i


def as_tuple(ivs) -> Tuple[Intervention, ...]:
    return tuple(ivs) if isinstance(ivs, (tuple, list)) else (ivs,)


def check_interventions(interventions: Optional[Mapping[str, Any]], num_layers: int) -> None:
    """Validate every key of ``Hooks.interventions`` and that each value is an Intervention."""
    for key, ivs in (interventions or {}).items():
        parse_site(key, num_layers)
        for iv in as_tuple(ivs):
            if not isinstance(iv, Intervention):
                raise ValueError(
                    f"intervention at {key!r} is a {type(iv).__name__}; wrap a function as "
                    f"jsteer.interventions.Fn(fn, args) (an Intervention pytree)"
                )


def check_capture(capture: Sequence[str], num_layers: int) -> Tuple[str, ...]:
    capture = (capture,) if isinstance(capture, str) else tuple(capture or ())
    for key in capture:
        parse_site(key, num_layers)
    return capture


def apply(ivs: Sequence[Intervention], h: Array, ctx: SiteContext, key: str) -> Array:
    """Run interventions in order, checking each keeps h's shape and dtype."""
    for iv in ivs:
        out = iv(h, ctx)
        if getattr(out, "shape", None) != h.shape or getattr(out, "dtype", None) != h.dtype:
            raise ValueError(
                f"intervention {type(iv).__name__} at {key!r} returned "
                f"{getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}, expected the "
                f"activation's shape {h.shape} and dtype {h.dtype}"
            )
        h = out
    return h


def compose_interventions(a: Optional[Mapping], b: Optional[Mapping]) -> Optional[dict]:
    """Both sets, ``a``'s first at a site both use."""
    if not a and not b:
        return None
    out = {k: as_tuple(v) for k, v in (a or {}).items()}
    for k, v in (b or {}).items():
        out[k] = out.get(k, ()) + as_tuple(v)
    return out


__all__ = [
    "SITES",
    "LAYER_SITES",
    "SiteContext",
    "Intervention",
    "Add",
    "Scale",
    "Ablate",
    "Fn",
    "parse_site",
    "check_interventions",
    "check_capture",
    "apply",
    "compose_interventions",
]
