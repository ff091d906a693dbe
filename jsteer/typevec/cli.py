"""``jsteer typevec``: make type vectors, show their nearest tokens, probe LAMA with them.

    jsteer typevec make --model smollm2-135m --type City --type Country --out tv/smollm2
    jsteer typevec make --model minilm --words "paris,london,rome" --name city --out tv/city
    jsteer typevec make --model smollm2-135m --type City --project-out Year --first-token --out tv/city_optim
    jsteer typevec neighbours --model minilm --type City [-k 10]
    jsteer typevec neighbours --model minilm --artifact tv/city [--name city]
    jsteer typevec probe --model smollm2-135m --relation City/P19 --relation Country/P17 \\
        [--artifact tv/smollm2 [--artifact-type NAME=TYPE]] [--mode all] [--max-test 100] [--out report.json]
    jsteer typevec probe --model smollm2-135m --lama ../shared/data/lama [--lama-type P279=Genre]
    jsteer typevec probe --model smollm2-135m --tfds jsteer_typed_lama/src_0123456789ab --tfds-data-dir tfds/
    jsteer typevec probe --model smollm2-135m --mode layer --layers 16,22,26,29 --lambda-unit resid \\
        --lambdas 0,0.1,0.2,0.25,0.3,0.35,0.4,0.45,0.5,0.55,0.6 --max-test 100   # typevec_lama.py's best setting

Type examples come from the KG lists in ``--kg`` (default ``../shared/data/type_embedding/
kg_samples`` beside the repository), sampled with ``--strategy`` (weighted by degree by
default, 10 tokens, ``--seed``); only entries that are one word token are used (``--first-token``:
the first word token of multi-token entries), the tokens used and the skipped counts are
printed, and fewer usable tokens than ``--n`` is warned about. SmolLM2 writes years as digit
tokens, so Year needs ``--first-token`` (it applies to every type of the command) and yields
only "1", "2", "3"; ``experiments/typevec_lama.py`` builds E_year from the ten digits instead.

``probe`` reads the type-grouped LAMA CSVs in ``--data``, or raw LAMA with ``--lama DIR``
(``DIR/relations.jsonl`` templates, ``DIR/<source>/<relation>.jsonl`` facts; each relation's
answer type from ``--lama-type REL=TYPE`` or the default map ``probe.LAMA_TYPES``, the types of
the typed CSVs), or a prepared TFDS data set with ``--tfds NAME[/CONFIG][:SPLIT]`` (typed prompts:
features ``sent``, ``gold``, ``type``, ``relation``; or LAMA facts: ``relation``, ``sub_label``,
``obj_label``, ``prompt``). ``--data`` / ``--lama`` folders are read through the TFDS layer
(:mod:`jsteer.data.sources`): prepared once into ``--data-dir`` (default ``$JSTEER_DATA_DIR``;
keyed by the files' content) and read with ``tfds.data_source``.

Each relation's type vector is built from its type's KG list unless ``--artifact`` supplies it:
by the base type recorded with each vector (``make --project-out`` records "City" for
"City^optim(Year)"), by name, or as mapped by ``--artifact-type``.
A relation with no usable prompt or no type is skipped, and one whose type gets no vector is
probed with B/BTo only; both are reported (stderr and the JSON: ``skipped_relations``,
``no_te``, ``type_vectors``). Every method's macro is over the same relations
(``macro_relations``); the run fails only when no relation is left with a type vector.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from jsteer import progress
from jsteer.cli import add_data_dirs, method_group, warning_lines

_SHARED = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"
# --lambda-unit -> its kind; abs / row_norm are experiments/typevec_lama.py's names for one / norm
_LAMBDA_UNITS = {"one": "one", "norm": "norm", "resid": "resid", "abs": "one", "row_norm": "norm"}
DEFAULT_KG = _SHARED / "type_embedding" / "kg_samples"
DEFAULT_DATA = _SHARED / "type_embedding" / "processed_lama"


def register(subparsers) -> None:
    sub = method_group(subparsers, "typevec", "Type Embeddings: make, neighbours, probe", __doc__)

    p = sub.add_parser("make", help="build type vectors and save them as an artifact")
    _model(p)
    _source(p)
    p.add_argument("--method", choices=("svd", "mean"), default="svd")
    p.add_argument(
        "--project-out",
        default=None,
        metavar="TYPE",
        help="remove the component along this type's vector (the paper's E_a^optim)",
    )
    p.add_argument("--out", required=True, help="artifact folder to write")
    p.add_argument("-k", type=int, default=8, help="nearest tokens to print per vector")
    p.set_defaults(func=warning_lines("typevec make")(_make))

    p = sub.add_parser("neighbours", help="nearest vocabulary tokens to type vectors (cosine)")
    _model(p)
    _source(p)
    p.add_argument("--artifact", default=None, help="read vectors from this artifact instead")
    p.add_argument("--method", choices=("svd", "mean"), default="svd")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", default=None, help="also draw each vector's nearest tokens and cosines here")
    p.set_defaults(func=warning_lines("typevec neighbours")(_neighbours))

    p = sub.add_parser("probe", help="LAMA cloze probing: B, BTo, PostTE and TE (lambda tuned on a hold-out)")
    _model(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", default=str(DEFAULT_DATA), help="type-grouped LAMA CSV folder (synth_<Type>/...)")
    src.add_argument(
        "--lama",
        default=None,
        metavar="DIR",
        help="raw LAMA folder: relations.jsonl and <source>/<relation>.jsonl fact files",
    )
    src.add_argument(
        "--tfds",
        default=None,
        metavar="NAME[/CONFIG][:SPLIT]",
        help="a prepared TFDS data set in --tfds-data-dir: typed prompts (features sent, gold, type, relation) "
        "or raw LAMA facts (relation, sub_label, obj_label, prompt); SPLIT default: its only split",
    )
    add_data_dirs(p, "--data / --lama files are")
    p.add_argument(
        "--lama-type",
        action="append",
        default=None,
        metavar="REL=TYPE",
        help="answer type of a raw LAMA relation (repeatable; overrides probe.LAMA_TYPES)",
    )
    p.add_argument(
        "--relation",
        action="append",
        default=None,
        help="<Type>/<relation> (or just <relation>) to probe, e.g. City/P19 (repeatable; default: all that qualify)",
    )
    p.add_argument("--artifact", default=None, help="type vectors by type (default: built from --kg)")
    p.add_argument(
        "--artifact-type",
        action="append",
        default=None,
        metavar="NAME=TYPE",
        help="use the artifact vector NAME for TYPE, e.g. 'City^optim(Country)=City' (repeatable)",
    )
    p.add_argument("--kg", default=str(DEFAULT_KG))
    p.add_argument("--strategy", default="weighted", choices=("weighted", "top", "bottom", "uniform"))
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--first-token",
        action="store_true",
        help="represent multi-token KG labels by their first word token (e.g. years in SmolLM2)",
    )
    p.add_argument(
        "--mode",
        choices=("pos", "all", "layer"),
        default="pos",
        help="decoders: TE at the predicting position (pos), at every prompt token (all), or in "
        "the residual stream of the predicting position after --layer (layer; not in the paper)",
    )
    p.add_argument("--layer", type=int, default=None, help="decoder layer for --mode layer")
    p.add_argument(
        "--layers",
        default=None,
        metavar="L1,L2,...",
        help="--mode layer: candidate layers, one chosen on the hold-out (best macro hold-out P@1 at "
        "tuned lambda, lambda in resid units of each layer; overrides --layer)",
    )
    p.add_argument("--lambdas", default="0,1,2,3,4,5", help="lambda grid tuned on the hold-out")
    p.add_argument(
        "--lambda-unit",
        choices=tuple(_LAMBDA_UNITS),
        default="one",
        help="lambda times a unit TE (one, default, as the paper; alias abs), times the mean "
        "input-embedding norm (norm; alias row_norm) or times the mean residual-stream norm after "
        "--layer at the predicting position, measured on the hold-out prompts (resid; --mode layer)",
    )
    p.add_argument(
        "--holdout",
        type=float,
        default=0.05,
        help="fraction of each relation's prompts that tunes lambda / w / the BTo form (0: no tuning)",
    )
    p.add_argument("--max-test", type=int, default=None, help="cap on reported prompts per relation")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="write the full JSON report here")
    p.set_defaults(func=warning_lines("typevec probe")(_probe))


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
    p.add_argument(
        "--first-token",
        action="store_true",
        help="represent multi-token KG labels by their first word token (e.g. years in SmolLM2)",
    )


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sample(args, lm, type_name: str):
    """One KG type's examples, with what was used printed."""
    from jsteer.typevec import sampling

    s = sampling.sample_type(
        args.kg, type_name, lm.tokenizer, strategy=args.strategy, n=args.n, seed=args.seed, first_token=args.first_token
    )
    _log(
        f"{type_name}: {len(s.token_ids)} example tokens {list(s.tokens)} of {args.n} requested (labels "
        f"{list(s.labels)}; skipped {s.skipped_multi_token} multi-token and {s.skipped_non_word} "
        f"whitespace/punctuation-only of {s.n_entries} KG entries)"
    )
    return s


