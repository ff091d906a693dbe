"""CPU kernels for a decode step's two hot spots and for attention, reached from jitted JAX code through XLA FFI.

Few-row matmuls. A decode step multiplies B rows (one token per sequence) by every weight matrix,
so its time is the time to read the weights. For 2 <= B <= 64, XLA:CPU's dot reads them at about
half the memory bandwidth (2-12 rows; 16-64 rows gain less, see BUILD.md), and for one row its
GEMV pays a fixed cost per product; ``small_gemm`` reads each weight once, contiguously, from a
packed copy (``pack``: [K, N] -> column panels [ceil(N/48), K, 48]) and keeps the output in registers.
Many rows (prefills, ``LM.forward``): the same kernel, rows in blocks that fit in L2, summing k in
slices as Eigen does (as accurate: tests/test_gguf.py's fp64 comparison), beats XLA:CPU's fp32 dot
there on AMD's AVX-512 (Zen 5) only; elsewhere (Intel's AVX-512; AVX2 + FMA, where the kernel holds
6 rows x 16 columns in registers) it wins at few rows only, and products past ``kernel_rows()``
rows stay XLA's (BUILD.md: AVX2; Intel AVX-512).

    wp = pack(w)                        # once per weight, outside the decode loop
    y = small_gemm(x, wp, n=w.shape[1])  # x [M, K] -> y [M, N] == x @ w (fp32)
    y = packed_matmul(x, w, wp)          # the same, differentiable as x @ w
    y = packed_affine(x, w, wp, b)       # x @ w + b [N] in one pass, differentiable

Attention of one new token over the KV cache. XLA:CPU runs its two batched products as many tiny
dots (M = G queries per key/value head); ``decode_attention`` makes one pass per (row, key/value
head) over the visible slots: scores, softmax and value product.

    out = decode_attention(q, k, v, visible, bias, scale, softcap)
    # q [B,K,G,H], cache k [B,K,H,S] / v [B,K,S,H], visible / bias [B,S] -> [B,K,G,H] (fp32)

Attention of many queries (forwards, prefills). XLA:CPU transposes q, k and v to put the heads in
front, runs the two products at ~100 GFLOP/s on 2 Xeon cores and passes over the score tensor in
memory; ``block_attention`` reads q, k and v where they lie (separate projections, BERT's fused
[B,T,3,N,H] one, or the cache), one task per (row, key/value head, block of queries), scoring only
the keys between the block's first and last visible one (a causal block skips what follows it, a
prefill the cache's empty slots). MiniLM B32xT128: ~14 -> ~8 ms a layer; SmolLM2's 1000-token
prefill: 52 -> 6 ms a layer.

    out = block_attention(q, k, v, visible, bias, scale, softcap, cache_layout)
    # q [B,T,K,G,H], k / v [B,S,K,H] (or the cache's), visible / bias [B,T|1,S] -> [B,T,K,G,H] (fp32)

``materialize(x)`` is a copy XLA cannot fuse through: the decoder's RoPE tables, computed once on
the kernel path instead of inside every layer's rotation (SmolLM2 B8xT128 forward ~1.21 -> ~1.05 s).

All of them live in ``decode_kernels.cc`` (and the ``block_attention.h`` it includes), compiled at
first use (g++ -O3 -march=native, about 3 s) into ``cache_dir()`` ($JSTEER_CACHE/kernels,
~/.cache/jsteer/kernels, or when that is not writable a 0700 folder ``jsteer-kernels-<uid>`` in the
temp directory), with its sha256 recorded beside it in ``<name>.so.sha256``, and registered with XLA
as the custom calls in ``TARGETS``. A cached library is loaded only from a folder this user owns
that group and others cannot write, and only if its sha256 matches the record (otherwise it is
rebuilt). ``available()`` is False, and callers keep XLA's ops, when the backend is not CPU, the CPU
has neither AVX-512F nor AVX2 with FMA, no C++ compiler is found, the cache folder is refused, or
``JSTEER_CPU_KERNELS=0``; the reason is in ``unavailable_reason()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import secrets
import shutil
import stat
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

Array = jax.Array

PANEL = 48  # columns per packed panel (small_gemm.cc: kPanel)
MIN_ROWS, MAX_ROWS = 1, 64  # batch rows for which generate packs by default (BUILD.md: the CPU decode kernel)
TARGET = "jsteer_small_gemm"
ATTENTION_TARGET = "jsteer_decode_attention"
BLOCK_TARGET = "jsteer_block_attention"
BLOCK_GRAD_TARGET = "jsteer_block_attention_grad"
MATERIALIZE_TARGET = "jsteer_materialize"
NORM_TARGET = "jsteer_layer_norm"
NORM_GRAD_TARGET = "jsteer_layer_norm_grad"
TARGETS = {  # custom call -> symbol
    TARGET: "JsteerSmallGemm",
    ATTENTION_TARGET: "JsteerDecodeAttention",
    BLOCK_TARGET: "JsteerBlockAttention",
    BLOCK_GRAD_TARGET: "JsteerBlockAttentionGrad",
    MATERIALIZE_TARGET: "JsteerMaterialize",
    NORM_TARGET: "JsteerLayerNorm",
    NORM_GRAD_TARGET: "JsteerLayerNormGrad",
}
DECODER_TARGETS = (TARGET, ATTENTION_TARGET, BLOCK_TARGET, MATERIALIZE_TARGET)  # a packed decoder's generate
_SOURCE = pathlib.Path(__file__).with_name("decode_kernels.cc")
_reason: Optional[str] = None
# XLA keeps a registered handler for the process and refuses the same name from another library file
# ("Duplicate FFI handler registration ... different bundle addresses"): a concurrent build (another
# process, another pytest worker) may have replaced the file since, and the first library stays mapped
_registered: set[str] = set()


class UnsafeCacheError(RuntimeError):
    """The kernel cache folder could be written by another user: nothing in it is built or loaded."""


def cache_dir() -> pathlib.Path:
    """Where built kernels live: $JSTEER_CACHE/kernels, else ~/.cache/jsteer/kernels, else (not
    writable) a per-user folder in the temp directory, created with mode 0700. Raises
    UnsafeCacheError when the folder is not owned by this user or is writable by group or others."""
    path, fd = _open_cache_dir()
    os.close(fd)
    return path


def _open_cache_dir() -> tuple[pathlib.Path, int]:
    """cache_dir() and an open descriptor of that folder, checked on the descriptor: every later
    access goes through it, so renaming a folder on the way there afterwards changes nothing."""
    root = os.environ.get("JSTEER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jsteer")
    path = pathlib.Path(root) / "kernels"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError:
        writable = False
    if writable:
        return path, _open_private_dir(path, follow_link=True)  # the user's own path: a link may be on purpose
    # a name anyone can predict in a world-writable folder: another user may have made it (or a link) first
    path = pathlib.Path(tempfile.gettempdir()) / f"jsteer-kernels-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return path, _open_private_dir(path, follow_link=False)


def _open_private_dir(path: pathlib.Path, follow_link: bool) -> int:
    """An O_DIRECTORY descriptor of path if this user owns it and group / others cannot write it."""
    if not follow_link and path.is_symlink():
        raise UnsafeCacheError(f"refusing the kernel cache folder {path}: it is a symbolic link")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow_link else os.O_NOFOLLOW))
    st = os.fstat(fd)
    problem = None
    if st.st_uid != os.geteuid():
        problem = f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    if problem:
        os.close(fd)
        raise UnsafeCacheError(
            f"refusing the kernel cache folder {path}: {problem}; "
            "chmod 700 it, or point JSTEER_CACHE to a private folder"
        )
    return fd


def _cpu_flags() -> str:
    """This CPU's feature flags (the first 'flags' line of /proc/cpuinfo), '' if unknown."""
    try:
        return next(
            (line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        return ""


_SIMD = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16")


def describe() -> dict:
    """{"model": /proc/cpuinfo's model name, "family": its vendor, family and model numbers (a VM's
    "AMD EPYC" names no generation: family 25 is Zen 3/4, 26 Zen 5), "simd": the vector-ISA flags
    among :data:`_SIMD` it has, "dots": which fp32 dots XLA:CPU runs (``jsteer.cpu_precision.STATE``),
    "malloc": whether XLA's per-call buffers stay mapped (``jsteer.cpu_malloc.STATE``), "hugepages":
    whether glibc's large blocks get huge pages (``jsteer.cpu_malloc.HUGEPAGES``), "kernel_rows": the
    most rows a product takes through the kernel (:func:`kernel_rows`; None: any)}: what benchmark
    JSON records of the CPU (ratios to torch move with the ISA, the dots and the page faults)."""
    from jsteer import cpu_malloc, cpu_precision

    field = _cpuinfo()
    model = field.get("model name", "unknown")
    flags = set(_cpu_flags().split(":", 1)[-1].split())
    simd = [f for f in _SIMD if f in flags]
    return {
        "model": model,
        "family": "{} family {} model {}".format(*(field.get(k, "?") for k in ("vendor_id", "cpu family", "model"))),
        "simd": simd,
        "dots": cpu_precision.STATE,
        "malloc": cpu_malloc.STATE,
        "hugepages": cpu_malloc.HUGEPAGES,
        "kernel_rows": kernel_rows(),
    }


def _cpuinfo() -> dict:
    """The first processor's /proc/cpuinfo fields ({} if unreadable)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        info = []
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info[:30]) if v}


NO_VECTOR_ISA = "this CPU has neither AVX-512F nor AVX2 with FMA"


def _cpu_has_avx512f() -> bool:
    return " avx512f" in _cpu_flags()


def _cpu_has_vector_isa() -> bool:
    """AVX-512F, or AVX2 with FMA: what decode_kernels.cc builds for (simd.h)."""
    flags = set(_cpu_flags().split(":", 1)[-1].split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def _recipe() -> tuple[str, list[str], str]:
    """(compiler, flags, file name) of this machine's build: the name is keyed by source, jax, compiler,
    flags and CPU features."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++) on PATH")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{include}"]
    # -march=native: a build is only valid on CPUs with the same features (a shared home directory)
    headers = b"".join(p.read_bytes() for p in sorted(_SOURCE.parent.glob("*.h")))  # what the source includes
    key = hashlib.sha256(
        _SOURCE.read_bytes() + headers + " ".join([cxx, include, jax.__version__, *flags, _cpu_flags()]).encode()
    )
    return cxx, flags, f"decode_kernels-{key.hexdigest()[:16]}.so"


def _own_private_file(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _verified(dir_fd: int, name: str) -> bool:
    """Whether dir_fd/name is a file of this user's whose sha256 is the one recorded in name.sha256
    when it was built (neither followed if a link)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            if not _own_private_file(fd):
                return False
            digest = hashlib.sha256(f.read()).hexdigest()
        fd = os.open(name + ".sha256", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as f:
            return _own_private_file(fd) and f.read(100).decode("ascii", "replace").strip() == digest
    except OSError:  # missing, a link, not a file: not verified
        return False


def _compile(cxx: str, flags: list[str]) -> bytes:
    # in a fresh private folder (mkdtemp: 0700, unpredictable name): no one else can touch the output
    with tempfile.TemporaryDirectory(prefix="jsteer-build-") as tmp:
        out = os.path.join(tmp, "kernel.so")
        proc = subprocess.run([cxx, *flags, str(_SOURCE), "-o", out], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{proc.stderr[-2000:]}")
        return pathlib.Path(out).read_bytes()


def _write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _build_in(dir_fd: int, path: pathlib.Path) -> str:
    """Build into the cache folder (path, open as dir_fd) unless a verified build is there; the library,
    then its sha256 record, each written to a temp file and renamed into place. Returns the file name."""
    cxx, flags, name = _recipe()
    if _verified(dir_fd, name):
        return name
    data = _compile(cxx, flags)
    # concurrent builds of the same key write the same bytes (g++ output is deterministic), so the
    # library and the record agree whichever rename lands last; were they to differ, the next load rebuilds
    _write_atomic(dir_fd, name, data)
    _write_atomic(dir_fd, name + ".sha256", (hashlib.sha256(data).hexdigest() + "\n").encode())
    if not _verified(dir_fd, name):
        raise RuntimeError(f"{path / name} does not match its recorded sha256 right after it was built")
    return name


def _build() -> pathlib.Path:
    """Compile decode_kernels.cc once per (source, jax, compiler, flags, CPU features) into cache_dir(), with
    its sha256 beside it in <name>.so.sha256; a library there whose hash does not match is rebuilt."""
    path, dir_fd = _open_cache_dir()
    try:
        return path / _build_in(dir_fd, path)
    finally:
        os.close(dir_fd)


def _load() -> ctypes.CDLL:
    """_build(), then load the library, only once verified (private folder, this user's file, recorded hash)."""
    path, dir_fd = _open_cache_dir()
    try:
        name = _build_in(dir_fd, path)
        # through the checked folder's descriptor: the same folder whatever happened to its path since
        return ctypes.CDLL(f"/proc/self/fd/{dir_fd}/{name}")
    finally:
        os.close(dir_fd)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the kernels can run here (see the module docstring); builds and registers once."""
    global _reason
    if os.environ.get("JSTEER_CPU_KERNELS", "1") == "0":
        _reason = "disabled by JSTEER_CPU_KERNELS=0"
    elif jax.default_backend() != "cpu":
        _reason = f"backend is {jax.default_backend()}, not cpu"
    elif not _cpu_has_vector_isa():
        _reason = NO_VECTOR_ISA
    else:
        try:
            lib = _load()  # every time asked: the cache folder's checks
            for target, symbol in TARGETS.items():
                if target not in _registered:
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    _registered.add(target)
            _reason = None
            return True
        except UnsafeCacheError as e:
            _reason = str(e)
        except (RuntimeError, OSError) as e:
            _reason = f"could not build the kernel: {e}"
    return False


def _ffi_call(target: str, *args, **kwargs):
    """jax.ffi.ffi_call of one of TARGETS, registered first: a program that reaches a kernel without
    anyone having asked available() (a packed param tree in a fresh process) would otherwise fail in
    XLA with "No FFI handler registered"."""
    if not available():
        raise RuntimeError(f"{target}: jsteer's CPU kernels are not available here ({unavailable_reason()})")
    return jax.ffi.ffi_call(target, *args, **kwargs)


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


def small_gemm(x: Array, wp: Array, n: int, bias: Optional[Array] = None) -> Array:
    """x [M, K] @ (the [K, n] matrix packed in wp) (+ bias [n], added after the sum over k) -> [M, n]
    fp32. Call only when available()."""
    m, k = x.shape
    if wp.shape != (-(-n // PANEL), k, PANEL):
        raise ValueError(f"small_gemm: packed weight {wp.shape} does not fit x {x.shape} and n={n}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"small_gemm: bias {bias.shape} does not fit n={n}")
    b = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    call = _ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), wp, b)


ROWS_ENV = "JSTEER_CPU_KERNEL_ROWS"


@functools.lru_cache(maxsize=None)
def _many_rows_win() -> bool:
    """Whether the kernel's many-row blocks were measured faster than XLA:CPU's dot on this CPU type:
    AMD with AVX-512 (Zen 5, session 49: SmolLM2's forward at 0.72x the XLA products floor). Not on
    AVX2 (Zen 3: 49-76 against XLA's 118-127 GFLOP/s on SmolLM2's FFN shapes at 1024 rows) nor on
    Intel's AVX-512 (Ice Lake-SP, session 53: 72-115 against 200-254 GFLOP/s at 1024 rows; the forward
    3.1 s through the kernel, 1.8 s with those products on XLA), where only few-row products win.
    Zen 4 and the later Xeons are unmeasured since the kernel's k slices shrank (session 49; BUILD.md)."""
    return _cpu_has_avx512f() and _cpuinfo().get("vendor_id") == "AuthenticAMD"


def kernel_rows() -> Optional[int]:
    """The most rows :func:`packed_matmul` multiplies through the kernel (None: any): None where its
    many-row blocks beat XLA:CPU's dot on this CPU type (:func:`_many_rows_win`), else MAX_ROWS (decode
    steps only). ``$JSTEER_CPU_KERNEL_ROWS`` (a positive integer, or ``any``) overrides it."""
    env = os.environ.get(ROWS_ENV, "").strip()
    if env:
        if env == "any":
            return None
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"${ROWS_ENV}={env!r}: give a positive number of rows, or 'any'")
        return int(env)
    return None if _many_rows_win() else MAX_ROWS


def _xla_rows(x: Array) -> bool:
    limit = kernel_rows()
    return limit is not None and x.shape[0] > limit


@jax.custom_jvp
def packed_matmul(x: Array, w: Array, wp: Array) -> Array:
    """x [M, K] @ w [K, N] -> [M, N] fp32 through :func:`small_gemm` from ``wp = pack(w)``, any M
    (past :func:`kernel_rows`, XLA's product of x and w). Differentiable (forward and reverse mode)
    as the product of x and w: its tangent is XLA's product, and wp (a copy of w) gets none. Call
    only when available()."""
    if _xla_rows(x):
        return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32))
    return small_gemm(x, wp, w.shape[1])


