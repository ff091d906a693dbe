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
import dataclasses
import functools
import re
import weakref
from typing import Any, Iterator, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsteer import sampling
from jsteer.backbones import cpu
from jsteer.backbones.base import KVCache, check_position_ids
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


@flax.struct.dataclass
class Sampler:
    """Traced decoding settings (changing them never recompiles). temperature / top_p /
    repetition_penalty float32 [B], top_k int32 [B], keys [B] PRNG keys, stop_ids int32 [S]
    (-1 padding), pad_id and min_new_tokens int32 []."""

    temperature: Array
    top_k: Array
    top_p: Array
    keys: Array
    stop_ids: Array
    pad_id: Array
    min_new_tokens: Array
    repetition_penalty: Optional[Array] = None  # None: off (no [B, V] seen-token mask is kept)


@flax.struct.dataclass
class DecodeState:
    """A generation in progress: ``i`` tokens chosen so far, ``cache`` holding the prompt and the
    i - 1 tokens fed back, ``tok`` [B] the last chosen token, ``done`` [B] (stopped), ``tokens``
    [B, N] (pad after a row's stop), ``lengths`` [B], ``seen`` [B, V] bool (repetition penalty)."""

    i: Array
    cache: Any
    tok: Array
    done: Array
    tokens: Array
    lengths: Array
    seen: Optional[Array] = None


def _choose(logits: Array, step: Array, s: Sampler, seen: Optional[Array]) -> Array:
    logits = logits.astype(jnp.float32)
    if seen is not None:
        logits = sampling.repetition_penalty(logits, seen, s.repetition_penalty)
    logits = sampling.hold_stops(logits, s.stop_ids, step, s.min_new_tokens)
    return sampling.next_token(logits, step, s.keys, s.temperature, s.top_k, s.top_p)


def _is_stop(tok: Array, stop_ids: Array) -> Array:
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)


def _step_hooks(hooks: Optional[Hooks]) -> Optional[Hooks]:
    """What acts on generated tokens: step offsets, the steer, interventions (prompt-only fields dropped)."""
    if hooks is not None and (hooks.step_offset is not None or hooks.steer is not None or hooks.interventions):
        return Hooks(step_offset=hooks.step_offset, steer=hooks.steer, interventions=hooks.interventions)
    return None


def _variables(params, packed: Optional[dict]) -> dict:
    """The variables a decoder is applied with: ``params``, and the "packed" collection (the
    weights packed for the CPU kernel, see :func:`_packed_params`) when there is one."""
    return {"params": params} if packed is None else {"params": params, "packed": packed}


def _prefill(module, params, packed, input_ids, attention_mask, hooks, s: Sampler, n: int) -> DecodeState:
    b, t = input_ids.shape
    cache = module.config.init_cache(b, t + n, getattr(module, "dtype", jnp.float32))
    out = module.apply(
        _variables(params, packed), input_ids, attention_mask, hooks=hooks, cache=cache, last_logits_only=True
    )
    seen = None
    if s.repetition_penalty is not None:
        seen = jnp.zeros((b, out.logits.shape[-1]), bool).at[jnp.arange(b)[:, None], input_ids].set(True)
    tok = _choose(out.logits[:, -1], jnp.int32(0), s, seen)
    if seen is not None:
        seen = seen.at[jnp.arange(b), tok].set(True)
    return DecodeState(
        i=jnp.int32(1),
        cache=out.cache,
        tok=tok,
        done=_is_stop(tok, s.stop_ids),
        tokens=jnp.full((b, n), s.pad_id, jnp.int32).at[:, 0].set(tok),
        lengths=jnp.ones((b,), jnp.int32),
        seen=seen,
    )


