"""jsteer.gpu_atomics: on which CUDA plugins importing jsteer asks LLVM for native f32 atomics, and
how the option joins XLA_FLAGS. This machine has no CUDA plugin: the plugin lookup is faked."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from jsteer import gpu_atomics as ga

OPT = "--xla_backend_extra_options=-nvptx-allow-ftz-atomics"


def test_the_option_joins_an_existing_extra_options_flag_or_is_appended():
    assert ga.with_option("") == OPT
    assert ga.with_option("--xla_gpu_autotune_level=0") == "--xla_gpu_autotune_level=0 " + OPT
    assert ga.with_option("--xla_backend_extra_options=") == OPT
    assert ga.with_option("--a=1 --xla_backend_extra_options=x,y=2 --b") == (
        "--a=1 --xla_backend_extra_options=x,y=2,-nvptx-allow-ftz-atomics --b"
    )


@pytest.fixture
def fake(monkeypatch):
    """Set up apply(): a plugin version, XLA_FLAGS, JSTEER_GPU_ATOMICS; returns (state, XLA_FLAGS)."""

    def run(version, flags="--xla_gpu_autotune_level=0", env=None, started=False, jaxlib=None):
        monkeypatch.setattr(ga, "plugin", lambda: version and ("jax-cuda12-pjrt", version))
        monkeypatch.setattr(ga, "release", lambda dist: jaxlib or version)
        monkeypatch.setattr(ga, "_backend_started", lambda: started)
        monkeypatch.setenv("XLA_FLAGS", flags)
        monkeypatch.delenv("JSTEER_GPU_ATOMICS", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        return ga.apply(), os.environ["XLA_FLAGS"]

    return run


@pytest.mark.parametrize("version", [(0, 10, 2), (0, 11, 0)])
def test_affected_plugins_get_the_option(fake, version):
    state, flags = fake(version)
    assert state.startswith("native: -nvptx-allow-ftz-atomics (jax-cuda12-pjrt 0.1"), state
    assert flags == "--xla_gpu_autotune_level=0 " + OPT


@pytest.mark.parametrize("version", [(0, 10, 1), (0, 11, 1), (0, 11, 2), None])
def test_other_plugins_and_no_plugin_are_left_alone(fake, version):
    state, flags = fake(version)
    assert state.startswith("not needed"), state
    assert flags == "--xla_gpu_autotune_level=0"


@pytest.mark.parametrize("jaxlib", [(0, 10, 1), (0, 11, 1)])
def test_a_jaxlib_outside_the_range_keeps_its_llvm_from_an_unknown_option(fake, jaxlib):
    state, flags = fake((0, 10, 2), jaxlib=jaxlib)
    assert state.startswith("not set: jax-cuda12-pjrt 0.10.2 with jaxlib"), state
    assert flags == "--xla_gpu_autotune_level=0"


def test_this_jaxlibs_llvm_takes_the_option_and_exits_on_an_unknown_one():
    """XLA:CPU hands --xla_backend_extra_options to LLVM, which exits on an option it does not know:
    the option as jsteer writes it compiles and runs on a jaxlib in the range (this one: 0.10.2)."""
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: (x * 2 + 1).sum())(jnp.ones(3))))"
    lib = ga.release("jaxlib")
    cases = [("-jsteer-no-such-llvm-option", False)]
    if lib is not None and ga.AFFECTED[0] <= lib <= ga.AFFECTED[1]:
        cases.append((ga.OPTION, True))
    for option, ok in cases:
        env = dict(os.environ, XLA_FLAGS=ga.with_option("", option))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert (out.returncode == 0 and out.stdout.strip() == "9.0") == ok, (option, out.returncode, out.stderr[-500:])


@pytest.mark.parametrize(
    "flags, env, started, state",
    [
        ("", {"JSTEER_GPU_ATOMICS": "cas"}, False, "cas: JSTEER_GPU_ATOMICS=cas"),
        ("--xla_gpu_ftz=true", {}, False, "user: "),
        (OPT, {}, False, "user: "),
        ("", {}, True, "too late: "),
    ],
)
def test_the_users_choice_and_a_started_backend_are_respected(fake, flags, env, started, state):
    got, after = fake((0, 10, 2), flags, env, started)
    assert got.startswith(state), got
    assert after == flags


def test_the_plugin_is_found_by_its_distribution(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "jax-cuda13-pjrt":
            return "0.11.0.dev20260701"
        if name.startswith("jax-cuda"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert ga.plugin() == ("jax-cuda13-pjrt", (0, 11, 0))


def test_importing_jsteer_here_changes_no_flag():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "import os, jsteer; print(jsteer.gpu_atomics.STATE + '|' + os.environ.get('XLA_FLAGS', ''))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    state, flags = out.stdout.strip().splitlines()[-1].split("|")
    assert state == "not needed: no jax CUDA plugin" and "nvptx" not in flags