@jax.custom_jvp
def packed_affine(x: Array, w: Array, wp: Array, b: Array) -> Array:
    """``packed_matmul(x, w, wp) + b`` (b [N]) in one pass: the kernel adds b as it writes the sums,
    so the result is bit-identical to the two steps. Differentiable as x @ w + b."""
    if _xla_rows(x):
        return packed_matmul(x, w, wp) + b.astype(jnp.float32)
    return small_gemm(x, wp, w.shape[1], b)


def _product_tangents(x: Array, w: Array, dx, dw) -> list:
    parts = []
    if not isinstance(dx, SymbolicZero):
        parts.append(jnp.matmul(dx.astype(jnp.float32), w.astype(jnp.float32)))
    if not isinstance(dw, SymbolicZero):
        parts.append(jnp.matmul(x.astype(jnp.float32), dw.astype(jnp.float32)))
    return parts


def _sum_tangents(parts: list, out: Array) -> Array:
    return functools.reduce(lambda a, b: a + b, parts) if parts else jnp.zeros_like(out)


def _packed_matmul_jvp(primals, tangents):
    x, w, wp = primals
    dx, dw, _ = tangents
    out = packed_matmul(x, w, wp)
    return out, _sum_tangents(_product_tangents(x, w, dx, dw), out)


