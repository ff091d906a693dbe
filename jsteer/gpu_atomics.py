"""Native float atomics in XLA:GPU's scatters where jax's CUDA plugin lost them (applied once,
when ``jsteer`` is imported).

The CUDA plugins of jax 0.10.2 and 0.11.0 ship an LLVM whose NVPTX backend turns a float atomic
add into a compare-and-swap retry loop unless the kernel flushes denormals (PTX's global
``atom.add.f32`` always flushes them; llvm-project 8ae895af32cc). Every f32 scatter-add XLA:GPU
emits then retries under contention, and training is full of contended ones: an embedding table's
gradient (a padded batch adds thousands of rows into the pad token's row; each position row gets
one add per sequence), KALA's graph segment sums into padding nodes. jax-ml/jax#38806 measured up
to ~2000x on a scatter into a small array, openxla/xla#46225 ~1 ms -> ~500 ms; 0.11.1 has the
LLVM fix. LLVM's option ``-nvptx-allow-ftz-atomics`` brings the native atomic back, with the
numerics of jax <= 0.10.1 (a denormal added atomically is flushed to zero).

It goes into ``XLA_FLAGS`` (``--xla_backend_extra_options``), which XLA reads when the first
backend starts, so it takes effect only if ``jsteer`` is imported before any JAX computation ran,
and only where a CUDA plugin and jaxlib of the affected versions are installed (XLA:CPU passes the
same options to jaxlib's LLVM, which exits the process on an option it does not know; jaxlib
0.10.2's knows this one: ``tests/test_gpu_atomics.py`` compiles with it). ``JSTEER_GPU_ATOMICS=cas`` keeps
XLA's default; the option already in ``XLA_FLAGS``, or ``--xla_gpu_ftz=true``, is left alone.
:data:`STATE` says which applies (``jsteer doctor``, the GPU benchmarks' JSON).
"""

from __future__ import annotations

import os

from jsteer.cpu_precision import _backend_started, release

OPTION = "-nvptx-allow-ftz-atomics"
EXTRA = "--xla_backend_extra_options="
AFFECTED = ((0, 10, 2), (0, 11, 0))  # CUDA plugin versions [lo, hi], both ends included
PLUGINS = ("jax-cuda12-pjrt", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda13-plugin")


def plugin() -> tuple[str, tuple[int, int, int]] | None:
    """(distribution, version) of the first installed jax CUDA plugin, or None."""
    for name in PLUGINS:
        v = release(name)
        if v is not None:
            return name, v
    return None


def with_option(flags: str, option: str = OPTION) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with ``option`` added to its ``--xla_backend_extra_options``
    (comma-separated; the flag appended when absent)."""
    tokens = flags.split()
    for i, t in enumerate(tokens):
        if t.startswith(EXTRA):
            value = t[len(EXTRA) :]
            tokens[i] = EXTRA + (f"{value},{option}" if value else option)
            return " ".join(tokens)
    return " ".join(tokens + [EXTRA + option])


def apply() -> str:
    """Add :data:`OPTION` to ``XLA_FLAGS`` when needed and allowed; returns the state, one of
    ``"not needed: ..."``, ``"not set: ..."``, ``"cas: JSTEER_GPU_ATOMICS=cas"``, ``"user: ..."``, ``"too late: ..."``
    or ``"native: ..."`` (set now)."""
    found = plugin()
    if found is None:
        return "not needed: no jax CUDA plugin"
    name, v = found
    where = f"{name} {'.'.join(map(str, v))}"
    if not (AFFECTED[0] <= v <= AFFECTED[1]):
        return f"not needed: {where} emits native f32 atomics"
    # XLA:CPU hands the same options to jaxlib's LLVM, which exits the process on one it lacks
    lib = release("jaxlib")
    if lib is None or not (AFFECTED[0] <= lib <= AFFECTED[1]):
        return f"not set: {where} with jaxlib {lib}, whose LLVM may not know {OPTION}"
    if os.environ.get("JSTEER_GPU_ATOMICS", "").lower() == "cas":
        return "cas: JSTEER_GPU_ATOMICS=cas"
    flags = os.environ.get("XLA_FLAGS", "")
    if OPTION in flags or "--xla_gpu_ftz=true" in flags.lower():
        return f"user: XLA_FLAGS already names {OPTION} or --xla_gpu_ftz=true ({where})"
    if _backend_started():
        return f"too late: a JAX backend started before jsteer was imported ({where}: CAS-loop f32 atomics)"
    os.environ["XLA_FLAGS"] = with_option(flags)
    return f"native: {OPTION} ({where})"


STATE = apply()
