"""One progress bar for every long job (hidden-state caching, steer training, probing, graph
building, evaluation, the Trainer), so that all bars look the same: description, count / total,
rate and ETA, on stderr.

    from jsteer import progress

    with progress.bar(total=n, desc="cache", unit="text") as bar:
        for batch in batches:
            ...
            bar.update(len(batch))

Bars (not summaries) are off when the quiet switch is on: :func:`set_quiet` (the ``jsteer --quiet`` flag), the
:func:`quiet` context manager, or ``JSTEER_QUIET=1`` in the environment. ``enabled=False`` turns
one bar off (e.g. on processes other than 0); a disabled bar takes the same calls and prints
nothing. :func:`summary` prints the one-line end-of-job summary of the CLI's long commands.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
BAR_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"

_QUIET: list[bool] = [False]


def set_quiet(value: bool = True) -> None:
    """Turn every bar (and :func:`summary` line) off, or back on."""
    _QUIET[0] = bool(value)


def is_quiet() -> bool:
    """Whether bars are off: :func:`set_quiet` or ``JSTEER_QUIET`` set to a true value."""
    env = os.environ.get("JSTEER_QUIET", "").strip().lower()
    return _QUIET[0] or env not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def quiet(value: bool = True) -> Iterator[None]:
    """Bars off (or on) inside the block; the previous setting comes back after it."""
    old = _QUIET[0]
    _QUIET[0] = bool(value)
    try:
        yield
    finally:
        _QUIET[0] = old


def bar(
    iterable: Optional[Iterable[T]] = None,
    *,
    total: Optional[int] = None,
    desc: str = "",
    unit: str = "it",
    initial: int = 0,
    enabled: bool = True,
    file=None,
    leave: bool = True,
):
    """A tqdm bar in the project's one look (``desc: pct|bar| n/total [elapsed<ETA, rate]``).

    Wraps ``iterable`` if given (iterate over the result) or counts by ``update(n)``; use it as
    a context manager (or call ``close()``). Disabled, it prints nothing, whatever the calls.
    ``file`` defaults to the current ``sys.stderr``; tqdm's own default (no bar when ``file``
    is not a terminal) is not applied, so logs of a redirected run show it too; quiet it with
    ``--quiet`` / ``JSTEER_QUIET=1``.
    """
    from tqdm import tqdm

    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        initial=initial,
        disable=not enabled or is_quiet(),
        file=file if file is not None else sys.stderr,
        leave=leave,
        dynamic_ncols=True,
        mininterval=0.5,
        bar_format=BAR_FORMAT if total is not None else BAR_FORMAT_NO_TOTAL,
    )


def callback(b) -> "callable":
    """A ``progress(done, total)`` callback that moves ``b`` to ``done`` of ``total``."""

    def update(done: int, total: int) -> None:
        if b.total != total:
            b.total = total
        b.update(done - b.n)

    return update


def summary(command: str, what: str, seconds: float, out=None, **metrics) -> str:
    """Print (to stderr, also when quiet: only bars are silenced; stdout keeps the command's
    results, e.g. JSON lines) and return the one-line end-of-job summary
    ``jsteer <command>: <what>; <metric> <value>, ...; <seconds>s; -> <out>``."""
    parts = [f"jsteer {command}: {what}"]
    shown = []
    for k, v in metrics.items():
        if v is None:
            continue
        shown.append(f"{k.replace('_', ' ')} {v:.4g}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}")
    if shown:
        parts.append(", ".join(shown))
    parts.append(f"{seconds:.1f}s")
    if out is not None:
        parts.append(f"-> {out}")
    line = "; ".join(parts)
    print(line, file=sys.stderr, flush=True)
    return line
