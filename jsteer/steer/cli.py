"""``jsteer steer``: train, generate, highlight, explain, transfer.

    jsteer steer train --model smollm2-135m --data ../shared/data/sst5/train.jsonl --out steers/sentiment
    jsteer steer train --model smollm2-135m --tfds jsteer_labeled_text/src_0123456789ab:train \\
        --tfds-data-dir tfds/ --out steers/sentiment      (texts from a prepared TFDS data set)
    jsteer steer generate --model smollm2-135m --steer steers/sentiment --value 5 "The movie was"
    jsteer steer generate ... --steer steers/sentiment --value 5 --steer steers/detox --value 3 "..."
    jsteer steer highlight --model smollm2-135m --steer steers/sentiment --value 5 "text to explain"
    jsteer steer explain --model smollm2-135m --steer steers/sentiment [--dirs 5 --top 10]
    jsteer steer transfer --steer steers/sentiment --from smollm2-135m --to OTHER --out steers/sent-other

``train --data`` files are read through the TFDS layer (:mod:`jsteer.data.sources`): prepared
once into ``--data-dir`` (default ``$JSTEER_DATA_DIR``; keyed by the file's content) and read
with ``tfds.data_source``; ``--tfds`` reads a prepared data set's ``text`` and ``label`` features
instead (``--format`` maps its labels; auto knows SST-5's 0..4 and +1 / -1 names).

``--value`` is in units of the artifact's eps0 (the original's ``--steer_values``); the
domain-shift ("dummy") steer is kept at ``--dummy`` (default 1) for every artifact, so composing
N artifacts applies N domain shifts (``--dummy 0`` applies none).
"""

from __future__ import annotations

import json
import sys
import time

from jsteer import progress
from jsteer.cli import add_data_dirs, add_generate_options, load_decoder, method_group, print_generations

# generic sentence openings: their mean final hidden state is the typical context for `explain`
GENERIC_CONTEXTS = ("The", "I think that the", "It was a", "This is one of the", "When we got there, the")


def register(subparsers) -> None:
    sub = method_group(subparsers, "steer", "LM-Steer: train, generate, highlight, explain, transfer", __doc__)

    p = sub.add_parser(
        "train",
        help="train a steer on labeled texts (frozen model, cached hidden states)",
        description="Train a steer on labeled texts: a file (--data; read through the TFDS layer: prepared "
        "once into --data-dir, read with tfds.data_source) or a prepared TFDS data set with text and "
        "label features (--tfds).",
    )
    p.add_argument("--model", required=True, help="decoder: embedded name, HF folder, .gguf or jsteer checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", default=None, help="labeled texts: SST-5 .jsonl, Jigsaw .csv, or {text,label} .jsonl")
    src.add_argument(
        "--tfds",
        default=None,
        metavar="NAME[/CONFIG][:SPLIT]",
        help="a prepared TFDS data set in --tfds-data-dir with text and label features (SPLIT default: "
        "train, or its only split); labels are read as --format says (auto: SST-5's 0..4 or +1/-1 names)",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", "sst5", "jigsaw", "jsonl"),
        help="how labels map to +1 / -1: sst5 (3, 4 / 0, 1; 2 dropped), jigsaw (0 / 1), jsonl (1 / -1 or 0)",
    )
    add_data_dirs(p, "--data files are")
    p.add_argument("--out", required=True, help="artifact folder to write")
    p.add_argument("--name", default="steer0", help="name of the trained steer (recorded in the artifact)")
    p.add_argument("--rank", type=int, default=1000, help="rank of W = P1 P2^T (default 1000)")
    p.add_argument("--full-rank", action="store_true", help="train a full d x d W instead")
    p.add_argument(
        "--baseline",
        choices=("blacklist", "offset"),
        default=None,
        help="train a baseline instead: soft word blacklist (logit offset) or context-vector offset",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument(
        "--eps0",
        type=float,
        default=None,
        help="steer scale (default 1e-3; 1 for --baseline, whose parameters act on logits directly)",
    )
    p.add_argument("--init-scale", type=float, default=1e-3)
    p.add_argument("--l2", type=float, default=0.0, help="L2 penalty weight on the steer params")
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="token rows per training step (static; default: from the data and --batch-size); the "
        "experiments' low-rank recipes use 768",
    )
    p.add_argument("--no-dummy", action="store_true", help="no domain-shift steer")
    p.add_argument("--max-len", type=int, default=128, help="tokens kept per text")
    p.add_argument("--limit", type=int, default=None, help="class-balanced random subset of this many texts")
    p.add_argument("--cache", default=None, help=".npz file to keep / reuse the cached hidden states")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train)

    p = sub.add_parser("generate", help="generate with one or more steers at given strengths")
    p.add_argument("prompts", nargs="+")
    _model_steers(p)
    add_generate_options(p, max_new_tokens=20, temperature=1.0, top_p=0.9)
    p.set_defaults(func=_generate)

    p = sub.add_parser("highlight", help="per-token log P_steered - log P_reference and the best span (<= 5 tokens)")
    p.add_argument("texts", nargs="+")
    _model_steers(p)
    p.add_argument("--max-span", type=int, default=5)
    p.add_argument(
        "--against",
        choices=("opposite", "dummy", "base"),
        default="opposite",
        help="reference distribution: the steer at -value (default; cancels what both signs share), "
        "only the domain-shift steer on, or the unsteered model",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per text: tokens (every scored token), scores, span [start, end) into tokens",
    )
    p.set_defaults(func=_highlight)

    p = sub.add_parser("explain", help="SVD of W: top / bottom tokens of the leading directions")
    p.add_argument("--model", required=True)
    p.add_argument("--steer", required=True)
    p.add_argument("--index", type=int, default=0, help="which steer in the artifact (default 0)")
    p.add_argument("--dirs", type=int, default=5)
    p.add_argument("--top", type=int, default=10)
    p.add_argument(
        "--context",
        action="append",
        default=None,
        help="text(s) whose mean final hidden state orients the directions (repeatable; default: "
        "a few generic sentence openings)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", default=None, help="also draw the directions' top / bottom tokens as bar charts here")
    p.set_defaults(func=_explain)

    p = sub.add_parser("transfer", help="map a steer onto another model through shared anchor tokens")
    p.add_argument("--steer", required=True, help="artifact trained on --from")
    p.add_argument("--from", dest="src", required=True, help="the model the steer was trained on")
    p.add_argument("--to", dest="dst", required=True, help="the target model")
    p.add_argument("--out", required=True)
    p.add_argument("--max-anchors", type=int, default=None, help="use at most this many shared tokens")
    p.add_argument("--ridge", type=float, default=0.0)
    p.set_defaults(func=_transfer)


