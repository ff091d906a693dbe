"""Contended f32 scatters on this device: does its XLA emit native atomics? (jsteer.gpu_atomics)

    python experiments/gpu_scatter_probe.py [--out F.json]

Times jitted scatter-adds of [E, D] rows into an [N, D] table and scatter-maxes of [E] values into
[N] (KALA's batch-256 graph: E 16384 edges, N 2561 segments, D 384) with three index patterns:
uniform over the rows; 70% of them into one row (the padding edges jraph.pad_with_graphs points
at one node, a padded batch's pad-token rows in an embedding gradient); all into one row. Native
atomics cost about the same for all three; a compare-and-swap loop (jax-ml/jax#38806: the CUDA
plugins of jax 0.10.2-0.11.0) costs orders of magnitude more under contention. Run it once as is
and once with XLA_FLAGS=--xla_backend_extra_options=-nvptx-allow-ftz-atomics to see the option's
effect on this plugin.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edges", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=2561)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsteer import perf

    rng = np.random.default_rng(0)
    uniform = rng.integers(0, a.rows, a.edges)
    patterns = {
        "uniform": uniform,
        "70% into one row": np.where(rng.random(a.edges) < 0.7, a.rows - 1, uniform),
        "all into one row": np.full(a.edges, a.rows - 1),
    }
    add = jax.jit(lambda t, i, u: t.at[i].add(u))
    mx = jax.jit(lambda t, i, u: t.at[i].max(u))
    table, vec = jnp.zeros((a.rows, a.dim), jnp.float32), jnp.full((a.rows,), -jnp.inf, jnp.float32)
    rows, vals = jnp.ones((a.edges, a.dim), jnp.float32), jnp.asarray(rng.standard_normal(a.edges), jnp.float32)

    def ms(fn, *args):
        jax.block_until_ready(fn(*args))
        t = time.perf_counter()
        for _ in range(a.reps):
            out = fn(*args)
        jax.block_until_ready(out)
        return 1e3 * (time.perf_counter() - t) / a.reps

    res = {
        "device": jax.devices()[0].device_kind,
        "machine": perf.machine(),  # versions, XLA_FLAGS, jsteer.gpu_atomics' state
        "shape": {"edges": a.edges, "rows": a.rows, "dim": a.dim},
        "ms": {},
    }
    for name, idx in patterns.items():
        i = jnp.asarray(idx, jnp.int32)
        res["ms"][name] = {"scatter_add_rows": ms(add, table, i, rows), "scatter_max": ms(mx, vec, i, vals)}
        print(
            f"{name:<18} scatter-add [E, D] {res['ms'][name]['scatter_add_rows']:8.3f} ms | "
            f"scatter-max [E] {res['ms'][name]['scatter_max']:8.3f} ms",
            flush=True,
        )
    m = res["machine"]
    print(f"jax {m['versions']['jax']} on {res['device']}; jsteer.gpu_atomics: {m['gpu_atomics']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
