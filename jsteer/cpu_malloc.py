"""Keep XLA:CPU's per-call buffers mapped between calls (applied once, when ``jsteer`` is imported).

XLA:CPU allocates one buffer for a program's temporaries at every call (``posix_memalign``) and
frees it at the end. Beyond glibc's mmap threshold (32 MiB at most), and from any of the runtime's
worker threads (their arenas map anything over 64 MiB separately), that buffer is a fresh ``mmap``
each call, and its first touch faults in every page again. MiniLM's B32xT128 train step allocates
845 MB that way: ~214k page faults a step at ~1.9 us each on a 2-core Xeon VM; the step ran
1.36-1.45 s, and 1.17-1.26 s with the buffer kept (``bench_backbones_minilm_s46.json``: 1.41 ->
1.20 s). PyTorch's separate, smaller tensors stay under glibc's dynamic threshold and are reused.

So that the buffer stays mapped, glibc is told (``mallopt``) before XLA's threads start: one arena
(the main one, so that no worker thread maps large blocks by itself), no mmap for large blocks,
and a heap top trimmed only beyond ``TRIM`` bytes free and then down to ``PAD``. The cost: up to
about ``TRIM`` bytes of freed memory stay resident. ``JSTEER_CPU_MALLOC=system`` keeps glibc's
defaults; only glibc on Linux is touched, and only before a JAX backend started (its threads
would keep their arenas).
"""

from __future__ import annotations

import ctypes
import os
import sys

from jsteer.cpu_precision import _backend_started

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
TRIM = 2**31 - 1  # mallopt takes an int: the largest it can say, ~2 GiB
PAD = 2**30


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
    """Set glibc's malloc options when allowed; returns the state, one of ``"kept"`` (set now),
    ``"system: JSTEER_CPU_MALLOC=system"``, ``"too late: ..."``, ``"not glibc"``, ``"failed: ..."``."""
    if os.environ.get("JSTEER_CPU_MALLOC", "").lower() == "system":
        return "system: JSTEER_CPU_MALLOC=system"
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
            ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM),
            ("M_TOP_PAD", M_TOP_PAD, PAD),
        )
        if libc.mallopt(ctypes.c_int(opt), ctypes.c_int(value)) != 1
    ]
    return f"failed: mallopt refused {', '.join(failed)}" if failed else "kept"


STATE = apply()
