"""How far type switching (paper Table 6) can go on SmolLM2-135M: the same subjects asked directly.

Type switching asks Google-RE place-of-birth facts with the date-of-birth template
("Khatchig Mouradian (born [MASK]).", gold "Lebanon") and scores the place by P@1. The TE can
make the model answer *a* city; it must also be the right one, which the model can only do if
it knows the subject's birthplace. This script asks the same subjects with the place-of-birth
template itself ("Khatchig Mouradian was born in [MASK].") under the switching run's protocol:
the same group name (so the same seeded 5% hold-out and reported subsample), the same E_city,
the same TE placement and lambda unit (read from the switching run's JSON), B / PostTE / TE.
Its P@1 is what the model knows when it is asked the right question: an estimate of the most
that switching the question's type can recover.

    .venv/bin/python experiments/typevec_switch_ceiling.py [--run lama_smollm2_layersel.json]

Writes experiments/results/typevec/switch_ceiling_smollm2.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from jsteer.workspace import DATA, RESULTS, log, write_json

OUT = pathlib.Path(os.environ.get("JSTEER_OUT", RESULTS / "typevec"))  # as typevec_lama.py's

GROUP = "DoB->PoB"  # the switching run's group name: it seeds the hold-out split


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default="lama_smollm2_layersel.json", help="the switching run (under the results dir)")
    ap.add_argument("--out", default=str(OUT / "switch_ceiling_smollm2.json"))
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    import jsteer
    from jsteer.typevec import probe, sampling

    run = json.loads((OUT / a.run).read_text())
    pr, sw_run = run["protocol"], run["type_switching"]
    t0 = time.time()
    lm = jsteer.load("smollm2-135m")
    pm = probe.from_lm(lm)
    pob = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")["City/place_of_birth"]
    tes, samples = sampling.type_vectors(
        pm.embedding(), lm.tokenizer, DATA / "type_embedding" / "kg_samples", ["City"], n=10, seed=pr["seed"]
    )
    if list(samples[0].token_ids) != run["type_samples"]["City"]["token_ids"]:
        raise SystemExit("the City examples differ from the switching run's")
    pairs = [(p, probe.switch_prompts([p])) for p in pob]
    asked = [p for p, q in pairs if q]  # aligned 1:1 with the switching prompts
    as_switched = {p.text: q[0].text for p, q in pairs if q}
    common = dict(
        mode=pr["mode"],
        layer=pr["layer"],
        lam_grid=pr["lambda_grid"],
        post_grid=pr["post_grid"],
        holdout=pr["holdout"],
        max_test=pr["max_switch"],
        seed=pr["seed"],
        batch_size=a.batch_size,
        lam_unit=pr["lambda_unit_value"],
        log=log,
    )
    rep = probe.evaluate(pm, {GROUP: asked}, {GROUP: tes[0]}, methods=("B", "PostTE", "TE"), **common)
    # the reported subjects must be the switching run's
    switched = [p["prompt"] for p in sw_run["E_city"]["predictions"]]
    here = [as_switched[p["prompt"]] for p in rep["predictions"][GROUP]]
    if switched != here:
        raise SystemExit(f"reported subjects differ from the switching run's ({len(here)} vs {len(switched)})")
    g = rep["per_group"][GROUP]
    res = {
        "run": a.run,
        "protocol": {k: v for k, v in common.items() if k != "log"},
        "n_test": g["n_test"],
        "city_examples": list(samples[0].labels),
        "subjects_match_switching_run": True,
        "direct": {m: g[m] for m in ("B", "PostTE", "TE")},
        "tuning": rep["tuning"][GROUP],
        "switching": {
            k: {"B": sw_run[k]["B"], "TE": sw_run[k]["TE"], "lambda": sw_run[k]["lambda"]}
            for k in ("E_city", "E_city_optim")
        },
        "seconds": time.time() - t0,
    }
    write_json(pathlib.Path(a.out), res)
    rows = [
        ("place-of-birth template, B", res["direct"]["B"]),
        ("place-of-birth template, PostTE", res["direct"]["PostTE"]),
        ("place-of-birth template, TE", res["direct"]["TE"]),
    ]
    rows += [
        (f"date-of-birth template, {k}, TE (switching)", res["switching"][k]["TE"]) for k in ("E_city", "E_city_optim")
    ]
    print(f"| question (same {res['n_test']} subjects) | P@1 | P@10 | P@100 |\n|---|---:|---:|---:|")
    for name, m in rows:
        print(f"| {name} | {m['P@1']:.3f} | {m['P@10']:.3f} | {m['P@100']:.3f} |")


if __name__ == "__main__":
    main()
