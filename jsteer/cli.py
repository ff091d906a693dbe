"""The `jsteer` command. Core verbs live here; each method package adds its own group
through a ``register(subparsers)`` function in ``jsteer/<method>/cli.py``, with the pieces the
groups share: :func:`method_group`, :func:`load_decoder`, the ``generate`` options
(:func:`add_generate_options`, :func:`print_generations`) and :func:`warning_lines`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
import warnings

METHOD_GROUPS = ("steer", "actsteer", "typevec", "kala", "kalm")
DESCRIPTION = """Knowledge-aware and steerable language models (JAX / Flax): LM-Steer, activation steering,
Type Embeddings, KALA and KALM on a model's own layer loop.

  jsteer doctor                                 what this machine runs on
  jsteer info smollm2-135m                      a model's config, tokenizer and provenance
  jsteer generate smollm2-135m "The movie was"  continue a prompt
  jsteer steer train --model smollm2-135m --data ../shared/data/sst5/train.jsonl --out steers/sentiment
  jsteer steer generate --model smollm2-135m --steer steers/sentiment --value 5 "The movie was"

A model is an embedded name (smollm2-135m, minilm), an HF folder, a hub id in the local HF cache,
a GGUF file or a jsteer checkpoint. `jsteer COMMAND --help` shows each command's options."""
QUIET_HELP = "no progress bars (as JSTEER_QUIET=1); results and the end-of-job summary lines still print"


def build_parser() -> argparse.ArgumentParser:
    import jsteer

    parser = argparse.ArgumentParser(
        prog="jsteer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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


def method_group(subparsers, name: str, help: str, description: str):
    """``jsteer <name>``: a method's command group (``description``: its CLI module's docstring,
    shown through :func:`plain`) -> the subparsers of its subcommands (chosen one in
    ``args.<name>_command``)."""
    top = subparsers.add_parser(
        name, help=help, description=plain(description), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return top.add_subparsers(dest=f"{name}_command", required=True)


def plain(doc: str) -> str:
    """A module docstring as terminal help: Sphinx roles (``:func:``, ``:mod:``, ...) dropped and
    double backquotes made single."""
    return re.sub(r":(?:mod|func|class|meth|attr|data):`", "`", doc).replace("``", "`")


def load_decoder(src: str, method: str):
    """``jsteer.load(src)``, refused (naming ``method``) unless it is a decoder."""
    import jsteer

    lm = jsteer.load(src)
    if not lm.is_decoder:
        raise ValueError(f"{src}: {method} needs a decoder model, got family {lm.family!r}")
    return lm


def add_generate_options(p, *, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0) -> None:
    """A method's ``generate`` options (its defaults as given): --max-new-tokens, --temperature,
    --top-p, --top-k, --samples per prompt, --seed and --json, read by :func:`print_generations`."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=top_p)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON lines")


def add_data_dirs(p, prepared: str, tfds: bool = True) -> None:
    """``--data-dir``: the cache where ``prepared`` (the raw files a command reads) go through the
    TFDS layer; with ``tfds`` also ``--tfds-data-dir``, where ``--tfds`` data sets are."""
    p.add_argument(
        "--data-dir",
        default=None,
        help=f"cache where {prepared} prepared as TFDS array_record data sets, once per content "
        "(default: $JSTEER_DATA_DIR or ~/.cache/jsteer/tfds)",
    )
    if tfds:
        p.add_argument(
            "--tfds-data-dir",
            default=None,
            help="where --tfds data sets are (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)",
        )


def print_generations(lm, args, hooks) -> int:
    """Continues ``args.prompts`` (each ``args.samples`` times) with ``hooks`` and the options of
    :func:`add_generate_options`; prints prompt + continuation (or a JSON line) for each."""
    prompts = [p for p in args.prompts for _ in range(args.samples)]
    outs = lm.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        hooks=hooks,
    )
    for p, o in zip(prompts, outs):
        print(json.dumps({"prompt": p, "continuation": o}) if args.json else f"{p}{o}")
    return 0


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
