"""The benchmarks' protocol (``experiments/bench_*.py``): interleaved timing and the physical
bounds a speed claim is stated against.

- :func:`timed` (fn, reps) and :func:`timed_pair` (jsteer's fn, HF's fn, reps): medians of
  interleaved calls, each timed call after ``settle`` untimed ones of the same side;
- :func:`read_bandwidth`: the host's memory read rate in bytes/s (a decode step's bound is
  param bytes / that rate on a CPU);
- :func:`machine`: what every benchmark JSON records of where it ran (CPU model, family and vector
  flags, jsteer's CPU settings, versions, XLA flags, load);
- the *products floor*: a case's matrix products as rows ``(label, count, lhs shape, rhs shape,
  transpose lhs, transpose rhs)`` (:func:`dense_products` [n, d_in] x [d_in, d_out] and, for a
  backward, dY W^T and X^T dY; :func:`attention_products` [B*H, T, Dh] batched), their FLOPs
  (:func:`product_flops`) and :func:`time_products`: each product timed alone under jax and
  torch, summed at the faster library's time.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

SETTLE = 1  # untimed same-side calls before each timed one in timed_pair
PACKAGES = (  # whose versions `jsteer doctor` and :func:`machine` record
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "transformers",
    "torch",
    "tokenizers",
    "safetensors",
    "gguf",
    "jraph",
    "tensorflow-datasets",
    "matplotlib",
)


def installed(dist: str) -> str | None:
    """An installed distribution's version, or None."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    """Where a benchmark ran: {"cpu": :func:`jsteer.backbones.cpu.describe` (model, family, SIMD flags,
    jsteer's fp32 dots, malloc and huge-page settings), "cpu_count", "mem_total_bytes", "load_avg",
    "platform", "python", "versions" (of :data:`PACKAGES`, None when absent), "xla_flags",
    "gpu_atomics" (``jsteer.gpu_atomics.STATE``), "jsteer_commit" (None outside a git checkout)}."""
    from jsteer import gpu_atomics
    from jsteer.backbones import cpu

    try:
        mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = None
    here = os.path.dirname(os.path.abspath(__file__))
    try:  # a device's copy of the tree has no .git, a machine may have no git
        git = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        commit = git.stdout.strip() if git.returncode == 0 else None
    except OSError:
        commit = None
    return {
        "cpu": cpu.describe(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem,
        "load_avg": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {n: installed(n) for n in PACKAGES},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "gpu_atomics": gpu_atomics.STATE,
        "jsteer_commit": commit,
    }


def timed(fn, reps: int, warmup: int = 1) -> dict:
    """Run ``fn`` (which must block until its result is ready) warmup + reps times."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "first_call_s": first,
        "times_s": [round(t, 5) for t in times],
    }


def timed_pair(fj, fh, reps: int, settle: int = SETTLE) -> tuple[dict, dict | None]:
    """:func:`timed` for jsteer's ``fj`` and HF's ``fh`` (None: jsteer only), their timed calls
    interleaved (j, h, j, h, ...) so that a burst of load on this shared machine slows both
    sides alike instead of one side's whole series. Each timed call follows ``settle`` untimed
    calls of the same side, so no side is timed on the call right after the other's: measured
    on the 2-core VM, the first jsteer MiniLM train step after HF train steps took 4.2 s, the
    next ones 2.6 s (HF's were level, ~2.6 s), and a training loop runs steps back to back.
    HF's dict also gets ``paired_ratios`` (HF time / jsteer time of each pair)."""
    if fh is None:
        return timed(fj, reps), None
    out = []
    for fn in (fj, fh):  # first (compiling / warm-up) calls
        t0 = time.perf_counter()
        fn()
        out.append({"first_call_s": time.perf_counter() - t0, "times": []})
    for _ in range(reps):
        for fn, o in zip((fj, fh), out):
            for _ in range(settle):
                fn()
            t0 = time.perf_counter()
            fn()
            o["times"].append(time.perf_counter() - t0)
    res = [
        {
            "median_s": statistics.median(o["times"]),
            "min_s": min(o["times"]),
            "first_call_s": o["first_call_s"],
            "times_s": [round(t, 5) for t in o["times"]],
        }
        for o in out
    ]
    res[1]["paired_ratios"] = [round(h / j, 4) for j, h in zip(out[0]["times"], out[1]["times"])]
    return res[0], res[1]


