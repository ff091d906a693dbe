"""Fused (flash) attention with attention-probability dropout, for GPUs: a Pallas kernel (Triton
backend) and its backward, with the dropout mask hashed in the kernel.

Why: cuDNN's fused attention, used wherever no dropout is needed (:mod:`jsteer.backbones.attention`),
takes its dropout seed as a compile-time constant (``jax._src.cudnn``'s ``seed: int``), so every
training step would drop the same elements. Training BERT with attention dropout therefore kept
the hand-written path, which writes the fp32 [B, N, T, S] scores, weights and mask to HBM and reads
them back in the backward: at 32 x 512 it ran at 0.69x HF PyTorch on an H200 (HF: PyTorch's SDPA,
dropout inside the flash kernel).

Here each program keeps its [block_q, block_k] tile of scores on chip and draws the tile's keep
mask from :func:`jsteer.backbones.dropout.hash_bits`' formula at the element's index in the
[B, N, T, S] probability tensor (((b * N + n) * T + i) * S + j), the layout the hand-written
path's ``dropout`` sees. Both paths therefore drop the same elements for the same seed: the
tests run this kernel in Pallas' interpreter on CPU and compare values and gradients with the
hand-written path.

Shapes: q [B, T, N, H], k and v [B, S, K, H] (K key/value heads, N = K * G query heads: head n reads
key/value head n // G), ``key_mask`` [B, S] (nonzero: a visible key; every row with at least one),
``seed`` uint32 [2], ``rate`` in [0, 1). Output [B, T, N, H] in q's dtype. Scores, the softmax and
the products' accumulation run in fp32. T, S and H must be powers of two (Triton's tiles) of at
least 16 (:func:`supported`). The kernel has no partitioning rule:
under a multi-device mesh XLA gathers its operands to each device, so use it on one device or
inside ``shard_map`` (every (batch, head) is independent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jsteer.backbones.attention import dot_product_attention
from jsteer.backbones.base import NEG_INF
from jsteer.backbones.dropout import HashDropout, mix, threshold

Array = jax.Array

BLOCK, BLOCK_BWD = 64, 32  # the forward's and the backward's tiles (a shorter sequence: its length)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supported(t: int, s: int, h: int) -> bool:
    """Whether the kernel takes these shapes (module docstring)."""
    return all(map(_pow2, (t, s, h))) and min(t, s, h) >= 16


def _keep(seed_ref, rate: float, b, n, rows, cols, t: int, s: int, heads: int):
    """Keep mask [len(rows), len(cols)] of the probability tile (b, n, rows, cols): the bits that
    :func:`jsteer.backbones.dropout.hash_bits` gives those elements of [B, N, T, S]."""
    base = (b.astype(jnp.uint32) * jnp.uint32(heads) + n.astype(jnp.uint32)) * jnp.uint32(t)
    idx = (base + rows.astype(jnp.uint32))[:, None] * jnp.uint32(s) + cols.astype(jnp.uint32)[None, :]
    return mix(idx, seed_ref[0], seed_ref[1]) >= jnp.uint32(threshold(rate))


def _scores(q, k, scale: float, visible):
    """[bq, bk] fp32 scores of a q tile against a k tile; keys not ``visible`` [bk] masked."""
    return jnp.where(visible[None, :], plgpu.dot(q, k, trans_b=True) * scale, NEG_INF)


def _fwd_kernel(mask_ref, seed_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, rate, t, s, heads, bk):
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = q_ref[...]
    bq, h = q.shape
    rows = i * bq + jnp.arange(bq)

    def body(j, carry):
        acc, m, l = carry
        sl = pl.ds(j * bk, bk)
        sc = _scores(q, k_ref[sl, :], scale, mask_ref[sl] != 0)
        m_new = jnp.maximum(m, sc.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = l * alpha + p.sum(axis=-1)
        if rate:
            cols = j * bk + jnp.arange(bk)
            p = jnp.where(_keep(seed_ref, rate, b, n, rows, cols, t, s, heads), p, 0.0)
        v = v_ref[sl, :]
        return acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v), m_new, l

    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, s // bk, body, init)
    o_ref[...] = (acc / (l[:, None] * (1.0 - rate))).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _tile_grads(q, k, v, do, lse, delta, visible, keep, scale, rate):
    """The backward's tile algebra: (dropped, rescaled probabilities; score gradients) [bq, bk].
    With P the softmax, Z the keep mask / (1 - rate) and O = (P Z) V: dV = (P Z)^T dO and
    dS = P (Z dO V^T - rowsum(dO O))."""
    p = jnp.exp(_scores(q, k, scale, visible) - lse[:, None])
    z = 1.0 / (1.0 - rate)
    dpd = plgpu.dot(do, v, trans_b=True)
    if keep is None:
        pd, dp = p * z, dpd * z
    else:
        pd, dp = jnp.where(keep, p * z, 0.0), jnp.where(keep, dpd * z, 0.0)
    return pd, jnp.where(visible[None, :], p * (dp - delta[:, None]), 0.0)


def _dq_kernel(
    mask_ref, seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, rate, t, s, heads, bk
):
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    bq, h = q.shape
    rows = i * bq + jnp.arange(bq)

    def body(j, dq):
        sl = pl.ds(j * bk, bk)
        cols = j * bk + jnp.arange(bk)
        keep = _keep(seed_ref, rate, b, n, rows, cols, t, s, heads) if rate else None
        k = k_ref[sl, :]
        _, ds = _tile_grads(q, k, v_ref[sl, :], do, lse, delta, mask_ref[sl] != 0, keep, scale, rate)
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, s // bk, body, jnp.zeros((bq, h), jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    mask_ref, seed_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, rate, t, s, heads, bq
):
    """dK, dV of query head n's share [bk, H] (fp32; the G heads of a key/value head are summed after)."""
    j, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v, visible = k_ref[...], v_ref[...], mask_ref[...] != 0
    bk, h = k.shape
    cols = j * bk + jnp.arange(bk)

    def body(i, carry):
        dk, dv = carry
        sl = pl.ds(i * bq, bq)
        rows = i * bq + jnp.arange(bq)
        keep = _keep(seed_ref, rate, b, n, rows, cols, t, s, heads) if rate else None
        q, do = q_ref[sl, :], do_ref[sl, :]
        pd, ds = _tile_grads(q, k, v, do, lse_ref[sl], delta_ref[sl], visible, keep, scale, rate)
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv + plgpu.dot(
            pd.astype(do.dtype), do, trans_a=True
        )

    zero = jnp.zeros((bk, h), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, t // bq, body, (zero, zero))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _rows_spec(block: int, h: int, g: int = 1):
    """Grid (tiles, B, N) -> tile i [block, H] of [B, T|S, N|K, H] at head n // g."""
    return pl.BlockSpec((None, block, None, h), lambda i, b, n: (b, i, n // g, 0))


def _whole(length: int, h: int, g: int = 1):
    """Grid (tiles, B, N) -> all ``length`` rows [length, H] of head n // g."""
    return pl.BlockSpec((None, length, None, h), lambda i, b, n: (b, 0, n // g, 0))


def _per_row(block: int):
    """Grid (tiles, B, N) -> a [block] slice of a [B, N, T] row statistic (log-sum-exp, delta)."""
    return pl.BlockSpec((None, None, block), lambda i, b, n: (b, n, i))


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, **kw):
    return pl.pallas_call(
        functools.partial(kernel, **kw),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=name,
    )


def _prefix(s: int):
    """The mask and seed specs every kernel starts with: the key mask row of batch b, the seed."""
    return [pl.BlockSpec((None, s), lambda i, b, n: (b, 0)), pl.BlockSpec((2,), lambda i, b, n: (0,))]


def _forward(q, k, v, key_mask, seed, scale, rate, interpret):
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    bq = min(BLOCK, t)
    return _call(
        _fwd_kernel,
        (t // bq, b, n),
        _prefix(s) + [_rows_spec(bq, h), _whole(s, h, n // kh), _whole(s, h, n // kh)],
        [_rows_spec(bq, h), _per_row(bq)],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        interpret,
        "jsteer_flash_dropout_fwd",
        scale=scale,
        rate=rate,
        t=t,
        s=s,
        heads=n,
        bk=min(BLOCK, s),
    )(key_mask, seed, q, k, v)


def _check(q, k, v, key_mask, seed, rate):
    b, t, n, h = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != h or n % k.shape[2]:
        raise ValueError(
            f"flash_attention: q {q.shape} needs k and v [{b}, S, K, {h}] with K dividing {n}; got {k.shape}, {v.shape}"
        )
    if key_mask.shape != (b, k.shape[1]) or seed.shape != (2,):
        raise ValueError(
            f"flash_attention: key_mask must be [{b}, {k.shape[1]}] and seed [2]; got {key_mask.shape}, {seed.shape}"
        )
    if not supported(t, k.shape[1], h):
        raise ValueError(f"flash_attention: T={t}, S={k.shape[1]}, H={h} unsupported (powers of two, at least 16)")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"flash_attention: rate must be in [0, 1), got {rate}")
    if b * n * t * k.shape[1] >= 2**32:
        raise ValueError(f"flash_attention: {b} x {n} x {t} x {k.shape[1]} probabilities exceed the 32-bit counter")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def flash_attention(q, k, v, key_mask, seed, scale: float, rate: float, interpret: bool = False) -> Array:
    """softmax(scale * q k^T, keys masked by ``key_mask``) with the probabilities dropped at
    ``rate`` by the hash mask of ``seed``, times v (module docstring for shapes). ``interpret``:
    run in Pallas' interpreter (any backend; for tests)."""
    _check(q, k, v, key_mask, seed, rate)
    return _forward(q, k, v, key_mask.astype(jnp.int32), seed.astype(jnp.uint32), scale, rate, interpret)[0]


def _fwd(q, k, v, key_mask, seed, scale, rate, interpret):
    _check(q, k, v, key_mask, seed, rate)
    key_mask, seed = key_mask.astype(jnp.int32), seed.astype(jnp.uint32)
    o, lse = _forward(q, k, v, key_mask, seed, scale, rate, interpret)
    return o, (q, k, v, key_mask, seed, o, lse)


def _bwd(scale, rate, interpret, res, do):
    q, k, v, key_mask, seed, o, lse = res
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    do = do.astype(q.dtype)
    delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
    bq, bk = min(BLOCK_BWD, t), min(BLOCK_BWD, s)
    kw = dict(scale=scale, rate=rate, t=t, s=s, heads=n)
    dq = _call(
        _dq_kernel,
        (t // bq, b, n),
        _prefix(s)
        + [_rows_spec(bq, h), _whole(s, h, n // kh), _whole(s, h, n // kh), _rows_spec(bq, h)]
        + [_per_row(bq), _per_row(bq)],
        _rows_spec(bq, h),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret,
        "jsteer_flash_dropout_dq",
        bk=bk,
        **kw,
    )(key_mask, seed, q, k, v, do, lse, delta)
    kv_tile = _rows_spec(bk, h, n // kh)
    dk, dv = _call(
        _dkv_kernel,
        (s // bk, b, n),
        [pl.BlockSpec((None, bk), lambda j, bb, nn: (bb, j)), pl.BlockSpec((2,), lambda j, bb, nn: (0,))]
        + [kv_tile, kv_tile, _whole(t, h), _whole(t, h)]
        + [pl.BlockSpec((None, None, t), lambda j, bb, nn: (bb, nn, 0))] * 2,
        [_rows_spec(bk, h)] * 2,
        [jax.ShapeDtypeStruct((b, s, n, h), jnp.float32)] * 2,
        interpret,
        "jsteer_flash_dropout_dkv",
        bq=bq,
        **kw,
    )(key_mask, seed, k, v, q, do, lse, delta)
    if kh != n:  # the G query heads of each key/value head
        dk, dv = (x.reshape(b, s, kh, n // kh, h).sum(3) for x in (dk, dv))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


flash_attention.defvjp(_fwd, _bwd)


def reference(q, k, v, key_mask, seed, scale: float, rate: float) -> Array:
    """The same function through the hand-written path (:func:`attention.dot_product_attention`),
    for tests: q [B, T, N, H] -> [B, T, N, H]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    out = dot_product_attention(
        q.reshape(b, t, kh, n // kh, h),
        k,
        v,
        scale=scale,
        visible=(key_mask != 0)[:, None, None, None, :],
        dropout=HashDropout(jnp.asarray(seed, jnp.uint32), rate) if rate else None,
    )
    return out.reshape(b, t, n, h)


__all__ = ["flash_attention", "reference", "supported", "BLOCK", "BLOCK_BWD"]
