"""A CPU kernel for the few-row matmuls of decoding, reached from jitted JAX code through XLA FFI.

A decode step multiplies B rows (one token per sequence) by every weight matrix, so its time is
the time to read the weights. For 2 <= B <= 64, XLA:CPU's dot reads them at about half the
memory bandwidth (2-12 rows; 16-64 rows gain less, see BUILD.md); ``small_gemm.cc`` reads each weight once, contiguously, from a packed copy
(``pack``: [K, N] -> column panels [ceil(N/48), K, 48]) and keeps the output in registers.

    wp = pack(w)                        # once per weight, outside the decode loop
    y = small_gemm(x, wp, n=w.shape[1])  # x [M, K] -> y [M, N] == x @ w (fp32)

The kernel is compiled at first use (g++ -O3 -march=native, about 2 s) into ``cache_dir()``
and registered with XLA as the custom call ``jsteer_small_gemm``. ``available()`` is False, and
callers keep XLA's dot, when the backend is not CPU, the CPU lacks AVX-512F, no C++ compiler is
found, or ``JSTEER_CPU_KERNELS=0``; the reason is in ``unavailable_reason()``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array

PANEL = 48                 # columns per packed panel (small_gemm.cc: kPanel)
MIN_ROWS, MAX_ROWS = 2, 64  # rows where the kernel beats XLA:CPU's dot (one row: XLA's GEMV is as fast)
TARGET = "jsteer_small_gemm"
_SOURCE = pathlib.Path(__file__).with_name("small_gemm.cc")
_reason: Optional[str] = None


def cache_dir() -> pathlib.Path:
    """Where built kernels live: $JSTEER_CACHE/kernels, else ~/.cache/jsteer/kernels, else (not
    writable) a per-user folder in the temp directory."""
    root = os.environ.get("JSTEER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jsteer")
    path = pathlib.Path(root) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / f"jsteer-kernels-{os.getuid()}"


def _cpu_flags() -> str:
    """This CPU's feature flags (the first 'flags' line of /proc/cpuinfo), '' if unknown."""
    try:
        return next((line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), "")
    except OSError:
        return ""


def _cpu_has_avx512f() -> bool:
    return " avx512f" in _cpu_flags()


def _build() -> pathlib.Path:
    """Compile small_gemm.cc once per (source, jax, compiler, flags, CPU features) into cache_dir();
    atomic (a temp file renamed into place)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++) on PATH")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{include}"]
    # -march=native: a build is only valid on CPUs with the same features (a shared home directory)
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([cxx, include, jax.__version__, *flags,
                                                         _cpu_flags()]).encode())
    out = cache_dir() / f"small_gemm-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, str(_SOURCE), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when ``small_gemm`` can run here (see the module docstring); builds and registers once."""
    global _reason
    if os.environ.get("JSTEER_CPU_KERNELS", "1") == "0":
        _reason = "disabled by JSTEER_CPU_KERNELS=0"
    elif jax.default_backend() != "cpu":
        _reason = f"backend is {jax.default_backend()}, not cpu"
    elif not _cpu_has_avx512f():
        _reason = "this CPU has no AVX-512F"
    else:
        try:
            lib = ctypes.CDLL(str(_build()))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JsteerSmallGemm), platform="cpu")
            return True
        except (RuntimeError, OSError) as e:
            _reason = f"could not build the kernel: {e}"
    return False


def unavailable_reason() -> Optional[str]:
    """Why ``available()`` is False (None when it is True or was not asked yet)."""
    return _reason


def pack(w: Array) -> Array:
    """w [K, N] -> panels [ceil(N/48), K, 48] (N zero-padded to a multiple of 48), fp32."""
    if w.ndim != 2:
        raise ValueError(f"pack: want a [K, N] matrix, got shape {w.shape}")
    k, n = w.shape
    panels = -(-n // PANEL)
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, panels * PANEL - n)))
    return w.reshape(k, panels, PANEL).transpose(1, 0, 2)


def small_gemm(x: Array, wp: Array, n: int) -> Array:
    """x [M, K] @ (the [K, n] matrix packed in wp) -> [M, n] fp32. Call only when available()."""
    m, k = x.shape
    if wp.shape != (-(-n // PANEL), k, PANEL):
        raise ValueError(f"small_gemm: packed weight {wp.shape} does not fit x {x.shape} and n={n}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), wp)
