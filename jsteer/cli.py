"""The `jsteer` command. Core verbs live here; each method package adds its own group
through a ``register(subparsers)`` function in ``jsteer/<method>/cli.py``."""

from __future__ import annotations

import argparse
import importlib
import sys

METHOD_GROUPS = ("steer", "typevec", "kala", "kalm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jsteer", description=__doc__)
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
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        print(f"jsteer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
