"""Keep XLA:CPU's per-call buffers mapped between calls, on request (``JSTEER_CPU_MALLOC=keep``).

XLA:CPU allocates one buffer for a program's temporaries at every call (``posix_memalign``) and
frees it at the end. Beyond glibc's mmap threshold (32 MiB at most), and from any of the runtime's
worker threads (their arenas map anything over 64 MiB separately), that buffer is a fresh ``mmap``
each call, and its first touch faults in every page again. MiniLM's B32xT128 train step allocates
845 MB that way: ~214k page faults a step at ~1.9 us each on a 2-core Xeon VM; the step ran
1.36-1.45 s, and 1.17-1.26 s with the buffer kept (``bench_backbones_minilm_s46.json``: 1.41 ->
1.20-1.30 s). PyTorch's separate, smaller tensors stay under glibc's dynamic threshold and are reused.

With ``JSTEER_CPU_MALLOC=keep`` in the environment, glibc is told (``mallopt``) before XLA's
threads start to keep the buffer mapped: one arena (the main one, so that no worker thread maps
large blocks by itself), no mmap for large blocks and no trimming of the heap's free top. It is off
by default because the one arena costs where programs are small and many: the demo's KALA section
(a tiny BERT, compiled and trained) 22.8 -> 32.2 s, with the arena alone 31.1 s (XLA's threads
contend for its lock). A process that keeps also keeps the heap of its peak (freed memory is
reused, not returned); :func:`release` returns it. Back to back, XLA's thread frees a call's
buffer after the next call took its own, and a freed block between live ones is too small for a
64-byte-aligned request of its own size (glibc 2.36 asks the heap for the size plus the alignment),
so the kept heap grows by whole buffers before it settles: for a 256 MiB temporary at 0.56-1.6 GiB
after 2-15 calls (8 runs; until then a call may fault again). A bounded top (trim beyond 2 GiB,
down to 1 GiB) was tried: a SmolLM2 train step whose 1.8 GB of temporaries outgrew it faulted them
in again and, every ~8 steps, took 7.5-9 s instead of 4.5 s (6-9 s of system time in the kernel).
Only glibc on Linux is touched, and only before a JAX backend started (its threads would keep their
arenas).

The cheaper remedy needs no arena change but must be in the environment before Python starts:
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35) has glibc advise transparent huge pages
for the blocks it maps, so the same 845 MB fault in 2 MiB at a time (~600 faults a step): the step
1.43 -> 1.30 s, the demo's KALA section unchanged (22.8 s). Memory touched for the first time
costs more (a 1B bf16 checkpoint loaded in 3.2 s instead of 0.8 s). ``make`` sets it;
:data:`HUGEPAGES` says whether this process has it.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

from jsteer.cpu_precision import _backend_started

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER = -1  # M_TRIM_THRESHOLD's documented "no trimming" (mallopt(3))
HUGETLB = "glibc.malloc.hugetlb"


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") else None
    except (ValueError, OSError, AttributeError):
        return None


def apply() -> str:
    """Set glibc's malloc options when ``JSTEER_CPU_MALLOC=keep`` asks and it can act; returns the
    state, one of ``"kept"`` (set now), ``"system: ..."`` (not asked), ``"too late: ..."``,
    ``"not glibc: ..."``, ``"failed: ..."``."""
    if os.environ.get("JSTEER_CPU_MALLOC", "").lower() != "keep":
        return "system: glibc's defaults (JSTEER_CPU_MALLOC=keep keeps XLA's per-call buffers)"
    libc = _glibc()
    if libc is None:
        return "not glibc: the system allocator's defaults"
    if _backend_started():
        return "too late: a JAX backend started before jsteer was imported (glibc's defaults)"
    failed = [
        name
        for name, opt, value in (
            ("M_ARENA_MAX", M_ARENA_MAX, 1),
            ("M_MMAP_MAX", M_MMAP_MAX, 0),
            ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, NEVER),
        )
        if libc.mallopt(ctypes.c_int(opt), ctypes.c_int(value)) != 1
    ]
    return f"failed: mallopt refused {', '.join(failed)}" if failed else "kept"


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always / madvise / never), or "unknown"."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "unknown"


def _reserved_hugepages() -> int:
    try:
        return int(open("/proc/sys/vm/nr_hugepages").read())
    except (OSError, ValueError):
        return 0


def hugepages(tunables: str | None = None, thp: str | None = None, version: str | None = None) -> str:
    """Whether glibc's large blocks get transparent huge pages here: ``"on: ..."``, or ``"off: ..."``
    with what would turn it on. tunables: ``GLIBC_TUNABLES`` as this process started with it;
    thp: the kernel's mode; version: ``CS_GNU_LIBC_VERSION`` ("glibc 2.36"; all read from the
    system when None)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "") if tunables is None else tunables
    thp = _thp_mode() if thp is None else thp
    if thp == "always":
        return "on: the kernel's transparent huge pages are 'always'"
    if version is None:
        if _glibc() is None:
            return "off: not glibc"
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    values = [kv.split("=", 1)[1] for kv in tunables.split(":") if kv.startswith(HUGETLB + "=")]  # glibc's separator
    if not values or values[-1] == "0":
        return f"off: set GLIBC_TUNABLES={HUGETLB}=1 before Python starts (the kernel's mode: {thp})"
    number = re.search(r"(\d+)\.(\d+)", version)  # a vendor suffix ("2.35-0ubuntu3") or none at all
    if number and (int(number[1]), int(number[2])) < (2, 35):
        return f"off: {version} predates {HUGETLB} (2.35)"
    if values[-1] not in ("1", "2"):
        return f"off: glibc ignores {HUGETLB}={values[-1]} (1: transparent huge pages, 2: reserved ones)"
    if values[-1] == "1" and thp != "madvise":
        return f"off: {HUGETLB}=1 asks for transparent huge pages, and the kernel's mode is {thp}"
    if values[-1] == "2" and _reserved_hugepages() == 0:
        return f"off: {HUGETLB}=2 maps reserved huge pages and none are (/proc/sys/vm/nr_hugepages)"
    return f"on: GLIBC_TUNABLES={HUGETLB}={values[-1]}, the kernel's mode {thp}"


def release() -> bool:
    """Return the heap's free memory to the system (``malloc_trim``), e.g. after a large one-off
    computation; the next call of a program faults its temporaries in once again. True when glibc
    released some."""
    libc = _glibc()
    return bool(libc.malloc_trim(ctypes.c_size_t(0))) if libc is not None else False


STATE = apply()
HUGEPAGES = hugepages()
