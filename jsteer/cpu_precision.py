"""Accurate fp32 matrix products on the CPU backend (applied once, when ``jsteer`` is imported).

jaxlib 0.10 hands CPU dots to YNNPACK fusions by default. Their fp32 accumulation is about 3x
less accurate than Eigen's (or PyTorch's MKL/oneDNN) on long contractions: on SmolLM2-135M, whose
residual stream carries a ~2.25e4 activation from layer 11 on, jsteer's fp32 logits were 1.6e-4
(max) / 2.7e-5 (rms) from an fp64 reference against HF fp32's 5.8e-5 / 9.3e-6; with YNNPACK's
dot fusions off they are 6.6e-5 / 1.2e-5 (tests/test_gguf.py measures it). The price is ~10-25%
of CPU matmul throughput on large products (experiments/bench_backbones.py records the setting).

XLA reads ``XLA_FLAGS`` when the first backend starts, so this only takes effect if ``jsteer`` is
imported before any JAX computation ran. The user decides when they say so:
``JSTEER_CPU_DOTS=fast`` keeps XLA's default, and any ``--xla_cpu_experimental_ynn_fusion_type``
already in ``XLA_FLAGS`` is left alone. Only jaxlib versions known to have the flag are touched
(an unknown flag aborts XLA).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
KNOWN = ((0, 10), (0, 11))  # jaxlib versions [lo, hi) known to have FLAG


def release(dist: str) -> tuple[int, int, int] | None:
    """An installed distribution's leading major.minor[.patch] (patch 0 when absent), or None
    (not installed, or not numbered so)."""
    try:
        m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def _jaxlib_version() -> tuple[int, int] | None:
    v = release("jaxlib")
    return v[:2] if v else None


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):
        return True  # cannot tell: assume it started, report instead of guessing


def apply() -> str:
    """Set ``FLAG=`` (YNNPACK fusions off) in ``XLA_FLAGS`` when allowed; returns the state, one of
    ``"precise"`` (set now or before), ``"fast: JSTEER_CPU_DOTS=fast"``, ``"user: <flag>"``,
    ``"too late: ..."`` or ``"unknown jaxlib ..."``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JSTEER_CPU_DOTS", "").lower() == "fast":
        return "fast: JSTEER_CPU_DOTS=fast"
    mine = [f for f in flags.split() if f.startswith(FLAG)]
    if mine:
        return "precise" if mine[-1] == FLAG + "=" else f"user: {mine[-1]}"
    v = _jaxlib_version()
    if v is None or not (KNOWN[0] <= v < KNOWN[1]):
        return f"unknown jaxlib {v}: XLA's default dots"
    if _backend_started():
        return "too late: a JAX backend started before jsteer was imported (XLA's default dots)"
    os.environ["XLA_FLAGS"] = (flags + f" {FLAG}=").strip()
    return "precise"


STATE = apply()