def _vectors(args, lm, method: str):
    """-> (names, tes [K, D], tokens, labels, sampling reports, token strings, types) from --type / --words."""
    import jax.numpy as jnp

    from jsteer.typevec import core, sampling

    emb = lm.input_embeddings()
    names, tes, tokens, labels, reports, strings, types = [], [], [], [], [], [], []
    if args.words:
        words = [w.strip() for w in args.words.split(",") if w.strip()]
        ids, skipped = sampling.tokens_from_words(words, lm.tokenizer)
        if skipped:
            _log(f"skipped {len(skipped)} words that are not a single word token (or repeat one): {skipped}")
        names.append(args.name or words[0])
        tes.append(core.make(emb, jnp.asarray(ids), method=method))
        tokens.append(ids)
        labels.append([w for w in words if w not in skipped])
        reports.append({"words": words, "skipped_multi_token": len(skipped)})
        strings.append([sampling.decode_token(lm.tokenizer, i) for i in ids])
        types.append("")
    for t in args.type or []:
        s = _sample(args, lm, t)
        names.append(t)
        tes.append(core.make(emb, jnp.asarray(s.token_ids), method=method))
        tokens.append(list(s.token_ids))
        labels.append(list(s.labels))
        reports.append(s.report())
        strings.append(list(s.tokens))
        types.append(t)
    if not names:
        raise ValueError("give --type TYPE (repeatable) or --words w1,w2,...")
    return names, jnp.stack(tes), tokens, labels, reports, strings, types


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
    from jsteer.typevec import artifact, core

    lm = jsteer.load(args.model)
    names, tes, tokens, labels, reports, strings, types = _vectors(args, lm, args.method)
    method = args.method
    extra = {}
    if args.project_out:
        s = _sample(args, lm, args.project_out)
        other = core.make(lm.input_embeddings(), jnp.asarray(s.token_ids), method=args.method)
        tes = jnp.stack([core.project_out(te, other) for te in tes])
        # the projected vector still stands for its base type (recorded in `types`), for probe --artifact
        names = [f"{n}^optim({args.project_out})" for n in names]
        method, extra = (
            "derived",
            {
                "project_out": args.project_out,
                "project_out_tokens": list(s.token_ids),
                "project_out_token_strings": list(s.tokens),
                "base_method": args.method,
            },
        )
    path = artifact.save(
        args.out,
        tes,
        names=names,
        base_model=lm.identity,
        vocab_size=int(lm.input_embeddings().shape[0]),
        method=method,
        tokens=tokens,
        labels=labels,
        sampling=reports,
        extra=extra,
        token_strings=strings,
        types=types,
    )
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
    if args.png:
        from jsteer import plots

        plots.neighbours_chart(rows, args.png, title=f"{args.model}: nearest tokens (cosine)")
        _log(f"wrote {args.png}")
    if args.json:
        print(json.dumps(rows))
    return 0