def _packed_affine_jvp(primals, tangents):
    x, w, wp, b = primals
    dx, dw, _, db = tangents
    out = packed_affine(x, w, wp, b)
    parts = _product_tangents(x, w, dx, dw)
    if not isinstance(db, SymbolicZero):
        from jsteer.backbones.matmul import bias_tangent  # matmul imports this module

        parts.append(bias_tangent(db.astype(jnp.float32), x.shape[0], jnp.float32))
    return out, _sum_tangents(parts, out)


packed_matmul.defjvp(_packed_matmul_jvp, symbolic_zeros=True)
packed_affine.defjvp(_packed_affine_jvp, symbolic_zeros=True)


def decode_attention(
    q: Array, k: Array, v: Array, visible: Array, bias: Optional[Array], scale, softcap: Optional[float]
) -> Array:
    """One query token per row against the KV cache -> [B,K,G,H] fp32; call only when available().

    q [B,K,G,H] (K key/value heads, G queries each), k [B,K,H,S] and v [B,K,S,H] (the cache's
    layout), visible [B,S] bool, bias [B,S] additive or None, scale a scalar (may be traced),
    softcap a float or None. The function of ``attention.dot_product_attention`` at T = 1:
    softmax(cap(scale q.k) + bias, masked to visible) v."""
    b, kh, g, h = q.shape
    s = v.shape[2]
    if k.shape != (b, kh, h, s) or v.shape != (b, kh, s, h) or visible.shape != (b, s):
        raise ValueError(
            f"decode_attention: q {q.shape} needs k [B,K,H,S], v [B,K,S,H], visible [B,S]; "
            f"got {k.shape}, {v.shape}, {visible.shape}"
        )
    bias = jnp.zeros((b, s), jnp.float32) if bias is None else bias.astype(jnp.float32)
    if bias.shape != (b, s):
        raise ValueError(f"decode_attention: bias {bias.shape} must be [B,S] = {(b, s)}")
    # One row: the heads alone, so that the operands are the cache's own batch-free buffers, which
    # the step updated in place (as [1, ...] XLA copied each layer's cache, 8 copies a layer).
    # More rows: as they are (merged into [B*K, ...] XLA copied them instead).
    lead = (kh,) if b == 1 else (b, kh)
    call = _ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(lead + (g, h), jnp.float32))
    f32 = jnp.float32
    out = call(
        q.astype(f32).reshape(lead + (g, h)),
        k.astype(f32).reshape(lead + (h, s)),
        v.astype(f32).reshape(lead + (s, h)),
        visible.astype(bool),
        bias,
        jnp.asarray(scale, f32).reshape(()),
        softcap=np.float32(softcap or 0.0),
    )
    return out.reshape(b, kh, g, h)


