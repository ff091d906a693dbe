"""Type-mass diagnostic for Type Embeddings on a decoder (SmolLM2-135M): which sign, scale,
position and variant of TE moves next-token probability *towards the type*.

    .venv/bin/python experiments/typevec_diag_mass.py [--n 50]

For ``--n`` seeded prompts of City/place_of_death and of the type-switching set (date-of-birth
template, place-of-birth answers), and lambda in units of the mean input-embedding row norm,
it records: the softmax mass on the City token set (every single-token City KG entry, minus
the 10 examples that define TE), the mean gold log-probability and P@1/P@10, for TE and -TE,
TE at the predicting position ("pos") or at every prompt token ("all"), and the SVD, mean and
vocabulary-centred SVD variants. Writes experiments/results/typevec/diag_mass_smollm2.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from typevec_diag import DATA, OUT, seeded_batch  # noqa: E402  (sibling script)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--units", default="0,0.25,0.5,0.75,1,1.5,2")
    ap.add_argument("--sets", default="City/place_of_death,switch DoB->PoB")
    ap.add_argument("--configs", default="", help="only these mode/variant/sign keys, e.g. all/svd/+")
    ap.add_argument("--out", default="diag_mass_smollm2.json")
    args = ap.parse_args(argv)
    import jsteer
    import importlib

    from jsteer.typevec import core, probe, sampling
    inject = importlib.import_module("jsteer.typevec.inject")

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
    variants = {"svd": core.make(emb, ids), "mean": core.normalize(core.make(emb, ids, method="mean")),
                "centred_svd": core.make(emb, ids, center=core.vocab_center(emb))}
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    sets = {"City/place_of_death": groups["City/place_of_death"],
            "switch DoB->PoB": probe.switch_prompts(groups["City/place_of_birth"])}
    sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    only = set(filter(None, args.configs.split(",")))
    excluded, _, pad_id = probe._score_constants(pm, (0.0,))

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
    res = {"unit_mean_row_norm": unit, "lambda_units": units, "n_city_tokens": int(len(city_set)),
           "examples": list(s.labels), "sets": {}}
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
                        rows[f"{u:g}"] = {"type_mass": float(mass.mean()), "gold_logp": float(g.mean()),
                                          "P@1": float((rank < 1).mean()), "P@10": float((rank < 10).mean())}
                    out[key] = rows
                    print(sname, key, " ".join(f"{u}:{r['type_mass']:.3f}/{r['gold_logp']:.2f}/{r['P@1']:.2f}"
                                               for u, r in rows.items()), flush=True)
        res["sets"][sname] = out
        (OUT / args.out).write_text(json.dumps(res, indent=1))
    res["seconds"] = time.time() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