def _pairs(items, flag: str) -> dict[str, str]:
    """["A=B", ...] -> {A: B}, for ``flag``."""
    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep or not k.strip() or not v.strip():
            raise ValueError(f"{flag} wants KEY=VALUE, got {it!r}")
        out[k.strip()] = v.strip()
    return out


def _probe_groups(args, pm) -> tuple[dict, dict]:
    """The relations to probe -> ({"<Type>/<rel>": prompts}, {relation: why it is skipped})."""
    from jsteer.typevec import probe

    skipped: dict[str, str] = {}
    source, raw = (args.lama, True) if args.lama else (args.data, False)
    if args.tfds is not None:
        source, raw = _tfds_prompts(args)
    if raw:
        types = {**probe.LAMA_TYPES, **_pairs(args.lama_type, "--lama-type")}
        groups, skipped = probe.load_lama_dataset(source, types, data_dir=args.data_dir)
    else:
        if args.lama_type:
            raise ValueError("--lama-type only applies to raw LAMA (--lama DIR, or a --tfds data set of LAMA facts)")
        groups = probe.load_typed_dataset(source, data_dir=args.data_dir)
    if args.relation:
        pick = {}
        for r in args.relation:
            hits = [g for g in groups if r in (g, g.split("/", 1)[1])]
            if not hits and r.split("/")[-1] not in skipped:
                raise ValueError(f"unknown relation {r!r}; known: {sorted(groups)}")
            pick.update({g: groups[g] for g in hits})
        wanted = {r.split("/")[-1] for r in args.relation}
        skipped = {r: why for r, why in skipped.items() if r in wanted}
        groups = pick
    elif pm.kind == "decoder":
        for g, ps in list(groups.items()):
            n_ok = sum(probe.decoder_qualifies(p.text) for p in ps)
            if n_ok <= len(ps) / 2:
                skipped[g] = (
                    f"not a next-token relation: only {n_ok} of {len(ps)} prompts have nothing but "
                    f"punctuation after [MASK] (e.g. {ps[0].text!r})"
                    if ps
                    else "no prompts"
                )
                del groups[g]
    return groups, skipped


