"""The `jsteer` command. Core verbs live here; each method package adds its own group
through a ``register(subparsers)`` function in ``jsteer/<method>/cli.py``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings

METHOD_GROUPS = ("steer", "actsteer", "typevec", "kala", "kalm")
QUIET_HELP = "no progress bars (as JSTEER_QUIET=1); results and the end-of-job summary lines still print"


def build_parser() -> argparse.ArgumentParser:
    import jsteer

    parser = argparse.ArgumentParser(prog="jsteer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"jsteer {jsteer.__version__}")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help=QUIET_HELP,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from jsteer import core_cli

    core_cli.register(sub)
    for group in METHOD_GROUPS:
        try:
            mod = importlib.import_module(f"jsteer.{group}.cli")
        except ModuleNotFoundError as e:
            if e.name != f"jsteer.{group}.cli":
                raise
            continue
        mod.register(sub)
    _quiet_anywhere(parser)
    return parser


def _quiet_anywhere(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` also after the command (``jsteer kala train ... --quiet``): every sub-parser
    takes it with a SUPPRESS default, so an absent flag keeps the top-level value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "--quiet" not in child._option_string_actions:
                    child.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET_HELP)
                _quiet_anywhere(child)


@contextlib.contextmanager
def warning_lines(command: str):
    """Warnings raised in the block (or the decorated command function), each printed as it
    comes as one plain stderr line ``jsteer <command>: WARNING: ...`` (not Python's file:line +
    source echo), every occurrence (filter "always")."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"jsteer {command}: WARNING: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():  # restores the filters and warnings.showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield


def main(argv=None) -> int:
    from jsteer import progress

    args = build_parser().parse_args(argv)
    try:
        with progress.quiet() if args.quiet else contextlib.nullcontext():
            return int(args.func(args) or 0)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        from jsteer.checkpoints import REAL_STDERR

        print(f"jsteer {args.command}: error: {e}", file=REAL_STDERR[-1] if REAL_STDERR else sys.stderr)
        return 2


def _exit(code: int) -> None:
    """Exit with ``code``; after a failed checkpoint restore without interpreter finalisation,
    whose abandoned Orbax reads would print tracebacks from their threads as they shut down."""
    from jsteer.checkpoints import ORPHANED_READS, REAL_STDERR

    if ORPHANED_READS:
        for stream in (sys.stdout, sys.stderr, *REAL_STDERR):
            stream.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    """The ``jsteer`` console script: :func:`main`, then exit with its status."""
    from jsteer.checkpoints import CLI_PROCESS

    CLI_PROCESS.append(True)
    _exit(main())


if __name__ == "__main__":
    run()
