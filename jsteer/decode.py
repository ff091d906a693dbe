"""One jitted generation loop for every decoder backbone.

Protocol a decoder module must follow (LLaMA and GPT-2 do):

- ``module.config.init_cache(batch, max_len, dtype) -> KVCache``;
- ``module.apply({"params": p}, ids [B,T], mask [B,T], hooks=..., cache=KVCache,
  step=bool, last_logits_only=bool) -> ModelOutput`` with ``.logits`` and ``.cache``, where
  ``step=True`` adds ``hooks.step_offset`` to the token embeddings (generated tokens) and
  ``last_logits_only=True`` returns logits [B,1,V] for the last position only.

:func:`generate` prefills the left-padded prompt batch into a cache of T + max_new_tokens
slots, then runs a ``lax.while_loop`` over new tokens that stops early once every row has
emitted a stop id. The whole thing is one XLA computation: no host round trip per token, and
the cache lives (and is updated in place) inside it. Compile-time constants: the shapes
[B,T], ``max_new_tokens``, the module, the number of stop ids (rounded up to 8) and the hook
*structure*. Temperature / top-k / top-p / stop ids / keys / hook values are traced, so
changing them (or the prompt text within a [B,T] bucket) reuses the compiled program.

Hooks: ``embed_offset``, ``film``, ``attn_bias`` and ``position_ids`` act on the prompt
(prefill) only (generated tokens continue one past the largest prompt position);
``step_offset`` is added to every generated token's embedding; ``steer`` acts at every
step, including the prefill logits that pick the first new token.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsteer.backbones import cpu
from jsteer.backbones.base import check_position_ids
from jsteer.data import buckets
from jsteer.hooks import Hooks

Array = jnp.ndarray

@flax.struct.dataclass
class GenerateOutput:
    """tokens: [B, N] int32 generated ids, ``pad_id`` after a row's stop token;
    lengths: [B] int32 number of generated tokens per row, stop token included."""

    tokens: Array
    lengths: Array


def _row_keys(rng, batch: int) -> Array:
    """None, an int seed, a PRNG key (raw uint32 [2] or typed []) or per-row keys -> [B] keys."""
    if rng is None:
        rng = 0
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    rng = jnp.asarray(rng)
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if rng.ndim == (0 if typed else 1):
        return jax.random.split(rng, batch)
    if rng.ndim != (1 if typed else 2) or rng.shape[0] != batch:
        raise ValueError(f"generate: rng must be one PRNG key or {batch} row keys, got shape {rng.shape}")
    return rng


def _per_row(x, batch: int, dtype, name: str) -> Array:
    x = jnp.asarray(x, dtype)
    if x.ndim == 0:
        return jnp.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"generate: {name} must be a scalar or [{batch}], got shape {x.shape}")
    return x


NUCLEUS_CANDIDATES = 256  # top-k/top-p look at this many best tokens first (exact; see below)


def _nucleus_threshold(desc: Array, k: Array, top_p: Array, log_norm: Array) -> tuple[Array, Array]:
    """desc [B, n]: the n best logits, sorted descending; k [B, 1] the top-k size; log_norm [B, 1]
    the log-partition of the top-k distribution. Returns (threshold [B, 1]: the smallest kept
    logit, probs [B, n] of the top-k distribution); the most likely token is always kept."""
    rank = jnp.arange(desc.shape[-1])[None, :]
    in_k = rank < k
    probs = jnp.where(in_k, jnp.exp(desc - log_norm), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # a prefix of the sorted order; top_p 1 keeps the whole top-k even where fp32 mass rounds to 1
    keep = in_k & ((mass_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))
    return jnp.take_along_axis(desc, keep.sum(axis=-1, keepdims=True) - 1, axis=-1), probs


def _filter_sorted(logits: Array, top_k: Array, top_p: Array) -> Array:
    """Reference filter over a full-vocabulary sort (the slow path of :func:`_filter_top_k_top_p`)."""
    v = logits.shape[-1]
    desc = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    log_norm = jax.nn.logsumexp(jnp.where(jnp.arange(v)[None, :] < k, desc, -jnp.inf), axis=-1, keepdims=True)
    threshold, _ = _nucleus_threshold(desc, k, top_p, log_norm)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _order_keys(x: Array) -> Array:
    """float32 [..] -> uint32 keys in the same order (-inf lowest, +inf highest; no NaNs expected)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _nucleus_bisect(logits: Array, top_p: Array) -> Array:
    """logits [B,V], top_p [B] -> the nucleus threshold as an order key [B, 1] (keep keys >= it),
    found without sorting: the smallest logit value x whose strictly-higher mass G(x) is < top_p,
    the same set a descending sort keeps (its mass before a token < top_p). G falls as x rises, so
    32 halvings of the uint32 key range pin x exactly; only the summation order of the mass differs
    from the sorted cumsum."""
    keys = _order_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    hi = keys.max(axis=-1, keepdims=True)              # G(max) = 0 < top_p
    lo = jnp.zeros_like(hi)                            # below every key: G = 1 >= top_p

    def halve(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p[:, None]
        return jnp.where(above, lo, mid), jnp.where(above, mid, hi)

    return lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _filter_top_k_top_p(logits: Array, top_k: Array, top_p: Array,
                        candidates: int = NUCLEUS_CANDIDATES) -> Array:
    """logits [B,V] (temperature applied) -> logits with tokens outside the top-k, then
    outside the top-p nucleus of the renormalised top-k distribution, set to -inf.
    top_k [B] (0: off), top_p [B] (1: off); the most likely token is always kept.

    A full-vocabulary sort per decode step costs more than a small model's forward on CPU, so
    the filter first takes the ``candidates`` best tokens (``lax.top_k``). That is exact
    whenever the kept set lies inside them (top_k <= candidates, or no top-k and the
    candidates already hold top_p of the mass: the usual case for a peaked distribution). Rows
    without top-k whose nucleus is wider (flat distributions, often one row in a large sampling
    batch) get their threshold by bisection (:func:`_nucleus_bisect`, no sort); only a top_k
    between ``candidates`` and V falls back to the full sort."""
    v = logits.shape[-1]
    c = min(candidates, v)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None]
    desc = lax.top_k(logits, c)[0]                                                   # [B, c]
    log_norm = jnp.where(k <= c, jax.nn.logsumexp(jnp.where(jnp.arange(c)[None, :] < k, desc, -jnp.inf),
                                                  axis=-1, keepdims=True),
                         jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    threshold, probs = _nucleus_threshold(desc, k, top_p, log_norm)
    no_filter = (k[:, 0] == v) & (top_p >= 1.0)
    threshold = jnp.where(no_filter[:, None], -jnp.inf, threshold)
    exact = no_filter | (k[:, 0] <= c) | ((k[:, 0] == v) & (probs.sum(axis=-1) >= top_p))

    def wide_nucleus(x):
        cut = _nucleus_bisect(x, top_p)
        return jnp.where(exact[:, None], jnp.where(x >= threshold, x, -jnp.inf),
                         jnp.where(_order_keys(x) >= cut, x, -jnp.inf))

    branch = jnp.where(jnp.all(exact), 0, jnp.where(jnp.any((k[:, 0] > c) & (k[:, 0] < v)), 2, 1))
    return lax.switch(branch, [lambda x: jnp.where(x >= threshold, x, -jnp.inf), wide_nucleus,
                               lambda x: _filter_sorted(x, top_k, top_p)], logits)


def _next_token(logits: Array, step: Array, keys, temperature: Array, top_k: Array,
                top_p: Array) -> Array:
    """logits [B,V] -> token [B]: argmax where temperature == 0, else a sample. The sampling
    branch (and its full-vocab sort) only runs when some row needs it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = temperature > 0

    def sample():
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
        filtered = lax.cond(jnp.any(sampling & ((top_k > 0) | (top_p < 1.0))),
                            lambda x: _filter_top_k_top_p(x, top_k, top_p), lambda x: x, scaled)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
        drawn = jax.vmap(jax.random.categorical)(step_keys, filtered).astype(jnp.int32)
        return jnp.where(sampling, drawn, greedy)

    return lax.cond(jnp.any(sampling), sample, lambda: greedy)


@functools.partial(jax.jit, static_argnames=("module", "max_new_tokens"))
def _generate(module, params, input_ids, attention_mask, temperature, top_k, top_p, stop_ids,
              keys, hooks: Optional[Hooks], pad_id, packed: Optional[dict], *,
              max_new_tokens: int) -> GenerateOutput:
    b, t = input_ids.shape
    # packed: the weights packed for the CPU kernel, through which the decode steps multiply
    step_vars = {"params": params} if packed is None else {"params": params, "packed": packed}
    n = max_new_tokens
    cache = module.config.init_cache(b, t + n, getattr(module, "dtype", jnp.float32))
    step_hooks = None
    if hooks is not None and (hooks.step_offset is not None or hooks.steer is not None or hooks.interventions):
        step_hooks = Hooks(step_offset=hooks.step_offset, steer=hooks.steer, interventions=hooks.interventions)
    reset = getattr(module.config, "cache_reset_length", None)
    reset_step = None if reset is None or not t < reset + 1 < t + n else reset + 1 - t

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    out = module.apply({"params": params}, input_ids, attention_mask, hooks=hooks, cache=cache,
                       last_logits_only=True)
    tok = _next_token(out.logits[:, -1], jnp.int32(0), keys, temperature, top_k, top_p)
    tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok)
    state = (jnp.int32(1), out.cache, tok, is_stop(tok), tokens, jnp.ones((b,), jnp.int32))

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < n) & ~jnp.all(done)

    def one_step(i, cache, tok, tokens):
        out = module.apply(step_vars, tok[:, None], jnp.ones((b, 1), jnp.int32),
                           hooks=step_hooks, cache=cache, step=True)
        return out.logits[:, -1], out.cache

    def recompute(i, cache, tok, tokens):
        # transformers' Phi-3 generate: once the sequence first outgrows the short RoPE factors,
        # the whole cache is recomputed with the long ones (prompt + the i tokens so far)
        ids = jnp.concatenate([input_ids, tokens], axis=1)
        mask = jnp.concatenate([attention_mask, (jnp.arange(n) < i).astype(jnp.int32)[None].repeat(b, 0)], axis=1)
        out = module.apply({"params": params}, ids, mask, hooks=_prompt_hooks(hooks, attention_mask, n),
                           cache=cache.reset())
        return out.logits[:, t + i - 1], out.cache.replace(index=t + i)

    def body(state):
        i, cache, tok, done, tokens, lengths = state
        if reset_step is None:
            logits, cache = one_step(i, cache, tok, tokens)
        else:
            logits, cache = lax.cond(i == reset_step, recompute, one_step, i, cache, tok, tokens)
        nxt = _next_token(logits, i, keys, temperature, top_k, top_p)
        nxt = jnp.where(done, pad_id, nxt)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None], (0, i))
        return i + 1, cache, nxt, done | is_stop(nxt), tokens, lengths + (~done).astype(jnp.int32)

    _, _, _, _, tokens, lengths = lax.while_loop(cond, body, state)
    return GenerateOutput(tokens=tokens, lengths=lengths)


def _prompt_hooks(hooks: Optional[Hooks], mask: Array, n: int) -> Optional[Hooks]:
    """Hooks for one forward over the prompt [B, T] (``mask``) and n generated slots: prompt-shaped
    fields padded with n neutral slots, ``step_offset`` moved into ``embed_offset`` for the
    generated slots, explicit positions continued one past each row's largest."""
    if hooks is None:
        return None

    def pad(x, axes, value=None):
        if x is None:
            return None
        width = [(0, 0)] * x.ndim
        for a in axes:
            width[a] = (0, n)
        return jnp.pad(x, width)

    embed = hooks.embed_offset
    if hooks.step_offset is not None:
        b, d = mask.shape[0], hooks.step_offset.shape[-1]
        prompt = jnp.zeros((b, mask.shape[1], d), hooks.step_offset.dtype) if embed is None else embed
        steps = jnp.broadcast_to(hooks.step_offset[:, None, :], (b, n, d)).astype(prompt.dtype)
        embed = jnp.concatenate([prompt, steps], axis=1)
    else:
        embed = pad(embed, (1,))
    positions = hooks.position_ids
    if positions is not None:
        start = jnp.max(jnp.where(mask > 0, positions + 1, 0), axis=1, keepdims=True)
        positions = jnp.concatenate([positions, start + jnp.arange(n)[None]], axis=1).astype(positions.dtype)
    film = None if hooks.film is None else {k: f.replace(**{a: pad(getattr(f, a), (1,)) for a in (
        "gamma_in", "beta_in", "gamma_out", "beta_out")}) for k, f in hooks.film.items()}
    return hooks.replace(embed_offset=embed, step_offset=None, attn_bias=pad(hooks.attn_bias, (1, 2)),
                         position_ids=positions, film=film)


def _check_position_budget(module, attention_mask, hooks: Optional[Hooks], max_new_tokens: int) -> None:
    """Learned position tables (GPT-2): the prompt's positions and the ones generated tokens
    continue at (one past the largest prompt position) must fit the table; a row past it would
    gather NaN. Skipped for RoPE models and for traced (jitted) masks / hooks."""
    config = getattr(module, "config", None)
    size = getattr(config, "position_table_size", None)
    if size is None or isinstance(attention_mask, jax.core.Tracer):
        return
    mask = np.asarray(attention_mask)
    explicit = None if hooks is None else hooks.position_ids
    if explicit is None:
        start = int(mask.sum(axis=1).max())
        what = f"a prompt of {start} tokens"
    elif isinstance(explicit, jax.core.Tracer):
        return
    else:
        check_position_ids(explicit, size, "generate")
        pos = np.asarray(explicit)
        if pos.shape != mask.shape:
            raise ValueError(f"generate: hooks.position_ids has shape {pos.shape}, the prompt {mask.shape}")
        start = int(np.where(mask > 0, pos + 1, 0).max())  # decoding continues here
        what = f"prompt positions up to {start - 1}"
    if start + max_new_tokens > size:
        raise ValueError(f"generate: {what} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"position table (n_positions {size})")


def generate(module, params, input_ids, attention_mask=None, *, max_new_tokens: int,
             temperature=0.0, top_k=0, top_p=1.0, stop_ids: Sequence[int] = (), rng=None,
             hooks: Optional[Hooks] = None, pad_id: int = 0,
             cpu_kernels: Optional[bool] = None) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens after a left-padded prompt batch.

    input_ids, attention_mask: [B,T] (mask None: no padding); every row must end with a real
    token. temperature / top_k / top_p: scalars or per-row [B] values (temperature 0: greedy;
    top_k 0 and top_p 1: no filtering). stop_ids: a row stops after emitting one of them.
    rng: a PRNG key (split into one key per row) or [B] per-row keys; sampling for row b at
    step s uses fold_in(key_b, s), so a row's samples do not depend on the other rows.
    hooks: see the module docstring. cpu_kernels: decode steps multiply through
    :mod:`jsteer.backbones.cpu`'s kernel, from a packed copy of the weights (made once and kept
    for the last two param sets; it doubles the weights' memory). None (default) uses it when it
    is available, the module supports it (``decode_pack``), B is in the kernel's row range, the
    batch is not sharded over several devices and generate is not called under jit (where the
    copy could not be kept). Returns :class:`GenerateOutput`.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if input_ids.ndim != 2:
        raise ValueError(f"generate: input_ids must be [B, T], got shape {input_ids.shape}")
    b, t = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones((b, t), jnp.int32)
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    if attention_mask.shape != (b, t):
        raise ValueError(f"generate: attention_mask shape {attention_mask.shape} != input_ids {input_ids.shape}")
    if not isinstance(attention_mask, jax.core.Tracer):
        m = np.asarray(attention_mask)
        if not (m[:, -1] == 1).all() or (np.diff(m, axis=1) < 0).any():
            bad = np.nonzero(~((m[:, -1] == 1) & (np.diff(m, axis=1) >= 0).all(axis=1)))[0]
            raise ValueError(f"generate: prompts must be left-padded (rows {bad.tolist()} are not)")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    _check_position_budget(module, attention_mask, hooks, int(max_new_tokens))
    temperature = _per_row(temperature, b, jnp.float32, "temperature")
    top_k = _per_row(top_k, b, jnp.int32, "top_k")
    top_p = _per_row(top_p, b, jnp.float32, "top_p")
    for name, x, bad in (("temperature", temperature, lambda a: a < 0), ("top_k", top_k, lambda a: a < 0),
                         ("top_p", top_p, lambda a: (a <= 0) | (a > 1))):
        if not isinstance(x, jax.core.Tracer) and np.any(bad(np.asarray(x))):
            raise ValueError(f"generate: invalid {name} {np.asarray(x).tolist()}")
    stop = [int(s) for s in np.asarray(stop_ids, np.int64).reshape(-1)]
    stop += [-1] * (buckets.PROBE(len(stop)) - len(stop))  # pad (-1 is never a token): fewer programs
    stop = jnp.asarray(stop, jnp.int32)
    packed = _packed_params(module, params) if _use_cpu_kernels(cpu_kernels, module, input_ids, params) else None
    return _generate(module, params, input_ids, attention_mask, temperature, top_k, top_p, stop,
                     _row_keys(rng, b), hooks, jnp.int32(pad_id), packed, max_new_tokens=int(max_new_tokens))


_PACK_CACHE: "collections.OrderedDict" = collections.OrderedDict()  # (module, leaf ids) -> packed
_PACK_CACHE_SIZE = 2


@functools.partial(jax.jit, static_argnums=0)
def _pack(module, params):
    return module.decode_pack(params)


def _packed_params(module, params) -> dict:
    """``module.decode_pack(params)``, kept for the last _PACK_CACHE_SIZE param sets: packing
    copies every weight (SmolLM2: 0.26 s on a 2-core CPU), more than a short generate call gains.
    An entry is dropped as soon as any of its param arrays is freed (so ids are never reused)."""
    leaves = jax.tree.leaves(params)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return module.decode_pack(params)  # inside the caller's jit: packed in their program
    key = (module, tuple(id(x) for x in leaves))
    if key in _PACK_CACHE:
        _PACK_CACHE.move_to_end(key)
        return _PACK_CACHE[key]
    packed = _pack(module, params)
    _PACK_CACHE[key] = packed
    for x in leaves:
        weakref.finalize(x, _PACK_CACHE.pop, key, None)
    while len(_PACK_CACHE) > _PACK_CACHE_SIZE:
        _PACK_CACHE.popitem(last=False)
    return packed


def _use_cpu_kernels(requested: Optional[bool], module, input_ids, params=None) -> bool:
    """Whether decode steps go through the CPU kernel (see ``generate``'s ``cpu_kernels``)."""
    if requested is False:
        return False
    supported = hasattr(module, "decode_pack")
    if requested:
        if not supported:
            raise ValueError(f"generate: cpu_kernels=True, but {type(module).__name__} has no decode_pack")
        if not cpu.available():
            raise ValueError(f"generate: cpu_kernels=True, but the CPU kernel is unavailable: "
                             f"{cpu.unavailable_reason()}")
        return True
    # under the caller's jit the packed copy could not be kept: there only on request
    traced = any(isinstance(x, jax.core.Tracer) for x in [input_ids, *jax.tree.leaves(params)])
    return (supported and not traced and cpu.MIN_ROWS <= input_ids.shape[0] <= cpu.MAX_ROWS
            and len(input_ids.sharding.device_set) == 1 and cpu.available())


def compiled_count() -> int:
    """Number of programs compiled for the generate loop so far (for recompilation checks)."""
    return _generate._cache_size()
