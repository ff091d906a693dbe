"""Scaled dot-product attention shared by every backbone (MHA and grouped-query).

Written as two canonical batched matmuls, [B,K,G*T,H] @ [B,K,H,S] and [B,K,G*T,S] @ [B,K,S,H],
with the heads moved in front by explicit transposes. XLA:CPU lowers the equivalent einsums
(``"BTNH,BSNH->BNTS"``) to a dot whose batch dimensions are not leading, which it runs ~4x
slower (MiniLM B32xT128, attention of 6 layers: 0.40 s einsum -> ~0.05 s here, with the 4-D
score tensor below). The softmax is normalised after the value product: the [.., T, H] output
is divided instead of the [.., T, S] probabilities, which is the same function (row scaling
commutes with the value matmul and with dropout's per-element keep mask) and saves a pass over
the score tensor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jsteer.backbones import cpu
from jsteer.backbones.base import NEG_INF, row_max
from jsteer.backbones.dropout import HashDropout
from jsteer.backbones.kernel_attention import kernel_attention
from jsteer.backbones.matmul import dot_fp32_out

Array = jax.Array


def _rows(m: Array, g: int, t: int) -> Array:
    """A mask/bias broadcastable to [B,K,G,T,S] as one broadcastable to [B,K,G*T,S]."""
    m = m.reshape((1,) * (5 - m.ndim) + m.shape)
    bm, km, gm, tm, sm = m.shape
    if gm == 1 and tm == 1:
        return m.reshape(bm, km, 1, sm)
    if (gm == g and tm == t) or g == 1:
        return m.reshape(bm, km, gm * tm, sm)
    return jnp.broadcast_to(m, (bm, km, g, t, sm)).reshape(bm, km, g * t, sm)


def dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float,
    bias: Optional[Array] = None,
    visible: Optional[Array] = None,
    dropout: Optional[Callable[[Array], Array]] = None,
    cache_layout: bool = False,
    softcap: Optional[float] = None,
) -> Array:
    """softmax(scale * q k^T + bias, masked to ``visible``) v, per head.

    q [B,T,K,G,H]: K key/value heads, each shared by G query heads (G = 1 for plain MHA);
    k, v [B,S,K,H]; or, with ``cache_layout``, k [B,K,H,S] and v [B,K,S,H] (the KV cache's
    layout, the matmul operands themselves: a decode step reads the cache in place instead of
    transposing every slot of it). ``softcap`` (Gemma-2): scores -> softcap * tanh(scores / softcap)
    before the bias and mask. ``bias`` (fp32, additive) and ``visible`` (bool) broadcast
    against the score tensor [B,K,G,T,S], e.g. [B,1,1,T|1,S]. Rows with no visible key get
    uniform weights (finite NEG_INF), never NaN. ``dropout`` maps the unnormalised weights, laid out as
    [B,K,G*T,S] (row-major order of [B,K,G,T,S]), to their dropped version
    (attention-probability dropout). Scores and the softmax run in fp32 whatever q's dtype;
    the value product runs in v's dtype with fp32 accumulation. Returns [B,T,K,G,H] in v's dtype.
    """
    b, t, kh, g, h = q.shape
    s = v.shape[2 if cache_layout else 1]
    want_v = (b, kh, s, h) if cache_layout else (b, s, kh, h)
    want_k = (b, kh, h, s) if cache_layout else want_v
    if k.shape != want_k or v.shape != want_v:
        layout = f"k [B,{kh},{h},S], v [B,{kh},S,{h}]" if cache_layout else f"k and v [B,S,{kh},{h}]"
        raise ValueError(f"attention: q {q.shape} needs {layout}, got {k.shape}, {v.shape}")
    # Everything on the score tensor stays 4-D: XLA:CPU runs the same elementwise/reduce work
    # ~4x slower on a [B,K,G,T,S] view.
    qt = q.transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    kt = k if cache_layout else k.transpose(0, 2, 3, 1)  # [B,K,H,S]
    batched = (((3,), (2,)), ((0, 1), (0, 1)))  # [B,K,M,N] @ [B,K,N,P] -> [B,K,M,P]
    scores = dot_fp32_out(qt, kt.astype(q.dtype), batched) * scale  # [B,K,G*T,S]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + _rows(bias, g, t)
    if visible is not None:
        scores = jnp.where(_rows(visible, g, t), scores, NEG_INF)
    weights = jnp.exp(scores - jax.lax.stop_gradient(row_max(scores)))
    denom = weights.sum(axis=-1, keepdims=True)
    if dropout is not None:
        weights = dropout(weights)
    vt = v if cache_layout else v.transpose(0, 2, 1, 3)  # [B,K,S,H]
    out = dot_fp32_out(weights.astype(v.dtype), vt, batched) / denom
    return out.astype(v.dtype).reshape(b, kh, g, t, h).transpose(0, 3, 1, 2, 4)


_FUSED_IMPLEMENTATION = "cudnn"  # tests check the fused path's masking on CPU with "xla"

# cuDNN's kernels are custom VJPs: reverse mode runs cuDNN's backward, forward mode (jax.jvp,
# jacfwd, hessian) cannot pass them. A jit-cache key, so programs traced inside get their own entry.
_PORTABLE = jax.make_user_context(default_value=False)


def forward_mode():
    """Context manager: attention traced inside takes no fused kernel, so forward-mode autodiff
    (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) goes through every backbone on a GPU too. Same
    values. Needed where the jvp is taken around an already-jitted call (e.g. ``lm.forward``):
    a forward-mode trace that reaches attention directly is recognised without it."""
    return _PORTABLE(True)


# The Pallas kernel for attention with dropout (jsteer.backbones.flash) on GPUs: off until a device
# run has timed it against the hand-written path; a jit-cache key like _PORTABLE.
_FUSED_DROPOUT = jax.make_user_context(default_value=False)


def fused_dropout(enabled: bool = True):
    """Context manager: attention with probability dropout traced inside runs the fused Pallas kernel
    (:mod:`jsteer.backbones.flash`: the same dropout mask, no [B, N, T, S] tensor in memory) where
    it applies: a GPU, bf16 / fp16, no KV cache or soft-capping, keys masked by padding alone
    (not causal), shapes :func:`jsteer.backbones.flash.supported` takes."""
    return _FUSED_DROPOUT(bool(enabled))


def _enclosed_by(kind: str) -> bool:
    """Whether a trace of jax's class ``kind`` (JVPTrace: forward mode; LinearizeTrace: reverse mode,
    which is not a JVPTrace) encloses this one; False where jax's internals moved."""
    try:  # jax's trace stack (internal)
        from jax._src import core
        from jax._src.interpreters import ad

        cls, trace = getattr(ad, kind), core.trace_ctx.trace
    except (ImportError, AttributeError):
        return False
    while trace is not None:
        if isinstance(trace, cls):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _in_forward_mode() -> bool:
    """True inside :func:`forward_mode` or when a forward-mode (JVP) trace encloses this one."""
    return _PORTABLE.value or _enclosed_by("JVPTrace")


