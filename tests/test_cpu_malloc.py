"""jsteer.cpu_malloc: XLA:CPU's per-call temporaries stay mapped between calls, and when they do not;
huge pages for them when glibc is told so at start (GLIBC_TUNABLES)."""

import os
import subprocess
import sys

import pytest

from jsteer import cpu_malloc

N = 8192  # the probe's temporary: an [N, N] fp32 product, 256 MiB, summed to a scalar
PAGES = N * N * 4 // 4096

PROBE = f"""
import resource
import jsteer, jax, jax.numpy as jnp
f = jax.jit(lambda x: (x @ x.T).sum())
x = jnp.ones(({N}, 16), jnp.float32)
for _ in range(20):  # XLA frees a call's temporaries on its own thread after the result, so back to back the
    f(x).block_until_ready()  # next call's block is taken first: a kept heap grows for up to ~15 calls (cpu_malloc)
faults = []
for _ in range(6):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(jsteer.cpu_malloc.STATE + '|' + str(min(faults)))
"""


def _run(code: str, **env) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if k not in ("JSTEER_CPU_MALLOC", "GLIBC_TUNABLES")}  # make sets one
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, faults = out.stdout.strip().splitlines()[-1].split("|")
    return state, int(faults)


def test_keep_stops_faulting_a_calls_temporaries_in_again():
    """Fails without the setting: glibc maps the 256 MiB block afresh at every call (next test)."""
    state, faults = _run(PROBE, JSTEER_CPU_MALLOC="keep")
    assert state == "kept"
    assert faults < PAGES // 20, f"{faults} page faults a call for a {PAGES}-page temporary"


def test_the_default_is_glibcs_and_pays_the_faults():
    state, faults = _run(PROBE)
    assert state.startswith("system: glibc's defaults")
    assert faults > PAGES // 2, f"{faults} page faults: the probe no longer shows what the setting avoids"


def test_a_backend_started_before_import_is_left_alone_and_reported():
    code = "import jax; jax.numpy.ones(2).block_until_ready()\n" + PROBE
    state, faults = _run(code, JSTEER_CPU_MALLOC="keep")
    assert state.startswith("too late") and faults > PAGES // 2


def test_release_returns_the_kept_memory():
    """After ``release()`` the temporary is faulted in again: the memory went back to the system."""
    code = PROBE + (
        "import time\n"
        "time.sleep(0.5)  # the last call's temporaries freed (by XLA's thread)\n"
        "assert jsteer.cpu_malloc.release()\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "f(x).block_until_ready()\n"
        "print(jsteer.cpu_malloc.STATE + '|' + str(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0))\n"
    )
    state, faults = _run(code, JSTEER_CPU_MALLOC="keep")
    assert state == "kept" and faults > PAGES // 2


def test_huge_pages_fault_a_calls_temporaries_in_2_mib_at_a_time():
    """glibc.malloc.hugetlb=1: glibc's fresh map of the 256 MiB block is advised for huge pages, so
    it faults in a few hundred times, not 65k (the default above); where the kernel cannot (THP
    'never'), HUGEPAGES says so."""
    code = PROBE + "print(jsteer.cpu_malloc.HUGEPAGES + '|' + str(min(faults)))\n"
    state, faults = _run(code, GLIBC_TUNABLES=cpu_malloc.HUGETLB + "=1")
    if cpu_malloc._thp_mode() in ("madvise", "always"):
        assert state.startswith("on: "), state
        assert faults < PAGES // 20, f"{faults} page faults a call for a {PAGES}-page temporary"
    else:
        assert state.startswith("off: ") and cpu_malloc._thp_mode() in state, state


@pytest.mark.parametrize(
    "tunables,thp,want",
    [
        ("", "madvise", "off: set GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before Python starts"),
        ("glibc.malloc.hugetlb=1", "madvise", "on: GLIBC_TUNABLES=glibc.malloc.hugetlb=1"),
        ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "madvise", "on: "),
        ("glibc.malloc.hugetlb=1:glibc.malloc.hugetlb=0", "madvise", "off: set GLIBC_TUNABLES"),
        ("glibc.malloc.arena_max=2,glibc.malloc.hugetlb=1", "madvise", "off: set GLIBC_TUNABLES"),  # not glibc's syntax
        ("glibc.malloc.hugetlb=1", "never", "off: glibc.malloc.hugetlb=1 asks for transparent huge pages"),
        ("glibc.malloc.hugetlb=7", "madvise", "off: glibc ignores glibc.malloc.hugetlb=7"),
        ("", "always", "on: the kernel's transparent huge pages are 'always'"),
    ],
)
def test_the_huge_page_state_reads_the_tunable_and_the_kernels_mode(tunables, thp, want):
    assert cpu_malloc.hugepages(tunables, thp).startswith(want)


@pytest.mark.parametrize(
    "version,want",
    [("glibc 2.36", "on: "), ("glibc 2.35-0ubuntu3", "on: "), ("glibc 2.31", "off: glibc 2.31 predates"), ("", "on: ")],
)
def test_the_huge_page_state_reads_any_glibc_version_string(version, want):
    assert cpu_malloc.hugepages("glibc.malloc.hugetlb=1", "madvise", version).startswith(want)
