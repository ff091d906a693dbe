"""jsteer.cpu_precision: when importing jsteer turns YNNPACK's CPU dot fusions off, and when not."""

import os
import subprocess
import sys

import pytest

PROBE = "import os, jsteer; print(jsteer.cpu_precision.STATE + '|' + os.environ.get('XLA_FLAGS', ''))"


def _run(code: str, **env) -> tuple[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JSTEER_CPU_DOTS")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, flags = out.stdout.strip().splitlines()[-1].split("|")
    return state, flags


@pytest.mark.parametrize(
    "env, state, flags",
    [
        ({}, "precise", "--xla_cpu_experimental_ynn_fusion_type="),
        (
            {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
            "precise",
            "--xla_force_host_platform_device_count=2 --xla_cpu_experimental_ynn_fusion_type=",
        ),
        ({"JSTEER_CPU_DOTS": "fast"}, "fast: JSTEER_CPU_DOTS=fast", ""),
        (
            {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"},
            "user: --xla_cpu_experimental_ynn_fusion_type=dot",
            "--xla_cpu_experimental_ynn_fusion_type=dot",
        ),
    ],
)
def test_import_sets_the_flag_unless_told_otherwise(env, state, flags):
    assert _run(PROBE, **env) == (state, flags)


def test_a_backend_started_before_import_is_left_alone_and_reported():
    state, flags = _run("import jax; jax.numpy.ones(2).block_until_ready(); " + PROBE)
    assert state.startswith("too late") and flags == ""


def test_the_flag_reaches_xla():
    """A long fp32 contraction with a large-magnitude column: the Eigen path's error against fp64
    stays within a few fp32 ulps of the sum, where YNNPACK's was ~3x larger (seen on SmolLM2)."""
    code = (
        "import jsteer, jax, numpy as np\n"
        "r = np.random.default_rng(0); a = r.standard_normal((64, 4096)).astype(np.float32) * 30\n"
        "w = r.standard_normal((4096, 64)).astype(np.float32)\n"
        "ref = a.astype(np.float64) @ w.astype(np.float64)\n"
        "e = np.abs(np.asarray(jax.jit(lambda a, w: a @ w)(a, w)) - ref).max()\n"
        "print(jsteer.cpu_precision.STATE + '|' + repr(float(e)))\n"
    )
    precise = float(_run(code)[1])
    fast = float(_run(code, JSTEER_CPU_DOTS="fast")[1])
    assert precise < fast, (precise, fast)