def _in_reverse_mode() -> bool:
    """True when a reverse-mode trace (``jax.grad``, ``jax.vjp``, a train step) encloses this one."""
    return _enclosed_by("LinearizeTrace")


def _backend() -> str:
    return jax.default_backend()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lengths", "ok"], meta_fields=["causal"])
@dataclasses.dataclass(frozen=True)
class RightPadded:
    """What a call without a KV cache knows about its visibility, handed to :func:`attention`
    beside ``visible`` / ``bias``: ``lengths`` [B] int32 real keys per row (at least 1) and
    ``ok`` a bool scalar, true when every row of the key mask is ones then zeros, so that the
    keys visible are ``key < lengths`` (and ``key <= query`` when ``causal``). cuDNN then masks
    by lengths (PADDING / PADDING_CAUSAL) instead of reading a dense [B,1,T,S] mask or bias."""

    lengths: Array
    ok: Array
    causal: bool = True

    @classmethod
    def of(cls, key_mask: Array, causal: bool = True) -> "RightPadded":
        """key_mask [B,S] (1 = real key)."""
        m = key_mask > 0
        ok = jnp.all(m[:, 1:] <= m[:, :-1]) if m.shape[1] > 1 else jnp.asarray(True)
        return cls(jnp.maximum(m.sum(-1), 1).astype(jnp.int32), ok, causal)


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float,
    visible: Optional[Array] = None,
    bias: Optional[Array] = None,
    dropout: Optional[Callable[[Array], Array]] = None,
    cache_layout: bool = False,
    softcap: Optional[float] = None,
    right_padded: Optional[RightPadded] = None,
    cpu_kernel: bool = False,
    qkv: Optional[Array] = None,
) -> Array:
    """:func:`dot_product_attention`'s contract, computed by cuDNN's fused (flash) attention where it
    applies: a GPU backend, bf16 / fp16 inputs, no KV-cache layout (prefill and forward, not decode
    steps), no dropout (with dropout: :func:`fused_dropout`), no soft-capping and no forward-mode
    autodiff (see :func:`forward_mode`).
    Elsewhere the hand-written path. An additive ``bias`` keeps the hand-written path unless
    ``right_padded`` (see :class:`RightPadded`) says that the bias is the key padding alone: then,
    as for ``visible``, the fused path masks by lengths when its ``ok`` holds and falls back
    otherwise (one ``lax.cond``). The fused path lets a padding
    query row (no visible key) see its own slot (with lengths: the row's real keys), where the
    hand-written path spreads it uniformly: such rows are padding, read by nothing downstream.
    ``cpu_kernel`` (CPU, jsteer's kernels on: a call with the "packed" collection): fp32, a mask and
    bias the same for every head. One new token per row over the cache layout (a decode step) goes
    through :func:`jsteer.backbones.cpu.decode_attention`, any other call (forwards, prefills; head
    size a multiple of 16) through :func:`jsteer.backbones.cpu.block_attention`. A call with
    probability dropout (a :class:`~jsteer.backbones.dropout.HashDropout`: training) takes that
    kernel too wherever the kernels are available, ``cpu_kernel`` or not, with the same mask, and
    so does a call under reverse-mode differentiation (a decoder's training has no dropout): the
    kernel's backward beats XLA's transpose of the hand-written path.
    Derivatives in both modes: :mod:`jsteer.backbones.kernel_attention`. ``qkv``: the [B,T,3,K,H]
    projection q (``[:, :, 0, :, None]``), k and v were sliced from, which that kernel then reads in
    place (BERT's)."""
    b, t, kh, g, h = q.shape
    if (
        q.dtype == k.dtype == v.dtype == jnp.float32
        and (dropout is None or isinstance(dropout, HashDropout))
        and (cpu_kernel or ((dropout is not None or _in_reverse_mode()) and cpu.available()))
    ):
        padding = right_padded is not None
        out = kernel_attention(q, k, v, scale, visible, bias, cache_layout, softcap, qkv, padding, dropout)
        if out is not None:
            return out
    hand = functools.partial(
        dot_product_attention,
        scale=scale,
        visible=visible,
        bias=bias,
        dropout=dropout,
        cache_layout=cache_layout,
        softcap=softcap,
    )
    if dropout is not None:
        return _with_dropout(hand, q, k, v, scale, visible, bias, dropout, cache_layout, softcap, right_padded)
    if (
        _backend() != "gpu"
        or cache_layout
        or softcap is not None
        or (bias is not None and right_padded is None)
        or q.dtype not in (jnp.bfloat16, jnp.float16)
        or _in_forward_mode()
    ):
        return hand(q, k, v)
    s = k.shape[1]

    def masked(q, k, v):
        mask = None
        if visible is not None:  # [B|1, K|1, G|1, T|1, S] -> [B|1, N|1, T, S]
            vis = visible.reshape((1,) * (5 - visible.ndim) + visible.shape)
            per_head = vis.shape[1] != 1 or vis.shape[2] != 1
            vis = jnp.broadcast_to(vis, vis.shape[:1] + ((kh, g) if per_head else (1, 1)) + (t, s))
            mask = vis.reshape(vis.shape[0], -1, t, s) | jnp.eye(t, s, dtype=bool)
        out = jax.nn.dot_product_attention(
            q.reshape(b, t, kh * g, h),
            k,
            v.astype(q.dtype),
            mask=mask,
            scale=scale,
            implementation=_FUSED_IMPLEMENTATION,
        )
        return out.reshape(b, t, kh, g, h)

    def by_lengths(q, k, v):
        out = jax.nn.dot_product_attention(
            q.reshape(b, t, kh * g, h),
            k,
            v.astype(q.dtype),
            scale=scale,
            is_causal=right_padded.causal,
            key_value_seq_lengths=jnp.broadcast_to(right_padded.lengths, (b,)),
            implementation=_FUSED_IMPLEMENTATION,
        )
        return out.reshape(b, t, kh, g, h)

    if right_padded is None:
        return masked(q, k, v)
    return jax.lax.cond(right_padded.ok, by_lengths, hand if bias is not None else masked, q, k, v)


