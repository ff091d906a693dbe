"""Rotary position embeddings: every ``rope_type`` transformers implements for the decoder families.

:class:`Rope` holds one layer type's parameters (Gemma-3 has one for its sliding-window layers and
one for its global layers). ``rope.cos_sin(positions [B, T])`` -> cos, sin [B, T, R] with R the
rotary dims (``partial_rotary_factor`` x head dim, GPT-NeoX / Phi); :func:`apply_rope` rotates the
first R dims of q / k [B, T, N, H] with HF's rotate-half convention and passes the rest through.

Types (HF ``rope_type``): ``default``; ``linear`` (frequencies / factor); ``llama3`` (Llama 3.1's
wavelength-dependent scaling); ``dynamic`` (NTK: the base grows with the sequence length once it
passes ``max_position_embeddings``); ``yarn`` (ramped interpolation with an attention factor on
cos / sin); ``longrope`` (Phi-3: per-frequency short / long factors, long once the sequence passes
``original_max_position_embeddings``, with an attention factor). The length-dependent types read
the length as ``max(positions) + 1`` of the call, which is what transformers' forward does; each
decode step therefore uses its own position, as in HF's cached decoding.

:func:`rope_from_hf` reads one parameter dict in transformers 5's ``rope_parameters`` form or in
the older ``rope_scaling`` form; an unknown ``rope_type`` or parameter is refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
_KNOWN_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "original_max_position_embeddings",
        "truncate",
    },
    "longrope": {"factor", "attention_factor", "short_factor", "long_factor", "original_max_position_embeddings"},
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """One RoPE parameter set. ``dim``: rotary dims R (even); ``params``: the type's parameters as
    a sorted tuple of (name, value) so the config stays hashable (lists become tuples)."""

    theta: float
    dim: int
    rope_type: str = "default"
    params: Tuple[Tuple[str, Any], ...] = ()
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.dim % 2 or self.dim <= 0:
            raise ValueError(f"rope: rotary dims must be even and positive, got {self.dim}")

    @property
    def p(self) -> dict:
        return dict(self.params)

    def _base_inv_freq(self) -> np.ndarray:
        return np.float32(1.0) / _theta_powers(self.theta, self.dim)

    def static_inv_freq(self) -> Tuple[np.ndarray, float]:
        """(inv_freq [R/2] float32, attention factor) for the types that do not depend on the
        sequence length (for ``dynamic`` / ``longrope``: their short-sequence values)."""
        inv, p = self._base_inv_freq(), self.p
        t = self.rope_type
        if t in ("default", "dynamic"):
            return inv, 1.0
        if t == "linear":
            return (inv / np.float32(p["factor"])).astype(np.float32), 1.0
        if t == "llama3":
            return _llama3(inv, p), 1.0
        if t == "yarn":
            return _yarn(self, p)
        return self._longrope(p["short_factor"])

    def _longrope(self, factors) -> Tuple[np.ndarray, float]:
        p = self.p
        orig = p["original_max_position_embeddings"]
        factor = p.get("factor") or self.max_position_embeddings / orig
        att = p.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        inv = 1.0 / (np.asarray(factors, np.float32) * _theta_powers(self.theta, self.dim))
        return inv.astype(np.float32), float(att)

    def inv_freq(self, positions: Array) -> Tuple[Array, Any]:
        """(inv_freq [R/2], attention factor) for a call over ``positions`` [B, T]."""
        inv, att = self.static_inv_freq()
        if self.rope_type == "dynamic":
            seq = jnp.maximum(jnp.max(positions) + 1, self.max_position_embeddings).astype(jnp.float32)
            factor = self.p["factor"]
            base = self.theta * ((factor * seq / self.max_position_embeddings) - (factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
            exps = jnp.asarray(_exponents(self.dim))
            return 1.0 / (base**exps), 1.0
        if self.rope_type == "longrope":
            long_inv, att = self._longrope(self.p["long_factor"])
            is_long = jnp.max(positions) + 1 > self.p["original_max_position_embeddings"]
            return jnp.where(is_long, jnp.asarray(long_inv), jnp.asarray(inv)), att
        return jnp.asarray(inv), att

    def cos_sin(self, positions: Array) -> Tuple[Array, Array]:
        """positions [B, T] -> cos, sin [B, T, R] float32 (the R/2 frequencies repeated twice, as HF)."""
        inv, att = self.inv_freq(positions)
        freqs = positions.astype(jnp.float32)[..., None] * inv
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb) * att, jnp.sin(emb) * att

    def to_hf(self) -> dict:
        d = {"rope_type": self.rope_type, "rope_theta": self.theta}
        d.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.params})
        return d


def _exponents(dim: int) -> np.ndarray:
    """[dim/2] float32 2i / dim, rounded as transformers' are."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _theta_powers(theta: float, dim: int) -> np.ndarray:
    """[dim/2] float32 theta ** :func:`_exponents`, the power computed in float64 and rounded once.
    NumPy's float32 power is not correctly rounded and depends on the CPU's SIMD path: on an Intel
    Xeon the inverse frequencies built on it differed from transformers' in 514 of 2912 entries
    (8 thetas x 9 head dims), these in 30 (torch's own float32 power is the one off there)."""
    return (np.float64(np.float32(theta)) ** _exponents(dim).astype(np.float64)).astype(np.float32)