def _tfds_prompts(args):
    """The --tfds split and whether it holds raw LAMA facts (else typed prompts), by its features."""
    from jsteer.data import sources

    split = sources.open_tfds(args.tfds, args.tfds_data_dir)
    have = set(split.features)
    if set(sources.TYPED_LAMA) <= have:
        return split, False
    if set(sources.LAMA) <= have:
        return split, True
    raise sources.DatasetError(
        f"tfds {split.spec} in {split.data_dir} has neither the typed-prompt features {list(sources.TYPED_LAMA)} "
        f"nor the LAMA fact features {list(sources.LAMA)} (it has {sorted(have)})"
    )


def _drop_unusable(groups: dict, pm, skipped: dict) -> dict:
    """Relations with no prompt the model can be asked (encoded as in evaluate) go to ``skipped``."""
    from jsteer.typevec import probe

    out = {}
    for g, ps in groups.items():
        exs, sk = probe.encode_prompts(ps, pm.tokenizer, pm.kind)
        if exs:
            out[g] = ps
        else:
            skipped[g] = f"no usable prompt of {len(ps)} ({sk.report()['by_reason']})"
    return out


def _probe_vectors(args, lm, pm, types) -> tuple[dict, dict]:
    """Each type's vector -> ({type: TE [D]}, report {"source", "used", "missing": {type: why}})."""
    import jax.numpy as jnp

    from jsteer.typevec import artifact, sampling

    if args.artifact:
        if args.first_token:
            raise ValueError("--first-token applies to vectors built from --kg, not to --artifact")
        tes_a, meta = artifact.load(args.artifact, model_identity=lm.identity)
        rows, missing = artifact.rows_for_types(meta, types, _pairs(args.artifact_type, "--artifact-type"))
        used = {
            t: {"name": meta["names"][i], "tokens": (meta.get("token_strings") or [[]] * len(tes_a))[i]}
            for t, i in rows.items()
        }
        return {t: jnp.asarray(tes_a[i]) for t, i in rows.items()}, {
            "source": str(args.artifact),
            "used": used,
            "missing": missing,
        }
    if args.artifact_type:
        raise ValueError("--artifact-type only applies with --artifact")
    vecs, samples, missing = sampling.available_type_vectors(
        pm.embedding(),
        lm.tokenizer,
        args.kg,
        types,
        strategy=args.strategy,
        n=args.n,
        seed=args.seed,
        first_token=args.first_token,
    )
    for t, s in samples.items():
        _log(f"{t}: {len(s.token_ids)} example tokens {list(s.tokens)} of {args.n} requested")
    return vecs, {"source": str(args.kg), "used": {t: s.report() for t, s in samples.items()}, "missing": missing}


