"""Writing and reading jsteer's folders: checkpoints, artifacts, Orbax trees, atomic swaps.

A jsteer checkpoint folder (:func:`save`) holds ``params/`` (the params pytree written by Orbax's
``StandardCheckpointer``: every array as stored, e.g. a decoder's embedding [V, D], its layers
unrolled as ``layers_<i>``) and ``jsteer.json`` (:data:`SIDECAR`: format, family, head, HF-style
config, tokenizer JSON, provenance). Reading one back into an :class:`jsteer.lm.LM` is
:mod:`jsteer.loading`'s. Artifacts (steers, type vectors, control vectors, method heads) are one
portable ``.safetensors`` file with JSON metadata (:func:`save_artifact`, :mod:`jsteer.artifacts`);
artifact folders of earlier versions (``tree/`` + ``jsteer.json``) still load
(:func:`load_orbax_artifact`).

Every write is atomic (:func:`_atomic_write_dir`): the new folder is built beside the target and
swapped in only once complete, so an interrupted save leaves the previous one loadable. A failed
Orbax restore leaves TensorStore reads running whose noise is kept off stderr
(:data:`ORPHANED_READS`, :data:`CLI_PROCESS`, :data:`REAL_STDERR`, read by :mod:`jsteer.cli`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jsteer import artifacts

if TYPE_CHECKING:
    from jsteer.lm import LM

PathLike = str | os.PathLike

SIDECAR = "jsteer.json"
CHECKPOINT_FORMAT = "jsteer.checkpoint/1"
ARTIFACT_FORMAT = "jsteer.artifact/1"
PARAMS_DIR = "params"
TREE_DIR = "tree"


# ----------------------------------------------------------------------------- save


def _jsteer_version() -> str:
    import jsteer

    return jsteer.__version__


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save(lm: LM, path: PathLike) -> pathlib.Path:
    """Write ``lm`` as a jsteer checkpoint folder (atomic; replaces an earlier checkpoint there)."""
    from jsteer.lm import LM

    if not isinstance(lm, LM):
        raise TypeError(f"save expects an LM, got {type(lm).__name__}")
    prov = {k: v for k, v in lm.provenance.items() if k != "checkpoint"}
    if prov.get("sha256_of") == "params":  # derived params: their hash travels with them
        prov["sha256"] = lm.identity.split(":", 1)[1]
    prov.update(dtype=jnp.dtype(lm.dtype).name, jsteer_version=_jsteer_version(), date=_now())
    config_dict = dataclasses.asdict(lm.config)  # jsteer field names, for people reading the sidecar
    meta = {
        "format": CHECKPOINT_FORMAT,
        "family": lm.family,
        "head": lm.head,
        "hf_config": lm.hf_config,
        "config": config_dict,
        "tokenizer": None if lm.tokenizer is None else json.loads(lm.tokenizer.to_json()),
        "provenance": prov,
    }
    params = lm.params
    if getattr(lm.config, "scan_layers", False):  # checkpoints hold the unrolled layout: load either way
        from jsteer.backbones.decoder_params import unstack_layers

        params = unstack_layers(params)

    def write(tmp: pathlib.Path):
        _write_tree(tmp / PARAMS_DIR, params)
        _write_json(tmp / SIDECAR, meta)

    return _atomic_write_dir(pathlib.Path(path), write)


def save_artifact(path: PathLike, tree: Any, meta: Optional[Mapping] = None) -> pathlib.Path:
    """Write a pytree of arrays (dicts / lists of arrays) and JSON metadata as one portable
    ``.safetensors`` file, atomically (:mod:`jsteer.artifacts`)."""
    from jsteer import artifacts

    return artifacts.save(path, tree, meta)


def load_artifact(path: PathLike, target: Any = None) -> tuple[Any, dict]:
    """-> (tree, meta) from a file :func:`save_artifact` wrote, or an older artifact folder
    (Orbax). ``target``: a pytree whose structure (and, for folders, restore types) to give the tree."""
    from jsteer import artifacts

    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        return load_orbax_artifact(path, target)
    if not path.exists():
        raise FileNotFoundError(f"artifact not found: {path}{survivor_hint(path)}")
    tree, meta = artifacts.load(path)
    if target is not None:
        tree = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(tree))
    return tree, meta


def load_orbax_artifact(path: pathlib.Path, target: Any = None) -> tuple[Any, dict]:
    """An artifact folder of the older format (``tree/`` Orbax + ``jsteer.json``)."""
    side = read_sidecar(path, ARTIFACT_FORMAT)
    return restore_tree(path / TREE_DIR, target), side.get("meta", {})


# ----------------------------------------------------------------------------- JSON sidecars and Orbax trees


def read_sidecar(path: pathlib.Path, fmt: str) -> dict:
    f = path / SIDECAR
    if not f.is_file():
        raise FileNotFoundError(f"{path}: not a jsteer folder (missing {SIDECAR}){survivor_hint(path)}")
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{f}: format is {got!r}, expected {fmt!r}")
    return meta


def _write_json(path: pathlib.Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=artifacts.json_default)
        f.flush()
        os.fsync(f.fileno())


def _write_tree(path: pathlib.Path, tree) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path.absolute(), tree)
        ckptr.wait_until_finished()


def _short(e: BaseException) -> str:
    """One line for a user-facing message: the first line of the innermost cause (TensorStore's
    names the damaged array; the outer Orbax errors run to pages of spec). The whole exception
    stays chained as the cause."""
    root = e
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    lines = str(root).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(root).__name__}: {first[:300]}{'...' if len(first) > 300 else ''}"


_ORPHANED_READ = "Encountered error while reading array index"


ORPHANED_READS = []  # set when a restore failed and left Orbax reads running (the CLI then exits hard)
# the CLI process (jsteer.cli.run) sets this: after a failed restore, file descriptor 2 and
# sys.stderr stay on /dev/null (the abandoned reads' threads keep printing tracebacks until
# exit) and REAL_STDERR holds a stream on the real one, for the CLI's one-line error
CLI_PROCESS = []
REAL_STDERR = []


@contextlib.contextmanager
def _stderr_kept_on_success():
    """Capture file descriptor 2 (where TensorStore's threads print) while restoring: replayed
    when the restore succeeds, dropped when it fails (a failed restore's reader threads print
    their TensorStore specs and tracebacks there; the ValueError raised says what went wrong)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (e.g. some notebook kernels): leave it alone
        yield
        return
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            if not ok and CLI_PROCESS:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
                os.close(devnull)
                REAL_STDERR.append(os.fdopen(saved, "w", buffering=1))
                sys.stderr = open(os.devnull, "w")
            else:
                os.dup2(saved, 2)
                os.close(saved)
            if ok:
                buf.seek(0)
                data = buf.read()
                if data:
                    os.write(2, data)
            else:
                ORPHANED_READS.append(True)


def _is_orphaned_read(exc) -> bool:
    return str(exc).startswith(_ORPHANED_READ)


class _OrphanedReadLogFilter(logging.Filter):
    """asyncio's "Task exception was never retrieved" log record of an abandoned Orbax read."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _is_orphaned_read(record.exc_info[1]))


def _quiet_orphaned_reads() -> None:
    """After a failed restore Orbax leaves shard readers pending; when they are finalized (often
    at exit) each prints "Exception ignored in <coroutine>" and the full TensorStore spec, or,
    when its asyncio task is collected, asyncio logs "Task exception was never retrieved" with a
    traceback. Drop exactly those reports; every other unraisable exception reaches the previous
    hook, and every other asyncio record is logged."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadLogFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadLogFilter())
    previous = sys.unraisablehook
    if getattr(previous, "_jsteer_orbax_filter", False):
        return

    def hook(unraisable):
        if _is_orphaned_read(unraisable.exc_value):
            return
        previous(unraisable)

    hook._jsteer_orbax_filter = True
    sys.unraisablehook = hook


def read_tree_metadata(path: pathlib.Path):
    """Shapes / dtypes of an Orbax tree folder (no array is read): a pytree of array metadata.

    Raises FileNotFoundError if the folder is missing and ValueError ``corrupt or incomplete
    checkpoint`` if its metadata cannot be read."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: missing Orbax tree (incomplete checkpoint?)")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(path.absolute()).item_metadata.tree
    except Exception as e:  # Orbax raises many types here (AttributeError when _METADATA is gone)
        raise ValueError(f"{path}: corrupt or incomplete checkpoint: cannot read its metadata ({_short(e)})") from e
    if tree is None:
        raise ValueError(f"{path}: corrupt or incomplete checkpoint: no tree metadata")
    return tree


def restore_tree(path: pathlib.Path, target: Any = None):
    import orbax.checkpoint as ocp

    device = jax.devices()[0]
    given = target is not None
    if not given:
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
            read_tree_metadata(path),
        )
    else:
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: missing Orbax tree (incomplete checkpoint?)")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x), x.dtype, sharding=getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(device)
            ),
            target,
        )
    try:
        with _stderr_kept_on_success(), ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(path.absolute(), target)
    except Exception as e:  # truncated / missing array files surface as TensorStore errors
        _quiet_orphaned_reads()
        what = (
            "corrupt or incomplete checkpoint, or a tree that does not match the target"
            if given
            else "corrupt or incomplete checkpoint"
        )
        raise ValueError(f"{path}: {what}: {_short(e)}") from e
    # without a target, hand back uncommitted arrays (as a load from HF files does): Orbax pins
    # them to device 0, and jit then refuses to mix them with mesh-placed arrays (e.g. freshly
    # trained steer params) on a multi-device host
    return tree if given else jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), tree)


# ----------------------------------------------------------------------------- atomic folders

_RENAME_EXCHANGE = 2


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: filesystem or kernel lacks it
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(dst: pathlib.Path) -> None:
    """Remove temp siblings left by saves whose process died (e.g. killed mid-write)."""
    for p in dst.parent.glob(f".{dst.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def survivor_hint(path: pathlib.Path) -> str:
    olds = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    if olds:
        return f"; an earlier version survives at {olds[-1]} (rename it to {path.name} to use it)"
    return ""


def _atomic_write_dir(dst: PathLike, write: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Build a folder with ``write(tmp)`` beside ``dst``, then swap it into place.

    ``dst`` is replaced only when ``write`` returned and everything is on disk; until then the
    previous folder is untouched. Refuses to replace a non-empty folder that is not a jsteer
    folder (no ``jsteer.json``), to avoid deleting unrelated data by a typo.
    """
    dst = pathlib.Path(dst).expanduser().absolute()
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"{dst} exists and is not a folder")
        if any(dst.iterdir()) and not (dst / SIDECAR).is_file():
            raise FileExistsError(
                f"refusing to overwrite {dst}: it is not empty and not a jsteer folder (no {SIDECAR})"
            )
    dst.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dst)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_dir(tmp)
        if not dst.exists():
            os.rename(tmp, dst)
        elif _exchange(tmp, dst):
            shutil.rmtree(tmp)  # now holds the previous version
        else:  # no atomic exchange: two renames; the old copy survives if we die in between
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


__all__ = [
    "SIDECAR",
    "CHECKPOINT_FORMAT",
    "ARTIFACT_FORMAT",
    "PARAMS_DIR",
    "TREE_DIR",
    "save",
    "save_artifact",
    "load_artifact",
    "load_orbax_artifact",
    "read_tree_metadata",
    "read_sidecar",
    "restore_tree",
    "survivor_hint",
    "clean_stale",
]