def _loop(
    module,
    params,
    packed,
    input_ids,
    attention_mask,
    hooks,
    s: Sampler,
    state: DecodeState,
    until: Array,
    k: int = 1,
) -> DecodeState:
    """Decode steps until ``until`` tokens are chosen (or N, or every row stopped): one
    ``lax.while_loop``, no host round trip per token. ``k`` > 1: each iteration runs k steps (a
    fixed-count inner loop) and the stop condition is read once per k steps (see :func:`generate`'s
    ``steps_per_check``); a step taken after the condition turned false changes nothing kept."""
    b, t = input_ids.shape
    n = state.tokens.shape[1]
    step_vars = _variables(params, packed)
    step_hooks = _step_hooks(hooks)
    reset = getattr(module.config, "cache_reset_length", None)
    reset_step = None if reset is None or not t < reset + 1 < t + n else reset + 1 - t

    def one_step(i, cache, tok, tokens):
        out = module.apply(
            step_vars, tok[:, None], jnp.ones((b, 1), jnp.int32), hooks=step_hooks, cache=cache, step=True
        )
        return out.logits[:, -1], out.cache

    def recompute(i, cache, tok, tokens):
        # transformers' Phi-3 generate: once the sequence first outgrows the short RoPE factors,
        # the whole cache is recomputed with the long ones (prompt + the i tokens so far)
        ids = jnp.concatenate([input_ids, tokens], axis=1)
        mask = jnp.concatenate([attention_mask, (jnp.arange(n) < i).astype(jnp.int32)[None].repeat(b, 0)], axis=1)
        out = module.apply(step_vars, ids, mask, hooks=_prompt_hooks(hooks, attention_mask, n), cache=cache.reset())
        return out.logits[:, t + i - 1], out.cache.replace(index=t + i)

    squeeze = KVCache.unbatched(b)  # one row on CPU: carried without the batch axis (its docstring)

    def cond(st):
        return (st.i < jnp.minimum(until, n)) & ~jnp.all(st.done)

    def body(st):
        i = st.i
        carried = st.cache.without_batch(drop=False) if squeeze else st.cache
        if reset_step is None:
            logits, cache = one_step(i, carried, st.tok, st.tokens)
        else:
            logits, cache = lax.cond(i == reset_step, recompute, one_step, i, carried, st.tok, st.tokens)
        if squeeze:
            cache = cache.without_batch(drop=True)
        nxt = jnp.where(st.done, s.pad_id, _choose(logits, i, s, st.seen))
        seen = None if st.seen is None else st.seen.at[jnp.arange(b), nxt].set(True)
        return DecodeState(
            i=i + 1,
            cache=cache,
            tok=nxt,
            done=st.done | _is_stop(nxt, s.stop_ids),
            tokens=lax.dynamic_update_slice(st.tokens, nxt[:, None], (0, i)),
            lengths=st.lengths + (~st.done).astype(jnp.int32),
            seen=seen,
        )

    def guarded(_, st):
        # Branch-free (a lax.cond would read its predicate on the host again): the step runs and
        # its state is kept only while the loop's condition holds. Its K/V write when it does not
        # lands in slot cache.index, which is held, so the next real step overwrites it first.
        active = cond(st)
        new = body(st)
        keep = lambda a, b: jnp.where(active, a, b)  # noqa: E731
        held = jax.tree.map(keep, new.replace(cache=None), st.replace(cache=None))
        c, old = new.cache, st.cache
        return held.replace(
            cache=c.replace(mask=keep(c.mask, old.mask), index=keep(c.index, old.index), pos=keep(c.pos, old.pos))
        )

    if squeeze:
        state = state.replace(cache=state.cache.without_batch(drop=True))
    if k == 1:
        state = lax.while_loop(cond, body, state)
    else:
        state = lax.while_loop(cond, lambda st: lax.fori_loop(0, k, guarded, st), state)
    return state.replace(cache=state.cache.without_batch(drop=False)) if squeeze else state


@functools.partial(jax.jit, static_argnames=("module", "max_new_tokens", "steps_per_check"))
def _generate(
    module,
    params,
    input_ids,
    attention_mask,
    sampler: Sampler,
    hooks: Optional[Hooks],
    packed: Optional[dict],
    *,
    max_new_tokens: int,
    steps_per_check: int = 1,
) -> GenerateOutput:
    state = _prefill(module, params, packed, input_ids, attention_mask, hooks, sampler, max_new_tokens)
    until = jnp.int32(max_new_tokens)
    state = _loop(module, params, packed, input_ids, attention_mask, hooks, sampler, state, until, steps_per_check)
    return GenerateOutput(tokens=state.tokens, lengths=state.lengths)


_prefill_jit = jax.jit(_prefill, static_argnames=("module", "n"))
_loop_jit = jax.jit(_loop, static_argnames=("module", "k"), donate_argnames=("state",))


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
    film = (
        None
        if hooks.film is None
        else {
            k: f.replace(**{a: pad(getattr(f, a), (1,)) for a in ("gamma_in", "beta_in", "gamma_out", "beta_out")})
            for k, f in hooks.film.items()
        }
    )
    return hooks.replace(
        embed_offset=embed, step_offset=None, attn_bias=pad(hooks.attn_bias, (1, 2)), position_ids=positions, film=film
    )


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
        raise ValueError(
            f"generate: {what} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"position table (n_positions {size})"
        )


