"""Cheap diagnostics for Type Embeddings on SmolLM2-135M: which sign, scale, position, variant and
layer of TE helps a decoder. Each ``--mode`` uses ``--n`` seeded prompts and writes one JSON
under experiments/results/typevec/:

    .venv/bin/python experiments/typevec_diag.py [--relation City/place_of_death] [--n 50]    # diag_smollm2.json
    .venv/bin/python experiments/typevec_diag.py --mode mass [--n 50]                         # diag_mass_smollm2.json
    .venv/bin/python experiments/typevec_diag.py --mode mass --sets "switch DoB->PoB" \\
        --out diag_mass_switch_smollm2.json
    .venv/bin/python experiments/typevec_diag.py --mode layer [--configs 16+,22+,26+,26-,29+]  # diag_layer_smollm2.json

- ``precision`` (default): P@1/10/100 of one relation's prompts (the first ``--n`` of its pool,
  seeded) for TE variants (SVD +/-, mean, vocabulary-centred SVD, second singular vector) at the
  predicting position or every prompt token (``--positions``), lambda in units of the mean
  input-embedding row norm.
- ``mass``: for City/place_of_death and the type-switching set (date-of-birth template,
  place-of-birth answers; ``--sets``), the softmax mass on the City token set (every
  single-token City KG entry, minus the 10 examples that define TE), the mean gold
  log-probability and P@1/P@10, for TE and -TE, at the predicting position ("pos") or every
  prompt token ("all"), SVD / mean / vocabulary-centred SVD variants (``--configs``: only these
  mode/variant/sign keys, e.g. all/svd/+).
- ``layer``: TE added to the residual stream of the predicting position after decoder layer l
  (FiLM beta_out) instead of to the input embedding, lambda in units of the mean residual-stream
  norm at that layer (``--configs``: layer and sign, e.g. 26-). In a decoder the predicting
  position's *input* is the previous token, so an input-side TE says "the current token is a
  City"; late-layer residuals represent the *next* token, in the (tied) embedding space.

Formerly three scripts (typevec_diag.py, typevec_diag_mass.py, typevec_diag_layer.py); each mode
writes what its script wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.workspace import DATA, RESULTS

OUT = RESULTS / "typevec"

MODES = {  # mode -> its defaults
    "precision": dict(units="0,0.25,0.5,1,1.5,2,3,4,6", configs="", out="diag_smollm2.json"),
    "mass": dict(units="0,0.25,0.5,0.75,1,1.5,2", configs="", out="diag_mass_smollm2.json"),
    "layer": dict(units="0,0.1,0.2,0.35,0.5,0.75", configs="16+,22+,26+,26-,29+", out="diag_layer_smollm2.json"),
}


def seeded_batch(prompts, tok, n: int, pad_id: int, seed: int = 123):
    """The diagnostics' prompt sample: ``n`` seeded decoder examples of ``prompts``, right-padded.
    Returns (examples, ids [n, T], attention [n, T], predicting positions [n], gold ids [n])."""
    from jsteer.typevec import probe

    exs, _ = probe.encode_prompts(prompts, tok, "decoder")
    sel = np.sort(np.random.default_rng(seed).choice(len(exs), size=min(n, len(exs)), replace=False))
    exs = [exs[i] for i in sel]
    t = max(len(e.ids) for e in exs)
    ids = np.full((len(exs), t), pad_id, np.int32)
    attn = np.zeros((len(exs), t), np.int32)
    for b, e in enumerate(exs):
        ids[b, : len(e.ids)], attn[b, : len(e.ids)] = e.ids, 1
    return (
        exs,
        jnp.asarray(ids),
        jnp.asarray(attn),
        jnp.asarray([e.pos for e in exs], jnp.int32),
        jnp.asarray([e.gold for e in exs], jnp.int32),
    )


def run_precision(args) -> None:
    """P@k of TE variants on one relation (the former typevec_diag.py)."""
    import jsteer
    from jsteer.typevec import core, probe, sampling

    t0 = time.time()
    lm = jsteer.load("smollm2-135m")
    pm = probe.from_lm(lm)
    emb = pm.embedding().astype(jnp.float32)
    norms = np.asarray(jnp.linalg.norm(emb, axis=1))
    unit = float(norms.mean())
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    prompts = groups[args.relation]
    exs, _ = probe.encode_prompts(prompts, lm.tokenizer, "decoder")
    rng = np.random.default_rng(123)
    sel = np.sort(rng.choice(len(exs), size=min(args.n, len(exs)), replace=False))
    tname = args.relation.split("/")[0]
    s = sampling.sample_type(DATA / "type_embedding" / "kg_samples", tname, lm.tokenizer, n=10, seed=0)
    ids = jnp.asarray(s.token_ids)
    x = np.asarray(emb[ids])
    te_svd = core.make(emb, ids)  # unit, towards examples
    te_mean = core.make(emb, ids, method="mean")
    te_cent = core.make(emb, ids, center=core.vocab_center(emb))
    mu = np.asarray(emb.mean(0))
    _, sv, vt = np.linalg.svd(x, full_matrices=False)
    info = {
        "relation": args.relation,
        "n": len(sel),
        "examples": list(s.labels),
        "row_norm": {
            "mean": unit,
            "median": float(np.median(norms)),
            "min": float(norms.min()),
            "max": float(norms.max()),
            "example_rows_mean": float(np.linalg.norm(x, axis=1).mean()),
        },
        "vocab_mean_norm": float(np.linalg.norm(mu)),
        "cos_te_vocabmean": float(np.dot(np.asarray(te_svd), mu) / np.linalg.norm(mu)),
        "cos_te_examplemean": float(np.dot(np.asarray(te_svd), x.mean(0)) / np.linalg.norm(x.mean(0))),
        "mean_norm_examples": float(np.linalg.norm(x.mean(0))),
        "singular_values": [float(v) for v in sv],
        "numpy_vt0_dot_mean_sign": float(np.sign(vt[0] @ x.mean(0))),
        "seconds_load": time.time() - t0,
    }
    print(json.dumps(info, indent=1), flush=True)
    tes = {
        "svd+": te_svd,
        "svd-": -te_svd,
        "mean/|mean|": core.normalize(te_mean),
        "centred_svd": te_cent,
        "svd_v2+": core.orient(jnp.asarray(vt[1]), x.mean(0)),
    }
    units = [float(u) for u in args.units.split(",")]
    lams = np.asarray(units, np.float32) * unit
    te_table = jnp.stack(list(tes.values()))
    res = {}
    for mode in args.positions.split(","):
        for k, (name, _te) in enumerate(tes.items()):
            t1 = time.time()
            r = probe.score(pm, exs, sel, lams, [k] * len(sel), te_table, mode=mode, post_grid=(0.0,))
            tab = {f"{u:g}": probe.precision_at(r.rank[:, j]) for j, u in enumerate(units)}
            top = {f"{u:g}": [lm.tokenizer.decode([int(i)]) for i in r.top1[:6, j]] for j, u in enumerate(units)}
            res[f"{mode}/{name}"] = {"table": tab, "top1_first6": top}
            print(
                mode,
                name,
                f"{time.time() - t1:.1f}s",
                " ".join(
                    f"{u:g}:{tab[f'{u:g}']['P@1']:.2f}/{tab[f'{u:g}']['P@10']:.2f}/{tab[f'{u:g}']['P@100']:.2f}"
                    for u in units
                ),
                flush=True,
            )
    info["results"] = res
    info["lambda_units_of_mean_row_norm"] = units
    info["gold_first6"] = [exs[i].prompt.gold for i in sel[:6]]
    info["seconds"] = time.time() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.out).write_text(json.dumps(info, indent=1))


def run_mass(args) -> None:
    """Type mass, gold log-p and P@k of input-side TE (the former typevec_diag_mass.py)."""
    import jsteer
    from jsteer.typevec import core, inject, probe, sampling

    t0 = time.time()
    lm = jsteer.load("smollm2-135m")
    pm = probe.from_lm(lm)
    tok = lm.tokenizer
    emb = pm.embedding().astype(jnp.float32)
    unit = float(jnp.mean(jnp.linalg.norm(emb, axis=1)))
    kg = DATA / "type_embedding" / "kg_samples"
    s = sampling.sample_type(kg, "City", tok, n=10, seed=0)
    cands, _ = sampling.candidates(sampling.load_kg_samples(sampling.kg_path(kg, "City")), tok)
    city_set = np.array(sorted({c[1] for c in cands} - set(s.token_ids)))
    ids = jnp.asarray(s.token_ids)
    variants = {
        "svd": core.make(emb, ids),
        "mean": core.normalize(core.make(emb, ids, method="mean")),
        "centred_svd": core.make(emb, ids, center=core.vocab_center(emb)),
    }
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    sets = {
        "City/place_of_death": groups["City/place_of_death"],
        "switch DoB->PoB": probe.switch_prompts(groups["City/place_of_birth"]),
    }
    sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    only = set(filter(None, args.configs.split(",")))
    excluded, _, pad_id = probe.score_constants(pm, (0.0,))

    @jax.jit
    def stats(ids, attn, pos, gold, off):
        out = pm.forward(pm.params, ids, attn, jsteer.hooks.Hooks(embed_offset=off))
        h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]
        lg = jnp.where(excluded[None], -jnp.inf, pm.head(pm.params, h).astype(jnp.float32))
        lp = jax.nn.log_softmax(lg, axis=-1)
        g = jnp.take_along_axis(lp, gold[:, None], axis=1)[:, 0]
        rank = jnp.sum(lp > g[:, None], axis=1)
        mass = jnp.sum(jnp.exp(lp[:, city_set]), axis=1)
        return g, rank, mass

    units = [float(u) for u in args.units.split(",")]
    res = {
        "unit_mean_row_norm": unit,
        "lambda_units": units,
        "n_city_tokens": int(len(city_set)),
        "examples": list(s.labels),
        "sets": {},
    }
    for sname, prompts in sets.items():
        exs, a_ids, a_attn, pos, gold = seeded_batch(prompts, tok, args.n, pad_id)
        t = a_ids.shape[1]
        where = {"pos": inject.one_hot_positions(pos, t), "all": a_attn.astype(jnp.float32)}
        out = {}
        for mode, w in where.items():
            for vname, te in variants.items():
                for sign in (1.0, -1.0):
                    key = f"{mode}/{vname}/{'+' if sign > 0 else '-'}"
                    if only and key not in only:
                        continue
                    rows = {}
                    for u in units:
                        off = inject.offset(sign * te, u * unit, w)
                        g, rank, mass = (np.asarray(x) for x in stats(a_ids, a_attn, pos, gold, off))
                        rows[f"{u:g}"] = {
                            "type_mass": float(mass.mean()),
                            "gold_logp": float(g.mean()),
                            "P@1": float((rank < 1).mean()),
                            "P@10": float((rank < 10).mean()),
                        }
                    out[key] = rows
                    print(
                        sname,
                        key,
                        " ".join(
                            f"{u}:{r['type_mass']:.3f}/{r['gold_logp']:.2f}/{r['P@1']:.2f}" for u, r in rows.items()
                        ),
                        flush=True,
                    )
        res["sets"][sname] = out
        (OUT / args.out).write_text(json.dumps(res, indent=1))
    res["seconds"] = time.time() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.out).write_text(json.dumps(res, indent=1))


def run_layer(args) -> None:
    """TE in the residual stream after layer l (the former typevec_diag_layer.py)."""
    import jsteer
    from jsteer.hooks import FiLM, Hooks
    from jsteer.typevec import core, probe, sampling

    t0 = time.time()
    lm = jsteer.load("smollm2-135m")
    pm = probe.from_lm(lm)
    tok = lm.tokenizer
    emb = pm.embedding().astype(jnp.float32)
    kg = DATA / "type_embedding" / "kg_samples"
    s = sampling.sample_type(kg, "City", tok, n=10, seed=0)
    cands, _ = sampling.candidates(sampling.load_kg_samples(sampling.kg_path(kg, "City")), tok)
    city_set = np.array(sorted({c[1] for c in cands} - set(s.token_ids)))
    ids = jnp.asarray(s.token_ids)
    variants = {"svd": core.make(emb, ids), "centred_svd": core.make(emb, ids, center=core.vocab_center(emb))}
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    sets = {
        "City/place_of_death": groups["City/place_of_death"],
        "switch DoB->PoB": probe.switch_prompts(groups["City/place_of_birth"]),
    }
    excluded, _, pad_id = probe.score_constants(pm, (0.0,))
    layers = sorted({int(c[:-1]) for c in args.configs.split(",")})

    def stats(ids, attn, pos, gold, off, layer):
        t = ids.shape[1]
        where = (jnp.arange(t)[None, :] == pos[:, None]).astype(jnp.float32)
        hooks = Hooks(film={layer: FiLM(beta_out=where[:, :, None] * off[:, None, :])})
        out = pm.forward(pm.params, ids, attn, hooks)
        h = jnp.take_along_axis(out.hidden, pos[:, None, None], axis=1)[:, 0]
        lg = jnp.where(excluded[None], -jnp.inf, pm.head(pm.params, h).astype(jnp.float32))
        lp = jax.nn.log_softmax(lg, axis=-1)
        g = jnp.take_along_axis(lp, gold[:, None], axis=1)[:, 0]
        return g, jnp.sum(lp > g[:, None], axis=1), jnp.sum(jnp.exp(lp[:, city_set]), axis=1)

    stats = jax.jit(stats, static_argnames=("layer",))
    units = [float(u) for u in args.units.split(",")]
    res = {"lambda_units": units, "layers": layers, "sets": {}}
    for sname, prompts in sets.items():
        exs, a_ids, a_attn, pos, gold = seeded_batch(prompts, tok, args.n, pad_id)
        hs = pm.forward(pm.params, a_ids, a_attn, None, output_hidden_states=True).hidden_states
        norms = {li: float(jnp.mean(jnp.linalg.norm(hs[li + 1][jnp.arange(len(exs)), pos], axis=-1))) for li in layers}
        out = {"residual_norm": norms}
        for cfg in args.configs.split(","):
            layer, sign = int(cfg[:-1]), (1.0 if cfg[-1] == "+" else -1.0)
            vname, te = next(iter(variants.items()))  # the first (SVD) variant only
            rows = {}
            for u in units:
                off = jnp.broadcast_to(sign * u * norms[layer] * te, (len(exs), te.shape[0]))
                g, rank, mass = (np.asarray(x) for x in stats(a_ids, a_attn, pos, gold, off, layer=layer))
                rows[f"{u:g}"] = {
                    "type_mass": float(mass.mean()),
                    "gold_logp": float(g.mean()),
                    "P@1": float((rank < 1).mean()),
                    "P@10": float((rank < 10).mean()),
                }
            key = f"L{layer}/{vname}/{'+' if sign > 0 else '-'}"
            out[key] = rows
            print(
                sname,
                key,
                " ".join(
                    f"{u}:{r['type_mass']:.3f}/{r['gold_logp']:.2f}/{r['P@1']:.2f}/{r['P@10']:.2f}"
                    for u, r in rows.items()
                ),
                flush=True,
            )
        res["sets"][sname] = out
        (OUT / args.out).write_text(json.dumps(res, indent=1))
    res["seconds"] = time.time() - t0
    (OUT / args.out).write_text(json.dumps(res, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(MODES), default="precision", help="which diagnostic (see above)")
    ap.add_argument("--n", type=int, default=50, help="prompts per set")
    ap.add_argument("--units", default=None, help="lambda values, comma-separated (default: the mode's)")
    ap.add_argument("--out", default=None, help="JSON name under experiments/results/typevec (default: the mode's)")
    ap.add_argument("--relation", default="City/place_of_death", help="precision: the relation probed")
    ap.add_argument(
        "--positions",
        "--modes",
        dest="positions",
        default="pos,all",
        help="precision: TE at the predicting position (pos) and / or every prompt token (all)",
    )
    ap.add_argument("--sets", default="City/place_of_death,switch DoB->PoB", help="mass: the prompt sets")
    ap.add_argument(
        "--configs",
        default=None,
        help="mass: only these mode/variant/sign keys, e.g. all/svd/+; layer: layer and sign of TE "
        "(svd), e.g. 16+,26- (default: the mode's)",
    )
    args = ap.parse_args(argv)
    for k, v in MODES[args.mode].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    {"precision": run_precision, "mass": run_mass, "layer": run_layer}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
