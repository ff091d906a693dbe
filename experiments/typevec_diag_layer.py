"""Layer diagnostic: TE added to the residual stream of the predicting position after decoder
layer l (FiLM beta_out), instead of to the input embedding. In a decoder the predicting
position's *input* is the previous token, so an input-side TE says "the current token is a
City"; late-layer residuals represent the *next* token, in the (tied) embedding space.

    .venv/bin/python experiments/typevec_diag_layer.py [--n 50] [--configs 16+,22+,26+,26-,29+]

lambda is in units of the mean residual-stream norm at that layer (predicting position).
Writes experiments/results/typevec/diag_layer_smollm2.json.
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
    ap.add_argument("--units", default="0,0.1,0.2,0.35,0.5,0.75")
    ap.add_argument("--configs", default="16+,22+,26+,26-,29+", help="layer and sign of TE (svd)")
    args = ap.parse_args(argv)
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
    sets = {"City/place_of_death": groups["City/place_of_death"],
            "switch DoB->PoB": probe.switch_prompts(groups["City/place_of_birth"])}
    excluded, _, pad_id = probe._score_constants(pm, (0.0,))
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
        norms = {l: float(jnp.mean(jnp.linalg.norm(hs[l + 1][jnp.arange(len(exs)), pos], axis=-1))) for l in layers}
        out = {"residual_norm": norms}
        for cfg in args.configs.split(","):
            layer, sign = int(cfg[:-1]), (1.0 if cfg[-1] == "+" else -1.0)
            vname, te = next(iter(variants.items()))  # the first (SVD) variant only
            rows = {}
            for u in units:
                off = jnp.broadcast_to(sign * u * norms[layer] * te, (len(exs), te.shape[0]))
                g, rank, mass = (np.asarray(x) for x in stats(a_ids, a_attn, pos, gold, off, layer=layer))
                rows[f"{u:g}"] = {"type_mass": float(mass.mean()), "gold_logp": float(g.mean()),
                                  "P@1": float((rank < 1).mean()), "P@10": float((rank < 10).mean())}
            key = f"L{layer}/{vname}/{'+' if sign > 0 else '-'}"
            out[key] = rows
            print(sname, key, " ".join(f"{u}:{r['type_mass']:.3f}/{r['gold_logp']:.2f}/{r['P@1']:.2f}/{r['P@10']:.2f}"
                                       for u, r in rows.items()), flush=True)
        res["sets"][sname] = out
        (OUT / "diag_layer_smollm2.json").write_text(json.dumps(res, indent=1))
    res["seconds"] = time.time() - t0
    (OUT / "diag_layer_smollm2.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
