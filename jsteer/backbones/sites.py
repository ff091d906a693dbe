"""The site runner a backbone's layer loop calls at each named site (:mod:`jsteer.interventions`).

``site(name, layer, h) -> h`` applies, in order: the Hooks built-in fields that act there
(``embed_offset`` / ``step_offset`` at ``embed``, FiLM ``in`` at ``ffn_in`` and ``out`` at
``resid_post`` on the prompt, the LM-Steer transform at ``final``), then ``hooks.interventions``
registered for the site, then records the result when the site is in ``capture``.

``layer`` is a Python int in an unrolled layer stack. Under a scanned stack it is a traced int32:
per-layer entries then act through ``jnp.where(layer == i, ...)`` and captures travel in the scan
carry (:meth:`SiteRunner.carry` / :meth:`SiteRunner.set_carry`), so one compiled body serves
every layer. Shapes: h [B, T, D] ([B, T, F] at ``ffn_hidden``); positions / mask [B, T] (None for a
layer run on its own). ``state`` is the call's shared dict (``ctx.state``); None when scanned.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax.numpy as jnp

from jsteer import interventions as iv
from jsteer.hooks import Hooks, apply_embed, apply_film, apply_steer, apply_step_embed

Array = jnp.ndarray


class SiteRunner:
    """One call's sites: see the module docstring. ``captured`` holds {site: h} after the call."""

    def __init__(
        self,
        hooks: Optional[Hooks],
        capture: Tuple[str, ...],
        positions: Optional[Array],
        mask: Optional[Array],
        decode: bool,
        ffn_width: Optional[int] = None,
    ):
        self.hooks, self.capture, self.decode = hooks, capture, decode
        self.positions, self.mask, self.ffn_width = positions, mask, ffn_width
        self.state: dict = {}
        self.ivs = {k: iv.as_tuple(v) for k, v in ((hooks.interventions or {}) if hooks is not None else {}).items()}
        self.film = {} if hooks is None or hooks.film is None or decode else dict(hooks.film)
        self.captured: dict = {}

    # ------------------------------------------------------------------ scanned stacks

    def per_layer_captures(self) -> Tuple[str, ...]:
        return tuple(k for k in self.capture if "." in k)

    def carry(self, like: Array) -> dict:
        """Initial scan-carry values for the per-layer captures (zeros shaped like the stream;
        ``ffn_hidden`` ones ``ffn_width`` wide)."""

        def zeros(k):
            if k.startswith("ffn_hidden."):
                return jnp.zeros(like.shape[:-1] + (self.ffn_width,), like.dtype)
            return jnp.zeros_like(like)

        return {k: zeros(k) for k in self.per_layer_captures()}

    def set_carry(self, caps: dict) -> None:
        self.captured.update(caps)

    # ------------------------------------------------------------------ the site itself

    def __call__(self, name: str, layer: Any, h: Array) -> Array:
        static = layer is None or isinstance(layer, int)
        hooks = self.hooks
        if hooks is not None:
            if name == "embed":
                h = apply_step_embed(h, hooks) if self.decode else apply_embed(h, hooks)
            elif name == "final":
                h = apply_steer(h, hooks)
        if name in ("ffn_in", "resid_post"):
            for i in self.film:
                if static and i != layer:
                    continue
                out = apply_film(h, hooks, i, "in" if name == "ffn_in" else "out")
                h = out if static else jnp.where(layer == i, out, h)
        for key, ivs in self.ivs.items():
            site, at = iv.parse_site(key, 1 << 30)
            if site != name or (static and at != layer):
                continue
            ctx = iv.SiteContext(
                layer=layer if static else at,
                positions=self.positions,
                mask=self.mask,
                decode=self.decode,
                state=self.state if static else None,
            )
            out = iv.apply(ivs, h, ctx, key)
            h = out if static or at is None else jnp.where(layer == at, out, h)
        for key in self.capture:
            site, _, at = key.partition(".")
            if site != name:
                continue
            if static and (layer is None or str(layer) == at):
                self.captured[key] = h
            elif not static:
                self.captured[key] = jnp.where(layer == int(at), h, self.captured[key])
        return h


__all__ = ["SiteRunner"]