def generate(
    module,
    params,
    input_ids,
    attention_mask=None,
    *,
    max_new_tokens: int,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    stop_ids: Sequence[int] = (),
    rng=None,
    hooks: Optional[Hooks] = None,
    pad_id: int = 0,
    cpu_kernels: Optional[bool] = None,
    repetition_penalty=None,
    min_new_tokens: int = 0,
    steps_per_check: int = 1,
) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens after a left-padded prompt batch.

    input_ids, attention_mask: [B,T] (mask None: no padding); every row must end with a real
    token. temperature / top_k / top_p: scalars or per-row [B] values (temperature 0: greedy;
    top_k 0 and top_p 1: no filtering). stop_ids: a row stops after emitting one of them.
    repetition_penalty: HF's (scalar or [B]; None or 1: off), over the prompt ids and the tokens
    generated so far; min_new_tokens: the stop ids are held back until that many tokens exist.
    rng: a PRNG key (split into one key per row) or [B] per-row keys; sampling for row b at
    step s uses fold_in(key_b, s), so a row's samples do not depend on the other rows.
    hooks: see the module docstring. cpu_kernels: decode steps multiply through
    :mod:`jsteer.backbones.cpu`'s kernel, from a packed copy of the weights (made once and kept
    for the last two param sets; it doubles the weights' memory). None (default) uses it when it
    is available, the module supports it (``decode_pack``), B is in the kernel's row range, the
    batch is not sharded over several devices and generate is not called under jit (where the
    copy could not be kept). steps_per_check: decode steps per read of the loop's stop condition
    (compile-time). On a GPU, XLA reads a while loop's condition on the host each iteration, which
    drains the device's queue; k > 1 runs k steps per iteration as a fixed-count inner loop that
    the host queues ahead, at the cost of up to k - 1 idle steps once every row has stopped.
    Same tokens for every k. Returns :class:`GenerateOutput`.
    """
    opts = _Options(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stop_ids,
        rng=rng,
        hooks=hooks,
        pad_id=pad_id,
        cpu_kernels=cpu_kernels,
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens,
        steps_per_check=steps_per_check,
    )
    input_ids, attention_mask, sampler, packed = _setup(module, params, input_ids, attention_mask, max_new_tokens, opts)
    return _generate(
        module,
        params,
        input_ids,
        attention_mask,
        sampler,
        hooks,
        packed,
        max_new_tokens=int(max_new_tokens),
        steps_per_check=int(opts.steps_per_check),
    )


@flax.struct.dataclass
class Progress:
    """What :func:`stream` yields: ``i`` tokens chosen so far, ``tokens`` [B, N] (valid up to i),
    ``lengths`` [B], ``done`` [B]; host copies, independent of the running loop."""

    i: int
    tokens: np.ndarray
    lengths: np.ndarray
    done: np.ndarray


def stream(
    module, params, input_ids, attention_mask=None, *, max_new_tokens: int, chunk: int = 8, **kw
) -> Iterator[Progress]:
    """:func:`generate` run ``chunk`` decode steps at a time: yields :class:`Progress` after the
    prefill and after each chunk, one compiled program for every chunk (the state, KV cache
    included, is donated from chunk to chunk). Send a [B] bool array back (``gen.send(mask)``)
    to stop those rows (stop strings); the final tokens equal :func:`generate`'s."""
    unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(_Options)})
    if unknown:
        raise TypeError(f"stream: unexpected arguments {unknown}")
    opts = _Options(**kw)
    input_ids, attention_mask, sampler, packed = _setup(module, params, input_ids, attention_mask, max_new_tokens, opts)
    hooks = opts.hooks
    if chunk < 1:
        raise ValueError(f"stream: chunk must be >= 1, got {chunk}")
    state = _prefill_jit(module, params, packed, input_ids, attention_mask, hooks, sampler, int(max_new_tokens))
    while True:
        host = jax.device_get((state.i, state.tokens, state.lengths, state.done))
        stop = yield Progress(int(host[0]), *host[1:])
        if stop is not None:
            state = state.replace(done=state.done | jnp.asarray(stop, bool))
        if int(host[0]) >= max_new_tokens or bool(np.all(host[3] | np.asarray(stop if stop is not None else False))):
            return
        until = state.i + chunk
        state = _loop_jit(
            module, params, packed, input_ids, attention_mask, hooks, sampler, state, until, int(opts.steps_per_check)
        )