def _probe(args) -> int:
    import numpy as np

    import jsteer
    from jsteer.typevec import probe, protocol

    t0 = time.time()
    lm = jsteer.load(args.model)
    pm = probe.from_lm(lm)
    groups, skipped = _probe_groups(args, pm)
    groups = _drop_unusable(groups, pm, skipped)
    types = sorted({k.split("/")[0] for k in groups})
    by_type, vec_report = _probe_vectors(args, lm, pm, types)
    for g, why in skipped.items():
        _log(f"skipped {g}: {why}")
    for t, why in vec_report["missing"].items():
        _log(f"warning: no type vector for {t} ({why}); its relations get B/BTo only and are left out of the macro")
    if not any(g.split("/")[0] in by_type for g in groups):
        why = {**skipped, **{g: vec_report["missing"][g.split("/")[0]] for g in groups}}
        raise ValueError(
            "nothing to probe: no relation has usable prompts and a type vector; "
            + "; ".join(f"{g}: {w}" for g, w in why.items())
        )
    _log(f"probing {len(groups)} relation(s); skipped {len(skipped)}")
    kind = _LAMBDA_UNITS[args.lambda_unit]
    if (kind == "resid" or args.layers) and args.mode != "layer":
        raise ValueError("--lambda-unit resid and --layers need --mode layer (TE in the residual stream)")
    if (kind == "resid" or args.layers) and not args.holdout > 0:
        raise ValueError("--lambda-unit resid and --layers are measured on the hold-out: give --holdout > 0")
    scale = float(np.mean(np.linalg.norm(np.asarray(pm.embedding()), axis=1))) if kind == "norm" else 1.0
    tes = {g: by_type[g.split("/")[0]] * scale for g in groups if g.split("/")[0] in by_type}
    lams = [float(x) for x in args.lambdas.split(",")]
    layer = args.layer if args.mode == "layer" else None
    selection, unit = None, 1.0
    if args.layers:
        candidates = [int(x) for x in args.layers.split(",")]
        selection = protocol.select_layer(
            pm,
            {g: groups[g] for g in tes},
            tes,
            candidates,
            lams,
            seed=args.seed,
            batch_size=args.batch_size,
            holdout=args.holdout,
            log=_log,
        )
        layer = selection["chosen"]
        _log(f"layer {layer} chosen on the hold-out of {candidates}")
    if kind == "resid":
        if layer is None:
            raise ValueError("--lambda-unit resid needs --layer or --layers")
        unit = protocol.lambda_unit(pm, "resid", layer, {g: groups[g] for g in tes}, args.seed, args.holdout)
        _log(f"lambda unit (resid, layer {layer}) = {unit:.4f}")
    rep = probe.evaluate(
        pm,
        groups,
        tes,
        mode=args.mode,
        lam_grid=lams,
        holdout=args.holdout,
        max_test=args.max_test,
        seed=args.seed,
        batch_size=args.batch_size,
        log=_log,
        layer=layer,
        lam_unit=unit,
        progress=True,
    )
    rep["lambda_unit"] = {"kind": kind, "scale": scale, **({"value": unit} if kind == "resid" else {})}
    if selection is not None:
        rep["layer_selection"] = selection
    rep["skipped_relations"] = skipped
    rep["type_vectors"] = vec_report
    _print_report(rep)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rep, indent=1))
        print(f"wrote {args.out}")
    macro = {f"{m} P@1": rep["macro"][m]["P@1"] for m in rep["macro"]}
    progress.summary("typevec probe", f"probed {len(groups)} relation(s)", time.time() - t0, args.out, **macro)
    return 0


def _print_report(rep: dict) -> None:
    """The P@1 table; relations left out of the macro are marked with '*'."""
    methods = list(rep["macro"])
    print(f"{'relation':28s} {'n':>5s} " + " ".join(f"{m + ' P@1':>10s}" for m in methods) + "  lambda")
    for g, r in rep["per_group"].items():
        if r["n_test"] == 0:
            continue
        vals = " ".join(f"{r[m]['P@1']:10.3f}" if m in r else f"{'-':>10s}" for m in methods)
        lam = rep["tuning"].get(g, {}).get("lambda", "-")
        lam = f"{lam} (untuned)" if r.get("untuned") else lam
        mark = "*" if g in rep["macro_excluded"] else " "
        print(f"{g + mark:28s} {r['n_test']:5d} {vals}  {lam}")
    n = len(rep["macro_relations"])
    print(f"{f'macro ({n} rel.)':28s} {'':5s} " + " ".join(f"{rep['macro'][m]['P@1']:10.3f}" for m in methods))
    if rep["macro_excluded"]:
        print("* not in the macro: " + "; ".join(f"{g}: {w}" for g, w in rep["macro_excluded"].items()))
