"""jsteer.perf: the benchmarks' products floor counts the products autodiff really computes, with
FLOPs re-derived from NumPy products; the timing protocol interleaves the two sides."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer import perf


def _dots(fn, *args) -> list[float]:
    """FLOPs of every dot_general in ``fn``'s jaxpr: 2 x output size x contracted size."""
    out = []
    for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out.append(2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract))
    return sorted(out)


def _listed(rows) -> list[float]:
    return sorted(
        float(perf.product_flops(lhs, rhs, ta, tb)) for _, count, lhs, rhs, ta, tb in rows for _ in range(count)
    )


def _forward_and_backward(f, *args):
    def both(*a):
        y, pull = jax.vjp(f, *a)
        return pull(jnp.ones_like(y))

    return both


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_product_flops_match_a_numpy_product(ta, tb):
    rng = np.random.default_rng(0)
    for lhs, rhs in (((5, 7), (7, 3)), ((4, 5, 7), (4, 7, 3))):
        a = rng.standard_normal(lhs[:-2] + lhs[-2:][::-1] if ta else lhs)
        b = rng.standard_normal(rhs[:-2] + rhs[-2:][::-1] if tb else rhs)
        out = np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)
        k = a.shape[-2] if ta else a.shape[-1]
        assert perf.product_flops(a.shape, b.shape, ta, tb) == 2 * out.size * k


def test_dense_products_are_the_forward_and_backward_dots_of_a_dense_stack():
    n, dims = 6, [("up", 8, 12), ("down", 12, 8)]
    x = jnp.ones((n, 8))
    ws = [jnp.ones((din, dout)) for _, din, dout in dims]

    def stack(x, *ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    assert _listed(perf.dense_products(n, 1, dims)) == _dots(stack, x, *ws)
    assert _listed(perf.dense_products(n, 1, dims, backward=True)) == _dots(
        _forward_and_backward(stack, x, *ws), x, *ws
    )
    assert _listed(perf.dense_products(n, 3, dims)) == sorted(_dots(stack, x, *ws) * 3)


def test_attention_products_are_the_forward_and_backward_dots_of_attention():
    bh, t, hd = 3, 5, 4
    q = k = v = jnp.ones((bh, t, hd))

    def attn(q, k, v):
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)
        return jnp.einsum("bts,bsd->btd", p, v)

    assert _listed(perf.attention_products(bh, t, hd, 1)) == _dots(attn, q, k, v)
    assert _listed(perf.attention_products(bh, t, hd, 1, backward=True)) == _dots(
        _forward_and_backward(attn, q, k, v), q, k, v
    )


def test_timed_pair_interleaves_the_sides_each_after_its_own_settling_call():
    log = []
    j, h = perf.timed_pair(lambda: log.append("j"), lambda: log.append("h"), reps=2, settle=1)
    assert "".join(log) == "jh" + "jjhh" * 2
    assert len(j["times_s"]) == len(h["times_s"]) == len(h["paired_ratios"]) == 2
    assert j["median_s"] >= j["min_s"] >= 0
    only, none = perf.timed_pair(lambda: None, None, reps=3)
    assert none is None and len(only["times_s"]) == 3


def test_time_products_sums_count_times_the_faster_side():
    rows = [("x W", 3, (16, 32), (32, 8), False, False), ("q k^T", 2, (2, 8, 4), (2, 8, 4), False, True)]
    res = perf.time_products(rows, reps=2, use_torch=True)
    assert res["gflop"] == pytest.approx((3 * 2 * 16 * 32 * 8 + 2 * 2 * 2 * 8 * 4 * 8) / 1e9)
    assert [r["product"] for r in res["products"]] == ["x W", "q k^T"]
    assert all(r["jax_gflops"] > 0 and r["torch_gflops"] > 0 for r in res["products"])
    # each product's best side's time: count x gflop / the faster rate
    best = sum(r["count"] * r["gflop"] / max(r["jax_gflops"], r["torch_gflops"]) for r in res["products"])
    assert res["floor_s"] == pytest.approx(best)


def test_read_bandwidth_is_a_plausible_host_rate():
    rate = perf.read_bandwidth(nbytes=64 << 20, reps=2)
    assert 1e8 < rate < 1e13


def test_machine_names_the_cpu_its_flags_and_the_software():
    import pathlib

    from jsteer.backbones import cpu

    m = perf.machine()
    assert m["cpu"] == cpu.describe() and m["cpu"]["model"] and isinstance(m["cpu"]["simd"], list)
    assert m["versions"]["jax"] == jax.__version__ and m["cpu_count"] >= 1 and len(m["load_avg"]) == 3
    assert m["xla_flags"] == os.environ.get("XLA_FLAGS", "") and m["jsteer_commit"]
    # every benchmark script records it (bench_backbones: cpu.describe() in its env, as before)
    benches = sorted((pathlib.Path(__file__).parents[1] / "experiments").glob("bench_*.py"))
    assert len(benches) >= 8
    for f in benches:
        text = f.read_text()
        assert "perf.machine()" in text or "cpu.describe()" in text, f.name