def _model_steers(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--steer", action="append", required=True, help="artifact folder (repeat to compose)")
    p.add_argument(
        "--value",
        action="append",
        type=float,
        default=None,
        help="strength of each --steer in units of eps0 (repeat in the same order; default 5)",
    )
    p.add_argument(
        "--dummy",
        type=float,
        default=1.0,
        help="value of each artifact's domain-shift steer (default 1, as trained). Each artifact "
        "brings its own, so composing N artifacts applies N of them: use 0 to apply none",
    )


# ----------------------------------------------------------------------------- helpers


def _load_model(src: str):
    return load_decoder(src, "LM-Steer")


def _load_each(lm, paths, values, dummy: float):
    """Load artifacts for ``lm``: -> ([params], [eps [S_i]], [meta]), one per artifact."""
    import numpy as np

    from jsteer.steer import artifact, head

    if values is None:
        values = [5.0] * len(paths)
    if len(values) != len(paths):
        raise ValueError(f"{len(paths)} --steer artifacts but {len(values)} --value strengths")
    plist, eps, metas = [], [], []
    for path, v in zip(paths, values):
        params, meta = artifact.load(path, model_identity=lm.identity)
        n_user = head.num_steers(params) - int(meta["dummy"])
        vals = [v] + [0.0] * (n_user - 1) + ([dummy] if meta["dummy"] else [])
        plist.append(params)
        eps.append(np.asarray(vals, np.float32) * meta["eps0"])
        metas.append(meta)
    return plist, eps, metas


def load_steers(lm, paths, values, dummy: float = 1.0):
    """Load artifacts for ``lm`` and stack them (steers of one family: bilinear, blacklist or
    offset): -> (params, eps [S], metas)."""
    import numpy as np

    from jsteer.steer import head

    plist, eps, metas = _load_each(lm, paths, values, dummy)
    return head.stack(plist), np.concatenate(eps), metas


def steer_hooks(lm, paths, values, dummy: float = 1.0):
    """Load artifacts for ``lm`` -> one ``Hooks`` carrying all of them, each in its cheapest
    exact form with its own strength; bilinear steers and baselines may be mixed."""
    import jax.numpy as jnp

    from jsteer.hooks import compose
    from jsteer.steer import head

    plist, eps, _ = _load_each(lm, paths, values, dummy)
    return compose(
        *(head.to_hooks({k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(e)) for p, e in zip(plist, eps))
    )


# ----------------------------------------------------------------------------- verbs


def _cache_key(args, lm, source) -> dict:
    """What cached hidden states depend on: a cache built from another model, data file or text
    cut is refused on reuse."""
    import os

    from jsteer.convert.hf import file_sha256

    if args.tfds is not None:
        data = {"tfds": f"{source.spec} in {source.data_dir}", "data_sha256": source.digest()}
    elif not os.path.isfile(args.data):
        raise ValueError(f"--data {args.data}: no such file")
    else:
        data = {"data": os.path.abspath(args.data), "data_sha256": file_sha256(args.data)}
    return {
        "model": lm.identity,
        **data,
        "format": args.format,
        "max_len": args.max_len,
        "limit": args.limit,
        "seed": args.seed if args.limit else None,
    }


def _train(args) -> int:
    import os

    import numpy as np

    from jsteer.steer import artifact, train

    lm = _load_model(args.model)
    kind = args.baseline or "steer"
    eps0 = args.eps0 if args.eps0 is not None else (train.BASELINE_EPS0 if args.baseline else 1e-3)
    cfg = train.TrainConfig(
        rank=None if args.full_rank else args.rank,
        init_scale=args.init_scale,
        eps0=eps0,
        lr=args.lr,
        steps=args.steps,
        batch_size=args.batch_size,
        l2=args.l2,
        dummy=not args.no_dummy,
        seed=args.seed,
        kind=kind,
        tokens_per_batch=args.tokens_per_batch,
    )
    if args.tokens_per_batch is not None and args.tokens_per_batch < 1:
        raise ValueError(f"--tokens-per-batch must be >= 1, got {args.tokens_per_batch}")
    t0 = time.time()
    source = args.data
    if args.tfds is not None:
        from jsteer.data import sources

        source = sources.open_tfds(
            args.tfds, args.tfds_data_dir, need=sources.LABELED, default_split="train", what="(a steer trains on them)"
        )
    key = _cache_key(args, lm, source) if args.cache else None
    if args.cache and os.path.exists(train.npz_path(args.cache)):
        cache = train.HiddenCache.load(args.cache, key=key)
        print(
            f"reusing cached hidden states {train.npz_path(args.cache)} ({cache.num_texts} texts, "
            f"{cache.num_tokens} tokens)"
        )
    else:
        texts, values = train.load_labeled(
            source, args.format, limit=args.limit, seed=args.seed, data_dir=args.data_dir
        )
        print(f"{len(texts)} texts ({int((values > 0).sum())} positive, {int((values < 0).sum())} negative)")
        cache = train.cache_lm(lm, texts, values, max_len=args.max_len, progress=True)
        if args.cache:
            cache.save(args.cache, key=key)
    t1 = time.time()
    emb = np.asarray(lm.output_embeddings(), np.float32)
    params, hist = train.train(cache, emb, cfg, progress=True)
    t2 = time.time()
    extra = {
        "data": args.data if args.tfds is None else f"tfds {source.spec} in {source.data_dir}",
        "steps": cfg.steps,
        "rank": cfg.rank,
        "lr": cfg.lr,
        "l2": cfg.l2,
        "batch_size": cfg.batch_size,
        "init_scale": cfg.init_scale,
        "final_loss": hist["final_loss"],
        "texts": cache.num_texts,
        "tokens": cache.num_tokens,
        **({"tokens_per_batch": cfg.tokens_per_batch} if cfg.tokens_per_batch else {}),
    }
    artifact.save_trained(args.out, params, lm, emb, cfg, [args.name], extra)
    print(
        f"cached hidden states in {t1 - t0:.1f}s; trained {cfg.steps} steps in {t2 - t1:.1f}s "
        f"({hist['steps_per_s']:.1f} steps/s); final loss {hist['final_loss']:.4f}"
    )
    print(f"wrote {args.out}")
    progress.summary(
        "steer train",
        f"trained {kind} {args.name!r} for {cfg.steps} steps on {cache.num_texts} texts",
        time.time() - t0,
        args.out,
        final_loss=hist["final_loss"],
    )
    return 0


def _generate(args) -> int:
    lm = _load_model(args.model)
    return print_generations(lm, args, steer_hooks(lm, args.steer, args.value, args.dummy))


def _highlight(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from jsteer.steer import highlight

    lm = _load_model(args.model)
    params, eps, _ = load_steers(lm, args.steer, args.value, args.dummy)
    values = args.value if args.value is not None else [5.0] * len(args.steer)
    if args.against == "opposite":
        _, base_eps, _ = load_steers(lm, args.steer, [-v for v in values], args.dummy)
    else:
        _, base_eps, _ = load_steers(
            lm, args.steer, [0.0] * len(args.steer), args.dummy if args.against == "dummy" else 0.0
        )
    emb = lm.output_embeddings()
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    for text in args.texts:
        ids = _with_start_token(lm.tokenizer, lm.tokenizer.encode(text))
        if len(ids) < 2:
            raise ValueError(
                f"text {text!r} has fewer than 2 tokens and the tokenizer no bos/eos token "
                "to predict the first from: nothing to score"
            )
        out = lm.forward(jnp.asarray([ids]))
        scores, (s, e, tot) = highlight.highlight(
            jp,
            out.hidden[:, :-1],
            emb,
            jnp.asarray([ids[1:]]),
            jnp.asarray(eps),
            max_len=args.max_span,
            eps_base=jnp.asarray(base_eps),
        )
        # the scored tokens: ids[1:] (each predicted from the ones before); span indexes them
        toks = [lm.tokenizer.decode([i], skip_special_tokens=False) for i in ids[1:]]
        s, e = int(s[0]), int(e[0])
        span = lm.tokenizer.decode(ids[1 + s : 1 + e])
        if args.json:
            print(
                json.dumps(
                    {
                        "text": text,
                        "tokens": toks,
                        "scores": np.asarray(scores[0]).round(4).tolist(),
                        "span": [s, e],
                        "span_text": span,
                        "span_score": float(tot[0]),
                    }
                )
            )
        else:
            marked = "".join(f"[{t}]" if s <= i < e else t for i, t in enumerate(toks))
            print(f"{lm.tokenizer.decode(ids[:1])}{marked}\n  best span: {span!r} (score {float(tot[0]):.3f})")
    return 0


def _with_start_token(tokenizer, ids):
    """``ids`` behind the tokenizer's bos (else eos) token when the encoding does not start with
    it, so that the text's first token is scored too (predicted from the document start)."""
    start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if start is None or (ids and ids[0] == start):
        return list(ids)
    return [start] + list(ids)


def _explain(args) -> int:
    import numpy as np

    from jsteer.steer import artifact, interpret

    lm = _load_model(args.model)
    params, meta = artifact.load(args.steer, model_identity=lm.identity)
    emb = np.asarray(lm.output_embeddings(), np.float32)
    dec = lambda i: lm.tokenizer.decode([i]) or lm.tokenizer.id_to_token(i)  # noqa: E731
    res = interpret.explain(
        params,
        emb,
        steer=args.index,
        n_dirs=args.dirs,
        top=args.top,
        decode=dec,
        mean_hidden=_mean_context(lm, args.context or GENERIC_CONTEXTS),
    )
    if args.png:
        from jsteer import plots

        plots.explain_chart(res, args.png, title=f"{args.steer} (steer {args.index})")
        print(f"wrote {args.png}", file=sys.stderr)
    if args.json:
        print(json.dumps(res))
        return 0
    for d in res:
        print(f"direction {d['index']} (singular value {d['singular_value']:.3g})")
        print("  +: " + " ".join(t for t, _ in d["top"]))
        print("  -: " + " ".join(t for t, _ in d["bottom"]))
    return 0


def _mean_context(lm, texts):
    """Mean final hidden state over every position of ``texts`` [D]: the typical context c_bar
    that orients each SVD direction (its sign is otherwise arbitrary), so that "+" lists the
    tokens a positive steer value promotes."""
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for text in texts:
        ids = _with_start_token(lm.tokenizer, lm.tokenizer.encode(text))
        if not ids:
            raise ValueError(f"--context {text!r} encodes to no tokens")
        rows.append(np.asarray(lm.forward(jnp.asarray([ids])).hidden[0], np.float64))
    return np.concatenate(rows).mean(0)


def _transfer(args) -> int:
    import numpy as np

    from jsteer.steer import artifact, transfer

    src, dst = _load_model(args.src), _load_model(args.dst)
    params, meta = artifact.load(args.steer, model_identity=src.identity)
    if meta["kind"] == "blacklist":  # before fitting the map
        raise ValueError(f"{args.steer}: {transfer.BLACKLIST_NOT_TRANSFERABLE}")
    ids_a, ids_b = transfer.shared_anchors(
        src.tokenizer.backend.get_vocab(), dst.tokenizer.backend.get_vocab(), args.max_anchors
    )
    ea, eb = np.asarray(src.output_embeddings()), np.asarray(dst.output_embeddings())
    hm = transfer.fit_map(ea, eb, ids_a, ids_b, ridge=args.ridge)
    err = transfer.anchor_fit_error(ea, eb, ids_a, ids_b, hm)
    new = transfer.transfer(params, hm)
    artifact.save(
        args.out,
        new,
        base_model=dst.identity,
        hidden_size=eb.shape[1],
        vocab_size=eb.shape[0],
        eps0=meta["eps0"],
        dummy=meta["dummy"],
        steer_names=meta["steer_names"],
        transferred_from=meta["base_model"],
        extra=dict(meta.get("train", {}), transfer={"anchors": int(len(ids_a)), "fit_error": err}),
    )
    print(f"{len(ids_a)} shared anchor tokens; relative fit error {err:.4f}; wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from jsteer.cli import main

    sys.exit(main(["steer"] + sys.argv[1:]))
