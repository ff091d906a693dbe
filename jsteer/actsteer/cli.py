"""``jsteer actsteer``: train and generate with activation-steering control vectors.

    jsteer actsteer train --model smollm2-135m --positive pos.txt --negative neg.txt --layers 10,12 \\
        --method caa --out cv.safetensors            (or --out cv.gguf: llama.cpp's format)
    jsteer actsteer generate --model smollm2-135m --vector cv.safetensors --strength 4 "The movie was"
    jsteer actsteer generate ... --vector a.safetensors --strength 4 --vector b.gguf --strength -2 "..."

``--positive`` / ``--negative``: one prompt per line (blank lines skipped); line i of each file
makes pair i. ``--vector`` reads ``.gguf`` files (llama.cpp / repeng) by their suffix, anything
else as jsteer's ``.safetensors``; several are composed, each at its own ``--strength``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

from jsteer.cli import add_generate_options, load_decoder, method_group, print_generations


def register(subparsers) -> None:
    from jsteer.actsteer.extract import METHODS

    sub = method_group(subparsers, "actsteer", "activation steering: ActAdd, CAA, PCA control vectors", __doc__)

    p = sub.add_parser("train", help="compute a control vector from positive / negative prompt pairs")
    p.add_argument("--model", required=True, help="decoder: embedded name, HF folder, .gguf or jsteer checkpoint")
    p.add_argument("--positive", required=True, help="text file, one positive prompt per line")
    p.add_argument("--negative", required=True, help="text file, one negative prompt per line (pairs by line)")
    p.add_argument("--layers", required=True, help="comma-separated 0-based layers, e.g. 10,12")
    p.add_argument("--method", choices=METHODS, default="caa")
    p.add_argument(
        "--reduce",
        choices=("last", "mean"),
        default=None,
        help="per-prompt activation: last token or token mean (default: the method's own)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True, help=".safetensors (jsteer) or .gguf (llama.cpp) file to write")
    p.set_defaults(func=_train)

    p = sub.add_parser("generate", help="generate with one or more control vectors at given strengths")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", required=True)
    p.add_argument("--vector", action="append", required=True, help="control-vector file (repeat to compose)")
    p.add_argument(
        "--strength",
        action="append",
        type=float,
        default=None,
        help="strength of each --vector, in the same order (default 1)",
    )
    add_generate_options(p)
    p.set_defaults(func=_generate)


def read_lines(path: str) -> list:
    """Non-blank lines of a UTF-8 text file (stripped of their line ends); an error names the file."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    lines = [x.rstrip("\r\n") for x in p.read_text(encoding="utf-8").splitlines()]
    lines = [x for x in lines if x.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per line)")
    return lines


def parse_layers(s: str) -> list:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers {s!r}: expected comma-separated layer numbers, e.g. 10,12") from None


def load_vector(path: str, lm):
    """A control-vector file (``.gguf``: llama.cpp's; else jsteer's safetensors) checked against ``lm``."""
    from jsteer.actsteer import ControlVector

    if path.lower().endswith(".gguf"):
        return ControlVector.from_gguf(path, lm=lm)
    return ControlVector.load(path, lm=lm)


def _load_model(src: str):
    return load_decoder(src, "activation steering")


def _train(args) -> int:
    from jsteer import progress
    from jsteer.actsteer import train

    t0 = time.time()
    positive, negative = read_lines(args.positive), read_lines(args.negative)
    if len(positive) != len(negative):
        raise ValueError(
            f"{args.positive} has {len(positive)} prompts but {args.negative} has {len(negative)}: "
            f"line i of each makes pair i"
        )
    lm = _load_model(args.model)
    cv = train(
        lm, positive, negative, parse_layers(args.layers), args.method, reduce=args.reduce, batch_size=args.batch_size
    )
    cv = dataclasses.replace(cv, recipe={**cv.recipe, "positive_file": args.positive, "negative_file": args.negative})
    out = cv.export_gguf(args.out) if args.out.lower().endswith(".gguf") else cv.save(args.out)
    norms = ", ".join(f"{k}: {float((v**2).sum() ** 0.5):.3g}" for k, v in cv.numpy().items())
    print(f"{len(positive)} pairs, method {cv.method} ({cv.recipe['reduce']} token); direction norms {norms}")
    print(f"wrote {out}")
    progress.summary(
        "actsteer train",
        f"{cv.method} control vector from {len(positive)} pairs at layer(s) {args.layers}",
        time.time() - t0,
        out,
    )
    return 0


def _generate(args) -> int:
    from jsteer.hooks import compose

    lm = _load_model(args.model)
    strengths = args.strength if args.strength is not None else [1.0] * len(args.vector)
    if len(strengths) != len(args.vector):
        raise ValueError(f"{len(args.vector)} --vector files but {len(strengths)} --strength values")
    return print_generations(lm, args, compose(*(load_vector(v, lm).hooks(s) for v, s in zip(args.vector, strengths))))


if __name__ == "__main__":  # pragma: no cover
    from jsteer.cli import main

    sys.exit(main(["actsteer"] + sys.argv[1:]))