def _llama3(inv: np.ndarray, p: Mapping) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: Rope, p: Mapping) -> Tuple[np.ndarray, float]:
    dim, base = rope.dim, rope.theta
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or rope.max_position_embeddings / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        att = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos = _theta_powers(base, dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv.astype(np.float32), float(att)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, N, H]; cos / sin [B, T, R] (R <= H): the first R dims rotated (rotate-half), the
    rest unchanged."""
    r = cos.shape[-1]
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = rot * c + rotated * s
    return out if rest is None else jnp.concatenate([out, rest], axis=-1)


def rope_from_hf(
    params: Optional[Mapping],
    *,
    theta: float,
    head_dim: int,
    partial: float,
    max_position_embeddings: int,
    original_max: Optional[int],
    where: str,
) -> Rope:
    """One RoPE parameter dict (``rope_parameters`` / ``rope_scaling`` form, or None) -> Rope.
    ``theta`` / ``partial`` / ``original_max`` are the config's top-level values, used where the
    dict does not give its own. ``where`` names the config field in errors."""
    params = dict(params or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", theta))
    partial = float(params.pop("partial_rotary_factor", partial))
    if rope_type not in _KNOWN_KEYS:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    unknown = sorted(set(params) - _KNOWN_KEYS[rope_type])
    if unknown:
        raise ValueError(
            f"{where}: rope_type {rope_type!r} parameter {unknown[0]!r} is not supported "
            f"(known: {', '.join(sorted(_KNOWN_KEYS[rope_type])) or 'none'})"
        )
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", original_max or max_position_embeddings)
        if rope_type == "longrope" and original_max is not None:  # Phi-3 keeps it top level; it wins (HF)
            params["original_max_position_embeddings"] = original_max
    need = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "longrope": ("short_factor", "long_factor"),
    }.get(rope_type, ())
    for k in need:
        if k not in params:
            raise ValueError(f"{where}: rope_type {rope_type!r} needs parameter {k!r}")
    dim = int(head_dim * partial)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    rope = Rope(
        theta=theta, dim=dim, rope_type=rope_type, params=frozen, max_position_embeddings=int(max_position_embeddings)
    )
    if rope_type == "longrope":
        for k in ("short_factor", "long_factor"):
            if len(params[k]) != dim // 2:
                raise ValueError(
                    f"{where}: longrope {k} has {len(params[k])} entries, expected {dim // 2} (rotary dims / 2)"
                )
    return rope


__all__ = ["Rope", "ROPE_TYPES", "apply_rope", "rope_from_hf"]
