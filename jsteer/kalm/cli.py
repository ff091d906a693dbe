"""``jsteer kalm``: train a KALM (or plain) word-level LM on recipe-style text, evaluate it.

    jsteer kalm train --data ../shared/data/kalm_namedentitylm --out runs/kalm --kind kalm --steps 400
    jsteer kalm eval --model runs/kalm --text ../shared/data/kalm_namedentitylm/raw_data/uncleaned_test_ing.txt

``train`` reads the type lexicon (``<data>/superingredients/*.txt``) and the training text
(``--train``, default ``<data>/raw_data/uncleaned_valid_ing.txt``), builds the word vocabulary
and type vocabularies (``--held-out`` words per type left out of them, chosen among words of
``--held-out-from``), trains a random-init LLaMA with the chosen head and writes an artifact
(params + vocabulary + type words + configs). ``eval`` prints JSON: perplexity of a text file
and, for a KALM, the context-typing accuracy of the artifact's held-out words found there.
"""

from __future__ import annotations

import json
import pathlib
import time

from jsteer.cli import method_group

KINDS = ("plain", "kalm", "kalm_type_input")


def register(subparsers) -> None:
    sub = method_group(subparsers, "kalm", "KALM typed-vocabulary LM: train, eval", __doc__)
    p = sub.add_parser("train", help="train a KALM / plain LM and save an artifact")
    p.add_argument("--data", required=True, help="kalm_namedentitylm folder (superingredients/, raw_data/)")
    p.add_argument("--train", default=None, help="training text, one item a line")
    p.add_argument("--out", required=True, help="artifact folder to write")
    p.add_argument("--kind", choices=KINDS, default="kalm")
    p.add_argument("--reverse", action="store_true", help="right-to-left model (for bidirectional typing)")
    p.add_argument("--train-lines", type=int, default=None)
    p.add_argument("--held-out", type=float, default=0.0, help="fraction of each type's words left out")
    p.add_argument("--held-out-from", default=None, help="text whose words are eligible to be held out")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--type-dim", type=int, default=32, help="width of the type embeddings")
    p.add_argument(
        "--untied",
        action="store_true",
        help="free typed output rows (default: word output embedding + a type-specific offset)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train)
    p = sub.add_parser("eval", help="perplexity (and held-out typing) of an artifact on a text file")
    p.add_argument("--model", required=True, help="artifact folder written by `jsteer kalm train`")
    p.add_argument("--text", required=True)
    p.add_argument("--lines", type=int, default=None, help="first N lines only")
    p.set_defaults(func=_eval)


def _train(args) -> int:
    import jax

    from jsteer import progress
    from jsteer.checkpoints import save_artifact
    from jsteer.kalm import data as kdata
    from jsteer.kalm import train as ktrain
    from jsteer.kalm.head import TypedVocab

    t0 = time.time()
    if not 0.0 <= args.held_out < 1.0:
        raise ValueError(f"--held-out must be in [0, 1), got {args.held_out}")
    for name in ("steps", "batch", "length", "hidden", "layers", "type_dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % 8:
        raise ValueError(f"--hidden must be a multiple of 8 (4 attention heads of even width), got {args.hidden}")
    root = pathlib.Path(args.data)
    lexicon = kdata.read_lexicon(root)
    lines = kdata.read_lines(args.train or root / "raw_data" / "uncleaned_valid_ing.txt", args.train_lines)
    vocab = kdata.Vocab.build(lines)
    types = kdata.word_types(lexicon, vocab.words)
    eligible = None
    if args.held_out_from:
        eligible = {w for line in kdata.read_lines(args.held_out_from) for w in line}
    held = kdata.split_held_out(types, vocab, args.held_out, args.seed, eligible) if args.held_out else set()
    type_words = kdata.type_word_ids(types, vocab, kdata.TYPE_NAMES, exclude=held)
    tv = TypedVocab.build(len(vocab), type_words, disjoint=True)
    ids, mask = kdata.encode_lines(lines, vocab, args.length, reverse=args.reverse)
    backbone = ktrain.tiny_llama(len(vocab), args.hidden, args.layers, heads=4, max_len=args.length + 1)
    model = ktrain.make_model(args.kind, backbone, tv, type_dim=args.type_dim, share_word_embedding=not args.untied)
    params = ktrain.init_params(model, jax.random.PRNGKey(args.seed), tv)
    params, info = ktrain.train(
        model,
        params,
        ids,
        mask,
        tv,
        ktrain.LMTrainConfig(lr=args.lr, batch_size=args.batch, steps=args.steps, seed=args.seed),
        progress=True,
    )
    meta = {
        "kind": args.kind,
        "reverse": args.reverse,
        "vocab": vocab.words,
        "type_names": list(kdata.TYPE_NAMES),
        "type_words": type_words,
        "held_out": {w: types[w][0] for w in sorted(held)},
        "length": args.length,
        "backbone": backbone.to_dict(),
        "type_dim": args.type_dim,
        "share_word_embedding": not args.untied,
        "train_seconds": info["seconds"],
        "final_loss": info["losses"][-1],
    }
    save_artifact(args.out, params, meta)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "final_loss": info["losses"][-1],
                "train_seconds": info["seconds"],
                "vocab": len(vocab),
                "typed_pairs": tv.num_pairs,
                "held_out": len(held),
            }
        )
    )
    progress.summary(
        "kalm train",
        f"trained a {args.kind} model for {args.steps} steps on {len(lines)} lines",
        time.time() - t0,
        args.out,
        final_loss=float(info["losses"][-1]),
    )
    return 0


def _eval(args) -> int:
    import numpy as np

    from jsteer.backbones.families import config_from_hf
    from jsteer.checkpoints import load_artifact
    from jsteer.kalm import data as kdata
    from jsteer.kalm import decode
    from jsteer.kalm import train as ktrain
    from jsteer.kalm.head import TypedVocab

    params, meta = load_artifact(args.model)
    vocab = kdata.Vocab(list(meta["vocab"]))
    tv = TypedVocab.build(len(vocab), meta["type_words"], disjoint=True)
    model = ktrain.make_model(
        meta["kind"],
        config_from_hf(meta["backbone"], f"{args.model}: backbone"),
        tv,
        type_dim=meta.get("type_dim", 32),
        share_word_embedding=meta.get("share_word_embedding", False),
    )
    lines = kdata.read_lines(args.text, args.lines)
    ids, mask = kdata.encode_lines(lines, vocab, meta["length"], reverse=meta["reverse"])
    out = {"lines": len(lines), **ktrain.perplexity(model, params, ids, mask, tv)}
    held = {w: meta["type_names"].index(t) + 1 for w, t in meta.get("held_out", {}).items()}
    if held and meta["kind"] != "plain":
        pos = decode.word_positions(lines, held, meta["length"])
        if pos:
            ctx = ktrain.context_types(model, params, ids, mask, tv)
            col = 2 if meta["reverse"] else 1
            logp = ctx[[p[0] for p in pos], [p[col] for p in pos]]
            pred = decode.decode_types([logp])
            out["typing_accuracy"] = float(np.mean(pred == np.array([p[3] for p in pos])))
            out["typing_occurrences"] = len(pos)
    print(json.dumps(out))
    return 0