def _layout(q: Array, k: Optional[Array], v: Optional[Array], cache_layout: bool, fused: bool):
    """(b, t, kh, g, h, s, strides) of block_attention's operands (see there)."""
    if fused:
        b, t, three, kh, h = q.shape
        g, s = 1, t
        if three != 3:
            raise ValueError(f"block_attention: a fused projection is [B,T,3,K,H], got {q.shape}")
        row = 3 * kh * h
        strides = dict(q_off=0, qb=t * row, qt=row, qn=h, k_off=kh * h, kb=t * row, ks=row, kk=h, kh=1)
        strides.update(v_off=2 * kh * h, vb=t * row, vs=row, vk=h)
    else:
        b, t, kh, g, h = q.shape
        s = v.shape[2 if cache_layout else 1]
        want_v = (b, kh, s, h) if cache_layout else (b, s, kh, h)
        want_k = (b, kh, h, s) if cache_layout else want_v
        if k.shape != want_k or v.shape != want_v:
            raise ValueError(f"block_attention: q {q.shape} needs k {want_k} and v {want_v}, got {k.shape}, {v.shape}")
        strides = dict(q_off=0, qb=t * kh * g * h, qt=kh * g * h, qn=h, k_off=0, v_off=0)
        if cache_layout:
            strides.update(kb=kh * h * s, ks=1, kk=h * s, kh=s, vb=kh * s * h, vs=h, vk=s * h)
        else:
            strides.update(kb=s * kh * h, ks=kh * h, kk=h, kh=1, vb=s * kh * h, vs=kh * h, vk=h)
    if h % 16:
        raise ValueError(f"block_attention: head size {h} is not a multiple of 16")
    return b, t, kh, g, h, s, strides


