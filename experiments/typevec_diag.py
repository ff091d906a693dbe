"""Cheap diagnostics for Type Embeddings on SmolLM2-135M: sign, scale, position, variant.

    .venv/bin/python experiments/typevec_diag.py [--relation City/place_of_death] [--n 50]

Uses only the first ``--n`` prompts of one relation's *hold-out-free* pool (seeded) and
writes experiments/results/typevec/diag_smollm2.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
OUT = ROOT / "experiments" / "results" / "typevec"


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
        ids[b, :len(e.ids)], attn[b, :len(e.ids)] = e.ids, 1
    return (exs, jnp.asarray(ids), jnp.asarray(attn), jnp.asarray([e.pos for e in exs], jnp.int32),
            jnp.asarray([e.gold for e in exs], jnp.int32))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--relation", default="City/place_of_death")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--units", default="0,0.25,0.5,1,1.5,2,3,4,6")
    ap.add_argument("--modes", default="pos,all")
    ap.add_argument("--out", default="diag_smollm2.json")
    args = ap.parse_args(argv)
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
    te_svd = core.make(emb, ids)                      # unit, towards examples
    te_mean = core.make(emb, ids, method="mean")
    te_cent = core.make(emb, ids, center=core.vocab_center(emb))
    mu = np.asarray(emb.mean(0))
    _, sv, vt = np.linalg.svd(x, full_matrices=False)
    info = {"relation": args.relation, "n": len(sel), "examples": list(s.labels),
            "row_norm": {"mean": unit, "median": float(np.median(norms)), "min": float(norms.min()),
                         "max": float(norms.max()), "example_rows_mean": float(np.linalg.norm(x, axis=1).mean())},
            "vocab_mean_norm": float(np.linalg.norm(mu)),
            "cos_te_vocabmean": float(np.dot(np.asarray(te_svd), mu) / np.linalg.norm(mu)),
            "cos_te_examplemean": float(np.dot(np.asarray(te_svd), x.mean(0)) / np.linalg.norm(x.mean(0))),
            "mean_norm_examples": float(np.linalg.norm(x.mean(0))),
            "singular_values": [float(v) for v in sv],
            "numpy_vt0_dot_mean_sign": float(np.sign(vt[0] @ x.mean(0))),
            "seconds_load": time.time() - t0}
    print(json.dumps(info, indent=1), flush=True)
    tes = {"svd+": te_svd, "svd-": -te_svd, "mean/|mean|": core.normalize(te_mean),
           "centred_svd": te_cent, "svd_v2+": core.orient(jnp.asarray(vt[1]), x.mean(0))}
    units = [float(u) for u in args.units.split(",")]
    lams = np.asarray(units, np.float32) * unit
    te_table = jnp.stack(list(tes.values()))
    res = {}
    for mode in args.modes.split(","):
        for k, (name, te) in enumerate(tes.items()):
            t1 = time.time()
            r = probe.score(pm, exs, sel, lams, [k] * len(sel), te_table, mode=mode, post_grid=(0.0,))
            tab = {f"{u:g}": probe.precision_at(r.rank[:, j]) for j, u in enumerate(units)}
            top = {f"{u:g}": [lm.tokenizer.decode([int(i)]) for i in r.top1[:6, j]] for j, u in enumerate(units)}
            res[f"{mode}/{name}"] = {"table": tab, "top1_first6": top}
            print(mode, name, f"{time.time()-t1:.1f}s", " ".join(
                f"{u:g}:{tab[f'{u:g}']['P@1']:.2f}/{tab[f'{u:g}']['P@10']:.2f}/{tab[f'{u:g}']['P@100']:.2f}"
                for u in units), flush=True)
    info["results"] = res
    info["lambda_units_of_mean_row_norm"] = units
    info["gold_first6"] = [exs[i].prompt.gold for i in sel[:6]]
    info["seconds"] = time.time() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.out).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