@dataclasses.dataclass(frozen=True)
class _Options:
    """:func:`generate`'s sampling options as given (scalars or per-row [B] arrays; :func:`stream`
    takes them as keywords)."""

    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    stop_ids: Sequence[int] = ()
    rng: Any = None
    hooks: Optional[Hooks] = None
    pad_id: int = 0
    cpu_kernels: Optional[bool] = None
    repetition_penalty: Any = None
    min_new_tokens: int = 0
    steps_per_check: int = 1


def _setup(module, params, input_ids, attention_mask, max_new_tokens, options: _Options):
    """Checked inputs -> (ids, mask, Sampler, packed weights or None)."""
    o = options
    temperature, top_k, top_p, hooks, min_new_tokens = o.temperature, o.top_k, o.top_p, o.hooks, o.min_new_tokens
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
    if not isinstance(min_new_tokens, (int, np.integer)) or not 0 <= min_new_tokens:
        raise ValueError(f"generate: min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
    if not isinstance(o.steps_per_check, (int, np.integer)) or o.steps_per_check < 1:
        raise ValueError(f"generate: steps_per_check must be an int >= 1, got {o.steps_per_check!r}")
    _check_position_budget(module, attention_mask, hooks, int(max_new_tokens))
    temperature = _per_row(temperature, b, jnp.float32, "temperature")
    top_k = _per_row(top_k, b, jnp.int32, "top_k")
    top_p = _per_row(top_p, b, jnp.float32, "top_p")
    penalty = None
    rp = o.repetition_penalty
    if rp is not None and not (np.ndim(rp) == 0 and float(rp) == 1.0):
        penalty = _per_row(rp, b, jnp.float32, "repetition_penalty")
    for name, x, bad in (
        ("temperature", temperature, lambda a: a < 0),
        ("top_k", top_k, lambda a: a < 0),
        ("top_p", top_p, lambda a: (a <= 0) | (a > 1)),
        ("repetition_penalty", penalty, lambda a: a <= 0),
    ):
        if x is not None and not isinstance(x, jax.core.Tracer) and np.any(bad(np.asarray(x))):
            raise ValueError(f"generate: invalid {name} {np.asarray(x).tolist()}")
    stop = [int(x) for x in np.asarray(o.stop_ids, np.int64).reshape(-1)]
    stop += [-1] * (buckets.PROBE(len(stop)) - len(stop))  # pad (-1 is never a token): fewer programs
    sampler = Sampler(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        keys=_row_keys(o.rng, b),
        stop_ids=jnp.asarray(stop, jnp.int32),
        pad_id=jnp.int32(o.pad_id),
        min_new_tokens=jnp.int32(min_new_tokens),
        repetition_penalty=penalty,
    )
    packed = _packed_params(module, params) if _use_cpu_kernels(o.cpu_kernels, module, input_ids, params) else None
    return input_ids, attention_mask, sampler, packed


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


def _use_cpu_kernels(
    requested: Optional[bool], module, input_ids, params=None, caller: str = "generate", any_rows: bool = False
) -> bool:
    """Whether the products go through the CPU kernel (see ``generate``'s ``cpu_kernels``);
    ``any_rows``: whatever the batch size (``LM.forward``)."""
    if requested is False:
        return False
    supported = hasattr(module, "decode_pack")
    if requested:
        if not supported:
            raise ValueError(f"{caller}: cpu_kernels=True, but {type(module).__name__} has no decode_pack")
        if not cpu.available():
            raise ValueError(
                f"{caller}: cpu_kernels=True, but the CPU kernel is unavailable: {cpu.unavailable_reason()}"
            )
        return True
    # under the caller's jit the packed copy could not be kept: there only on request
    leaves = [input_ids, *jax.tree.leaves(params)]
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    return (
        supported
        and not traced
        and getattr(module, "dtype", jnp.float32) == jnp.float32  # the kernel multiplies fp32 only
        and (any_rows or cpu.MIN_ROWS <= input_ids.shape[0] <= cpu.MAX_ROWS)
        and all(len(x.sharding.device_set) == 1 for x in leaves if isinstance(x, jax.Array))
        and cpu.available()
    )


def compiled_count() -> int:
    """Number of programs compiled for the generate loop so far (for recompilation checks)."""
    return _generate._cache_size() + _loop_jit._cache_size()


def loop_body_copies(compiled_text: str) -> int:
    """``copy`` instructions in a compiled program's largest computation (``jit(...).lower(...)
    .compile().as_text()``; for generate, the decode loop's body): a step that copies its KV cache
    shows here (:meth:`jsteer.backbones.base.KVCache.unbatched`)."""
    return max(len(re.findall(r"= \S+ copy\(", c)) for c in re.split(r"\n(?=\S.*\{\n)", compiled_text))
