"""The run folder of ``jsteer kala train``: one run per folder, resumed only as the same run.

``<out>/run.json`` records what decides the trained numbers: ``config`` (task, method, KALA
and training options, label set or QA windowing, model) and ``data`` (SHA-256 of the training
file, of its mentions file and of the graph's facts), plus ``paths`` for reference (not compared). A new run needs an
empty (or absent) ``--out``; ``--resume`` continues the recorded run and is refused when
anything in ``config`` or ``data`` differs, naming each differing field. One command at a time
uses a folder: ``train`` holds :func:`lock` on it throughout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
from typing import Any, Iterator, Mapping

try:
    import fcntl
except ImportError:  # no flock (Windows): runs go unlocked
    fcntl = None

RECORD = "run.json"
COMPARED = ("config", "data")


@contextlib.contextmanager
def lock(out: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive lock on the run folder ``out`` (created if absent) for the block, so no
    two ``jsteer kala train`` commands use it at once; raises ValueError at once if another holds it.

    The lock is ``flock`` on the folder itself: no file lands in it (a new run still finds it
    empty), and it ends with its process, so a crashed command leaves none behind. Where the file
    system has no ``flock``, the block runs unlocked. When the block raises, the folders created
    here are removed again if they are still empty (a command that failed before writing its run
    record leaves ``out`` as it was)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    created = [p for p in (out, *out.parents) if not p.exists()]  # innermost first
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(
                    f"--out {out} is in use: another jsteer kala train is running in it (it holds "
                    f"the folder's lock); wait for that one to end, or choose another --out"
                ) from None
            # no flock on this file system (e.g. ENOLCK): run unlocked
        yield
    except BaseException:
        for p in created:
            try:
                p.rmdir()
            except OSError:  # not empty: the run started writing there
                break
        raise
    finally:
        os.close(fd)  # releases the lock


def _json(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples -> lists), so records compare equal."""
    return json.loads(json.dumps(obj))


def differences(old: Mapping, new: Mapping) -> list[str]:
    """One line per compared field that differs: ``config.x: recorded X, now Y``, or for a data
    file ``data.x: contents differ (sha256 ... -> ...; file recorded P, now Q)``."""
    out = []
    for section in COMPARED:
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            was, now = a.get(key, "<absent>"), b.get(key, "<absent>")
            if was == now:
                continue
            if section == "data":
                p_was = old.get("paths", {}).get(key, "?")
                p_now = new.get("paths", {}).get(key, "?")
                out.append(
                    f"data.{key}: contents differ (sha256 {str(was)[:12]}... -> {str(now)[:12]}...; "
                    f"file recorded {p_was}, now {p_now})"
                )
            else:
                out.append(f"{section}.{key}: recorded {was!r}, now {now!r}")
    return out


def check_fresh(out: pathlib.Path) -> None:
    """A new run: ``out`` must be absent or an empty folder."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir():
        names = sorted(p.name for p in out.iterdir())
        if names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(
                f"--out {out} is not empty ({shown}); pass --resume to continue the run recorded "
                f"there (same configuration and data), or choose a new --out"
            )


def check_resume(out: pathlib.Path, record: Mapping) -> None:
    """``--resume``: ``out``'s recorded run must match ``record`` (an absent or empty ``out``
    simply starts the run). Raises ValueError naming every differing field."""
    path = out / RECORD
    if not path.is_file():
        if out.is_dir() and any(out.iterdir()):
            raise ValueError(
                f"--resume: {out} holds no {RECORD}, so nothing shows that it is the same run "
                f"(it predates run records, or is no kala train folder); choose a new --out"
            )
        check_fresh(out)  # absent or empty: the run starts here
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if isinstance(old.get("config"), dict):
        old["config"].setdefault("task", "ner")  # records that predate the field are NER runs
    diff = differences(old, _json(record))
    if diff:
        raise ValueError(
            f"--resume: {out} holds a run with a different configuration or data; differing: "
            + "; ".join(diff)
            + ". Resume with the recorded settings, or choose a new --out"
        )


def check(out: pathlib.Path, record: Mapping, resume: bool) -> None:
    """``out`` may take a new run (``resume=False``) or resume the one ``record`` describes."""
    if resume:
        check_resume(out, record)
    else:
        check_fresh(out)


def write(out: pathlib.Path, record: Mapping) -> None:
    """Create ``out`` and write ``record`` as its run.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD).write_text(json.dumps(_json(record), indent=1) + "\n", encoding="utf-8")