def _attention_args(q, k, v, visible, bias, scale, dropout, b, t, s, kh, strides) -> tuple[tuple, dict]:
    """The operands and attributes block_attention's two targets share."""
    f32 = jnp.float32
    for name, m in (("visible", visible), ("bias", bias)):
        if m is not None and (m.ndim != 3 or m.shape[0] != b or m.shape[1] not in (1, t) or m.shape[2] != s):
            raise ValueError(f"block_attention: {name} {m.shape} must be [{b}, 1|{t}, {s}]")
    if dropout is None:
        seed, threshold, inv_keep = jnp.zeros((0,), jnp.uint32), 0, 1.0
    else:
        from jsteer.backbones.dropout import threshold as keep_threshold

        seed, rate = dropout
        seed, threshold, inv_keep = jnp.asarray(seed, jnp.uint32).reshape(2), keep_threshold(rate), 1.0 / (1.0 - rate)
    operands = (
        q.astype(f32),
        (q if k is None else k).astype(f32),
        (q if v is None else v).astype(f32),
        visible.astype(bool),
        jnp.zeros((0,), f32) if bias is None else bias.astype(f32),
        jnp.asarray(scale, f32).reshape(()),
        seed,
    )
    attrs = dict(
        s=np.int64(s),
        kv=np.int64(kh),
        vis_t=np.int64(visible.shape[1]),
        bias_t=np.int64(0 if bias is None else bias.shape[1]),
        threshold=np.int64(threshold),
        inv_keep=np.float32(inv_keep),
        **{name: np.int64(x) for name, x in strides.items()},
    )
    return operands, attrs


