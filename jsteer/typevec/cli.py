"""``jsteer typevec``: make type vectors, show their nearest tokens, probe LAMA with them.

    jsteer typevec make --model smollm2-135m --type City --type Year --out tv/smollm2
    jsteer typevec make --model minilm --words "paris,london,rome" --name city --out tv/city
    jsteer typevec make --model smollm2-135m --type City --project-out Year --out tv/city_optim
    jsteer typevec neighbours --model minilm --type City [-k 10]
    jsteer typevec neighbours --model minilm --artifact tv/city [--name city]
    jsteer typevec probe --model smollm2-135m --relation City/P19 --relation Country/P17 \\
        [--artifact tv/smollm2] [--mode all] [--max-test 100] [--out report.json]

Type examples come from the KG lists in ``--kg`` (default ``../shared/data/type_embedding/
kg_samples`` beside the repository), sampled with ``--strategy`` (weighted by degree by
default, 10 tokens, ``--seed``); only single-token entries are used and the skipped count is
printed. ``probe`` reads the type-grouped LAMA CSVs in ``--data`` and builds each relation's
type vector from its type's KG list unless ``--artifact`` supplies it (by type name).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

_SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
DEFAULT_KG = _SHARED / "type_embedding" / "kg_samples"
DEFAULT_DATA = _SHARED / "type_embedding" / "processed_lama"


def register(subparsers) -> None:
    top = subparsers.add_parser("typevec", help="Type Embeddings: make, neighbours, probe",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="typevec_command", required=True)

    p = sub.add_parser("make", help="build type vectors and save them as an artifact")
    _model(p)
    _source(p)
    p.add_argument("--method", choices=("svd", "mean"), default="svd")
    p.add_argument("--project-out", default=None, metavar="TYPE",
                   help="remove the component along this type's vector (the paper's E_a^optim)")
    p.add_argument("--out", required=True, help="artifact folder to write")
    p.add_argument("-k", type=int, default=8, help="nearest tokens to print per vector")
    p.set_defaults(func=_make)

    p = sub.add_parser("neighbours", help="nearest vocabulary tokens to type vectors (cosine)")
    _model(p)
    _source(p)
    p.add_argument("--artifact", default=None, help="read vectors from this artifact instead")
    p.add_argument("--method", choices=("svd", "mean"), default="svd")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_neighbours)

    p = sub.add_parser("probe", help="LAMA cloze probing: B, BTo, PostTE and TE (lambda tuned on a hold-out)")
    _model(p)
    p.add_argument("--data", default=str(DEFAULT_DATA), help="type-grouped LAMA CSV folder (synth_<Type>/...)")
    p.add_argument("--relation", action="append", default=None,
                   help="<Type>/<relation> to probe, e.g. City/P19 (repeatable; default: all that qualify)")
    p.add_argument("--artifact", default=None, help="type vectors by type name (default: built from --kg)")
    p.add_argument("--kg", default=str(DEFAULT_KG))
    p.add_argument("--strategy", default="weighted", choices=("weighted", "top", "bottom", "uniform"))
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("pos", "all", "layer"), default="pos",
                   help="decoders: TE at the predicting position (pos), at every prompt token (all), or in "
                        "the residual stream of the predicting position after --layer (layer; not in the paper)")
    p.add_argument("--layer", type=int, default=None, help="decoder layer for --mode layer")
    p.add_argument("--lambdas", default="0,1,2,3,4,5", help="lambda grid tuned on the hold-out")
    p.add_argument("--lambda-unit", choices=("norm", "one"), default="one",
                   help="lambda times a unit TE (default, as the paper) or times the mean input-embedding norm")
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--max-test", type=int, default=None, help="cap on reported prompts per relation")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="write the full JSON report here")
    p.set_defaults(func=_probe)


def _model(p):
    p.add_argument("--model", required=True, help="embedded name (minilm, smollm2-135m), HF folder, .gguf, checkpoint")


def _source(p):
    p.add_argument("--type", action="append", default=None, help="type name with a KG list, e.g. City (repeatable)")
    p.add_argument("--words", default=None, help="comma-separated example words instead of a KG type")
    p.add_argument("--name", default=None, help="name for the --words vector (default: the first word)")
    p.add_argument("--kg", default=str(DEFAULT_KG), help="folder of KG lists <Type>.csv")
    p.add_argument("--strategy", default="weighted", choices=("weighted", "top", "bottom", "uniform"))
    p.add_argument("--n", type=int, default=10, help="examples per type")
    p.add_argument("--seed", type=int, default=0)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _vectors(args, lm, method: str):
    """-> (names, tes [K, D], tokens, labels, sampling reports) from --type / --words."""
    import jax.numpy as jnp

    from jsteer.typevec import core, sampling

    emb = lm.input_embeddings()
    names, tes, tokens, labels, reports = [], [], [], [], []
    if args.words:
        words = [w.strip() for w in args.words.split(",") if w.strip()]
        ids, skipped = sampling.tokens_from_words(words, lm.tokenizer)
        if skipped:
            _log(f"skipped {len(skipped)} words that are not a single token: {skipped}")
        names.append(args.name or words[0])
        tes.append(core.make(emb, jnp.asarray(ids), method=method))
        tokens.append(ids)
        labels.append([w for w in words if w not in skipped])
        reports.append({"words": words, "skipped_multi_token": len(skipped)})
    for t in args.type or []:
        s = sampling.sample_type(args.kg, t, lm.tokenizer, strategy=args.strategy, n=args.n, seed=args.seed)
        _log(f"{t}: {len(s.labels)} examples {list(s.labels)} (skipped {s.skipped_multi_token} of "
             f"{s.n_entries} KG entries that are not a single token)")
        names.append(t)
        tes.append(core.make(emb, jnp.asarray(s.token_ids), method=method))
        tokens.append(list(s.token_ids))
        labels.append(list(s.labels))
        reports.append(s.report())
    if not names:
        raise ValueError("give --type TYPE (repeatable) or --words w1,w2,...")
    return names, jnp.stack(tes), tokens, labels, reports


def _print_neighbours(lm, names, tes, k):
    from jsteer.typevec import analysis

    rows = {}
    for name, te in zip(names, tes):
        ids, sims = analysis.neighbours(te, lm.input_embeddings(), k=k)
        toks = [lm.tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]
        rows[name] = [{"token": t, "id": int(i), "cos": round(float(c), 4)} for t, i, c in zip(toks, ids, sims)]
        print(f"{name}: " + ", ".join(f"{t!r} {float(c):.3f}" for t, c in zip(toks, sims)))
    return rows


def _make(args) -> int:
    import jax.numpy as jnp

    import jsteer
    from jsteer.typevec import artifact, core, sampling

    lm = jsteer.load(args.model)
    names, tes, tokens, labels, reports = _vectors(args, lm, args.method)
    method = args.method
    extra = {}
    if args.project_out:
        s = sampling.sample_type(args.kg, args.project_out, lm.tokenizer, strategy=args.strategy, n=args.n,
                                 seed=args.seed)
        other = core.make(lm.input_embeddings(), jnp.asarray(s.token_ids), method=args.method)
        tes = jnp.stack([core.project_out(te, other) for te in tes])
        names = [f"{n}^optim({args.project_out})" for n in names]
        method, extra = "derived", {"project_out": args.project_out, "project_out_tokens": list(s.token_ids),
                                    "base_method": args.method}
    path = artifact.save(args.out, tes, names=names, base_model=lm.identity,
                         vocab_size=int(lm.input_embeddings().shape[0]), method=method, tokens=tokens,
                         labels=labels, sampling=reports, extra=extra)
    _print_neighbours(lm, names, tes, args.k)
    print(f"wrote {len(names)} type vector(s) to {path}")
    return 0


def _neighbours(args) -> int:
    import jsteer
    from jsteer.typevec import artifact

    lm = jsteer.load(args.model)
    if args.artifact:
        tes, meta = artifact.load(args.artifact, model_identity=lm.identity)
        names = meta["names"]
        if args.name:
            tes, names = artifact.get(tes, meta, args.name)[None], [args.name]
    else:
        names, tes, *_ = _vectors(args, lm, args.method)
    rows = _print_neighbours(lm, names, tes, args.k)
    if args.json:
        print(json.dumps(rows))
    return 0


def _probe(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    import jsteer
    from jsteer.typevec import artifact, probe, sampling

    lm = jsteer.load(args.model)
    pm = probe.from_lm(lm)
    groups = probe.load_typed_dataset(args.data)
    if args.relation:
        missing = [r for r in args.relation if r not in groups]
        if missing:
            raise ValueError(f"unknown relation(s) {missing}; known: {sorted(groups)}")
        groups = {r: groups[r] for r in args.relation}
    elif pm.kind == "decoder":
        groups = {k: v for k, v in groups.items() if sum(probe.decoder_qualifies(p.text) for p in v) > len(v) / 2}
    types = sorted({k.split("/")[0] for k in groups})
    if args.artifact:
        tes_a, meta = artifact.load(args.artifact, model_identity=lm.identity)
        by_type = {t: jnp.asarray(artifact.get(tes_a, meta, t)) for t in types if t in meta["names"]}
    else:
        tes_k, _ = sampling.type_vectors(pm.embedding(), lm.tokenizer, args.kg, types, strategy=args.strategy,
                                         n=args.n, seed=args.seed)
        by_type = dict(zip(types, tes_k))
    scale = float(np.mean(np.linalg.norm(np.asarray(pm.embedding()), axis=1))) if args.lambda_unit == "norm" else 1.0
    tes = {g: by_type[g.split("/")[0]] * scale for g in groups if g.split("/")[0] in by_type}
    lams = [float(x) for x in args.lambdas.split(",")]
    rep = probe.evaluate(pm, groups, tes, mode=args.mode, lam_grid=lams, holdout=args.holdout,
                         max_test=args.max_test, seed=args.seed, batch_size=args.batch_size, log=_log,
                         layer=args.layer if args.mode == "layer" else None)
    rep["lambda_unit"] = {"kind": args.lambda_unit, "scale": scale}
    methods = [m for m in ("B", "BTo", "PostTE", "TE") if m in rep["macro"]]
    print(f"{'relation':28s} {'n':>5s} " + " ".join(f"{m + ' P@1':>10s}" for m in methods) + "  lambda")
    for g, r in rep["per_group"].items():
        if r["n_test"] == 0:
            continue
        vals = " ".join(f"{r[m]['P@1']:10.3f}" if m in r else f"{'-':>10s}" for m in methods)
        print(f"{g:28s} {r['n_test']:5d} {vals}  {rep['tuning'].get(g, {}).get('lambda', '-')}")
    print(f"{'macro':28s} {'':5s} " + " ".join(f"{rep['macro'][m]['P@1']:10.3f}" for m in methods))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rep, indent=1))
        print(f"wrote {args.out}")
    return 0