_XLA_READ = """
import sys, time
import jax, jax.numpy as jnp
x = jnp.ones((int(sys.argv[1]) // 4,), jnp.float32)
total = jax.jit(jnp.sum)
total(x).block_until_ready()
best = float("inf")
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
print(int(sys.argv[1]) / best)
"""


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Host memory read bandwidth in bytes/s: the best of ``reps`` full reads of an ``nbytes``
    array, by NumPy sums over one chunk per core in threads and by a jitted sum in a fresh process
    on XLA's default CPU flags. Not in this process: with YNNPACK's fusions off (jsteer's precise
    dots) XLA:CPU's sum reads at about half the rate (session 41's Xeon: 12.9 against 29.4 GB/s,
    NumPy 17 GB/s; the decode kernel streams SmolLM2's weights at ~28 GB/s)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    x = np.ones(nbytes // 4, np.float32)
    chunks = np.array_split(x, os.cpu_count() or 1)
    best = float("inf")
    with ThreadPoolExecutor(len(chunks)) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    rate = nbytes / best
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "ynn" not in f))
    run = subprocess.run(
        [sys.executable, "-c", _XLA_READ, str(nbytes), str(reps)], env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"jsteer.perf.read_bandwidth: the XLA read probe failed: {run.stderr[-2000:]}")
    return max(rate, float(run.stdout.split()[-1]))


def product_flops(lhs, rhs, ta: bool, tb: bool) -> int:
    """FLOPs of one (batched) product of ``lhs`` by ``rhs`` shapes, either transposed first:
    2 x batch x m x k x n."""
    m, k = (lhs[-1], lhs[-2]) if ta else (lhs[-2], lhs[-1])
    n = rhs[-2] if tb else rhs[-1]
    return 2 * (lhs[0] if len(lhs) == 3 else 1) * m * k * n


def dense_products(n: int, layers: int, dims, backward: bool = False) -> list:
    """The products of ``layers`` stacks of dense layers over ``n`` token rows: ``dims`` lists
    (name, d_in, d_out) per layer. Rows: (label, count, lhs shape, rhs shape, transpose lhs,
    transpose rhs). With ``backward``, each layer's dX = dY W^T and dW = X^T dY too."""
    rows = []
    for name, din, dout in dims:
        rows.append((f"{name} x W", layers, (n, din), (din, dout), False, False))
        if backward:
            rows += [
                (f"{name} dY W^T", layers, (n, dout), (din, dout), False, True),
                (f"{name} X^T dY", layers, (n, din), (n, dout), True, False),
            ]
    return rows


def attention_products(batch_heads: int, t: int, head_dim: int, layers: int, backward: bool = False) -> list:
    """Attention's batched products per layer: q k^T and p v, and with ``backward`` dS k, dS^T q,
    dO v^T and p^T dO."""
    bh = batch_heads
    rows = [
        ("q k^T", layers, (bh, t, head_dim), (bh, t, head_dim), False, True),
        ("p v", layers, (bh, t, t), (bh, t, head_dim), False, False),
    ]
    if backward:
        rows += [
            ("dS k", layers, (bh, t, t), (bh, t, head_dim), False, False),
            ("dS^T q", layers, (bh, t, t), (bh, t, head_dim), True, False),
            ("dO v^T", layers, (bh, t, head_dim), (bh, t, head_dim), False, True),
            ("p^T dO", layers, (bh, t, t), (bh, t, head_dim), True, False),
        ]
    return rows


def time_products(products: list, reps: int, use_torch: bool) -> dict:
    """Time each of ``products`` alone (jitted jax and, with ``use_torch``, torch, interleaved by
    :func:`timed_pair`) on random fp32 operands: {"products": [per product: label, count, shapes,
    gflop, jax_gflops, torch_gflops], "gflop": the total, "floor_s": the sum of count x the faster
    side's median}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    rows, floor, flops = [], 0.0, 0
    for label, count, lhs, rhs, ta, tb in products:
        a, b = rng.standard_normal(lhs, np.float32), rng.standard_normal(rhs, np.float32)

        def jf(x, y, ta=ta, tb=tb):
            return jnp.matmul(jnp.swapaxes(x, -1, -2) if ta else x, jnp.swapaxes(y, -1, -2) if tb else y)

        jfn, aj, bj = jax.jit(jf), jnp.asarray(a), jnp.asarray(b)
        fh = None
        if use_torch:
            import torch

            at, bt = torch.from_numpy(a), torch.from_numpy(b)
            at, bt = (at.transpose(-1, -2) if ta else at), (bt.transpose(-1, -2) if tb else bt)
            fh = lambda at=at, bt=bt: torch.matmul(at, bt)  # noqa: E731
        j, h = timed_pair(lambda jfn=jfn, aj=aj, bj=bj: jfn(aj, bj).block_until_ready(), fh, reps)
        best = min(j["median_s"], h["median_s"]) if h is not None else j["median_s"]
        f = product_flops(lhs, rhs, ta, tb)
        row = {
            "product": label,
            "count": count,
            "lhs": list(lhs),
            "rhs": list(rhs),
            "gflop": f / 1e9,
            "jax_gflops": f / j["median_s"] / 1e9,
        }
        if h is not None:
            row["torch_gflops"] = f / h["median_s"] / 1e9
        rows.append(row)
        floor += count * best
        flops += count * f
    return {"products": rows, "gflop": flops / 1e9, "floor_s": floor}