def block_attention(
    q: Array,
    k: Array,
    v: Array,
    visible: Array,
    bias: Optional[Array],
    scale,
    softcap: Optional[float],
    cache_layout: bool = False,
    fused: bool = False,
    dropout: Optional[tuple] = None,
) -> Array:
    """Attention of T queries per row -> [B,T,K,G,H] fp32; call only when available(). Not differentiable
    by itself (``attention.attention`` gives it derivatives, :func:`block_attention_grad` its reverse mode).

    q [B,T,K,G,H] (K key/value heads, G queries each), k and v [B,S,K,H], or with ``cache_layout`` the
    cache's k [B,K,H,S] / v [B,K,S,H]; ``fused``: q, k and v are one [B,T,3,K,H] projection (G = 1),
    passed as q (k and v ignored), read in place. visible [B, T|1, S] bool, bias [B, T|1, S] additive or
    None, scale a scalar (may be traced), softcap a float or None, ``dropout`` None or (seed uint32 [2],
    rate): probability dropout by :class:`jsteer.backbones.dropout.HashDropout`'s mask over the weights'
    [B,K,G*T,S] layout. The function of ``attention.dot_product_attention`` (see block_attention.h)."""
    b, t, kh, g, h, s, strides = _layout(q, k, v, cache_layout, fused)
    operands, attrs = _attention_args(
        q, None if fused else k, None if fused else v, visible, bias, scale, dropout, b, t, s, kh, strides
    )
    call = _ffi_call(BLOCK_TARGET, jax.ShapeDtypeStruct((b, t, kh * g, h), jnp.float32), vmap_method="sequential")
    return call(*operands, softcap=np.float32(softcap or 0.0), **attrs).reshape(b, t, kh, g, h)