def _with_dropout(hand, q, k, v, scale, visible, bias, dropout, cache_layout, softcap, right_padded) -> Array:
    """:func:`attention` with probability dropout: the fused Pallas kernel where
    :func:`fused_dropout` asks for it and it applies, else ``hand`` (the hand-written path). The
    kernel's keys are masked by padding: ``right_padded`` (not causal; checked at run time by
    ``ok``, one ``lax.cond``), a key-only ``visible`` [B|1, 1, 1, 1, S], or nothing."""
    from jsteer.backbones import flash

    b, t, kh, g, h = q.shape
    s = k.shape[1]
    if (
        not _FUSED_DROPOUT.value
        or _backend() != "gpu"
        or not isinstance(dropout, HashDropout)
        or cache_layout
        or softcap is not None
        or q.dtype not in (jnp.bfloat16, jnp.float16)
        or _in_forward_mode()
        or not flash.supported(t, s, h)
    ):
        return hand(q, k, v)
    if right_padded is not None and not right_padded.causal and visible is None:
        key_mask = jnp.arange(s)[None, :] < jnp.broadcast_to(right_padded.lengths, (b,))[:, None]
    elif bias is None and (visible is None or visible.shape[-4:-1] == (1, 1, 1)):
        key_mask = jnp.ones((b, s), bool) if visible is None else jnp.broadcast_to(visible.reshape(-1, s), (b, s))
        right_padded = None
    else:
        return hand(q, k, v)

    def fused(q, k, v):
        out = flash.flash_attention(
            q.reshape(b, t, kh * g, h), k, v.astype(q.dtype), key_mask, dropout.seed, scale, dropout.rate
        )
        return out.reshape(b, t, kh, g, h).astype(v.dtype)

    if right_padded is None:
        return fused(q, k, v)
    return jax.lax.cond(right_padded.ok, fused, hand, q, k, v)