def block_attention_grad(
    q: Array,
    k: Optional[Array],
    v: Optional[Array],
    visible: Array,
    bias: Optional[Array],
    scale,
    dout: Array,
    out: Array,
    fused: bool = False,
    dropout: Optional[tuple] = None,
):
    """Reverse mode of :func:`block_attention` (no soft-capping, no cache layout; same other arguments):
    dout, out [B,T,K,G,H] (the cotangent and the forward's output) -> (dq, dk, dv) fp32 in q's, k's and
    v's shapes, or with ``fused`` the [B,T,3,K,H] projection's gradient. Call only when available()."""
    b, t, kh, g, h, s, strides = _layout(q, k, v, False, fused)
    operands, attrs = _attention_args(
        q, None if fused else k, None if fused else v, visible, bias, scale, dropout, b, t, s, kh, strides
    )
    n = kh * g
    if fused:
        offsets, size = (strides["q_off"], strides["k_off"], strides["v_off"]), q.size
    else:
        offsets, size = (0, q.size, q.size + k.size), q.size + k.size + v.size
    call = _ffi_call(BLOCK_GRAD_TARGET, jax.ShapeDtypeStruct((size,), jnp.float32), vmap_method="sequential")
    grads = call(
        *operands,
        dout.astype(jnp.float32).reshape(b, t, n, h),
        out.astype(jnp.float32).reshape(b, t, n, h),
        gq_off=np.int64(offsets[0]),
        gk_off=np.int64(offsets[1]),
        gv_off=np.int64(offsets[2]),
        **attrs,
    )
    if fused:
        return grads.reshape(q.shape)
    return (
        grads[: q.size].reshape(q.shape),
        grads[q.size : q.size + k.size].reshape(k.shape),
        grads[q.size + k.size :].reshape(v.shape),
    )


NORM_ROWS = 64  # layer_norm.h: kNormRows


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm of x [M, D] (D a multiple of 16) over D, fp32, mean and variance in two passes (see
    layer_norm.h). Not differentiable by itself; call only when available()."""
    call = _ffi_call(NORM_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), scale.astype(jnp.float32), bias.astype(jnp.float32), eps=np.float32(eps))


def layer_norm_grad(x: Array, scale: Array, dy: Array, eps: float) -> tuple[Array, Array, Array]:
    """Reverse mode of :func:`layer_norm`: (dx [M, D], dscale [D], dbias [D]); the column sums are added
    up per 64-row block in block order (the same whatever the thread count)."""
    m, d = x.shape
    shapes = (jax.ShapeDtypeStruct((m, d), jnp.float32), jax.ShapeDtypeStruct((-(-m // NORM_ROWS), 2, d), jnp.float32))
    call = _ffi_call(NORM_GRAD_TARGET, shapes, vmap_method="sequential")
    dx, parts = call(x.astype(jnp.float32), scale.astype(jnp.float32), dy.astype(jnp.float32), eps=np.float32(eps))
    sums = parts.sum(0)
    return dx, sums[0], sums[1]


@jax.custom_jvp
def materialize(x: Array) -> Array:
    """x, computed once: a copy XLA cannot fuse through, so what produced x is not fused into (and
    recomputed by) each of its consumers (RoPE's cos / sin: once per head otherwise, see BUILD.md).
    Identity for autodiff. Call only when available()."""
    return _ffi_call(MATERIALIZE_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="broadcast_all")(x)


materialize.defjvp(lambda primals, tangents: (materialize(primals[0]), tangents[0]))
