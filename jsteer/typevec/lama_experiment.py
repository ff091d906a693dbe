"""The Type Embeddings LAMA experiment with SmolLM2-135M (paper Tables 4, 6, 7, 8).

``experiments/typevec_lama.py`` is its command line (:func:`main`; that script's docstring has the
full protocol and the commands of the committed ``lama_<tag>.json``); notebooks/type_embeddings.ipynb
renders the results with :func:`markdown` / :func:`plot` and reruns ``--small`` through :func:`main`.

- :func:`qualifying`: which LAMA relations a decoder can answer as the next token.
- :func:`run`: B / BTo / PostTE / TE per relation (:func:`jsteer.typevec.probe.evaluate`), lambda
  in :func:`jsteer.typevec.protocol.lambda_unit` units, the layer from
  :func:`jsteer.typevec.protocol.select_layer` for ``--mode layer --layers``.
- :func:`type_switching` (Table 6) with E_year from the ten digit tokens (:func:`year_examples`);
  :func:`rerun_switching` redoes only that part with a finished run's protocol.
- :func:`markdown` / :func:`plot`: the tables and figure of a result.

:data:`OUT` (``$JSTEER_OUT`` or ``experiments/results/typevec``) is where :func:`main` writes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax.numpy as jnp
import numpy as np

from jsteer.typevec.protocol import LAMBDA_UNITS, lambda_unit, select_layer
from jsteer.workspace import DATA, RESULTS, log, write_json

OUT = pathlib.Path(os.environ.get("JSTEER_OUT", RESULTS / "typevec"))
METHODS = ("B", "BTo", "PostTE", "TE")


def qualifying(groups, tokenizer) -> dict:
    """Per relation: prompts, how many a decoder can ask, how many have a single-token gold."""
    from jsteer.typevec import probe

    out = {}
    for name, prompts in groups.items():
        exs, sk = probe.encode_prompts(prompts, tokenizer, "decoder")
        n_q = sum(probe.decoder_qualifies(p.text) for p in prompts)
        out[name] = {
            "prompts": len(prompts),
            "answerable_as_next_token": n_q,
            "usable": len(exs),
            "qualifies": n_q > len(prompts) / 2 and len(exs) >= 20,
            "skips": sk.report()["by_reason"],
        }
    return out


def year_examples(tok, kg) -> tuple[list[int], list[str]]:
    """E_year's examples for a digit-splitting vocabulary -> (ids of "0".."9", their text).

    A year answer after "(born" is " " + one token per digit in SmolLM2; the " " token is in
    every answer and says nothing about years, and the first digits of the KG's years are
    just "1", "2", "3". The digit tokens are what years are made of, so all ten are the
    examples. Raises if a digit is not one token or a KG year label uses any other word token."""
    from jsteer.typevec import sampling

    ids = [sampling.single_token_id(tok, d, leading_space=False) for d in "0123456789"]
    if None in ids or len(set(ids)) != 10:
        raise ValueError(f"E_year: the digits are not ten single tokens in this vocabulary ({ids})")
    for e in sampling.load_kg_samples(sampling.kg_path(kg, "Year")):
        other = [
            i for i in sampling.encode_plain(tok, " " + e.label) if i not in ids and sampling.is_word_token(tok, i)
        ]
        if other:
            raise ValueError(
                f"E_year: KG year {e.label!r} has non-digit word tokens {other}; the digit "
                f"examples do not describe this vocabulary's years"
            )
    return ids, [sampling.decode_token(tok, i) for i in ids]


def type_switching(pm, groups, city, kg, *, mode, layer, lams, unit, max_switch, max_holdout, seed, batch_size) -> dict:
    """Table 6: place-of-birth facts asked with the date-of-birth template, with E_city and
    E_city^optim (E_city minus its projection on E_year, :func:`year_examples`)."""
    from jsteer.typevec import core, probe

    sw = probe.switch_prompts(groups["City/place_of_birth"])
    year_ids, year_tokens = year_examples(pm.tokenizer, kg)
    year = core.make(pm.embedding(), jnp.asarray(year_ids))
    city_opt = core.project_out(city, year)
    switch = {
        "prompt_example": sw[0].text,
        "gold_example": sw[0].gold,
        "year_examples": "the ten digit tokens (every KG year is ' ' + its digit tokens)",
        "year_tokens": year_tokens,
        "year_token_ids": year_ids,
        "cos_city_year": float(jnp.vdot(city, year)),
    }
    for label, te in (("E_city", city), ("E_city_optim", city_opt)):
        r = probe.evaluate(
            pm,
            {"DoB->PoB": sw},
            {"DoB->PoB": te},
            mode=mode,
            lam_grid=lams,
            holdout=0.05,
            max_test=max_switch,
            max_holdout=max_holdout,
            seed=seed,
            batch_size=batch_size,
            methods=("B", "TE"),
            log=log,
            layer=layer,
            lam_unit=unit,
        )
        switch[label] = {
            "B": r["per_group"]["DoB->PoB"]["B"],
            "TE": r["per_group"]["DoB->PoB"]["TE"],
            "lambda": r["tuning"]["DoB->PoB"]["lambda"],
            "lambda_table": r["tuning"]["DoB->PoB"]["lambda_table"],
            "n_test": r["per_group"]["DoB->PoB"]["n_test"],
            "skips": r["skips"]["DoB->PoB"],
            "predictions": r["predictions"]["DoB->PoB"],
        }
        log(
            label,
            json.dumps(
                {"B": switch[label]["B"]["P@1"], "TE": switch[label]["TE"]["P@1"], "lambda": switch[label]["lambda"]}
            ),
        )
    return switch


def switch_targets(switch: dict) -> dict:
    return {
        "switch_P@1_optim": switch["E_city_optim"]["TE"]["P@1"],
        "switch_ge_0.10": max(switch["E_city"]["TE"]["P@1"], switch["E_city_optim"]["TE"]["P@1"]) >= 0.10,
    }


def rerun_switching(args, path: pathlib.Path) -> dict:
    """``--switch-only``: Table 6 again with the protocol recorded in ``path`` (a full run's
    JSON); returns that result with ``type_switching`` and its targets replaced."""
    import jsteer
    from jsteer.typevec import probe, sampling

    if not path.is_file():
        raise FileNotFoundError(f"--switch-only needs a full run's {path}; run without --switch-only first")
    res = json.loads(path.read_text())
    pr = res["protocol"]
    lm = jsteer.load("smollm2-135m")
    if lm.identity != res["identity"]:
        raise ValueError(f"{path} was made with model {res['identity']}, not {lm.identity}")
    pm = probe.from_lm(lm)
    kg = DATA / "type_embedding" / "kg_samples"
    city = sampling.type_vectors(pm.embedding(), lm.tokenizer, kg, ["City"], n=10, seed=pr["seed"])[0][0]
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    res["type_switching"] = type_switching(
        pm,
        groups,
        city,
        kg,
        mode=pr["mode"],
        layer=pr["layer"],
        lams=pr["lambda_grid"],
        unit=pr["lambda_unit_value"],
        max_switch=pr["max_switch"],
        max_holdout=args.max_holdout,
        seed=pr["seed"],
        batch_size=args.batch_size,
    )
    res["targets"].update(switch_targets(res["type_switching"]))
    pr["deviations"] = [d for d in pr["deviations"] if not d.startswith("E_year")] + [YEAR_DEVIATION]
    return res


YEAR_DEVIATION = "E_year from the ten digit tokens (SmolLM2 writes a year as ' ' + one token per digit)"


def run(args) -> dict:
    import jsteer
    from jsteer.typevec import probe, sampling

    t0 = time.time()
    lm = jsteer.load("smollm2-135m")
    pm = probe.from_lm(lm)
    tok = lm.tokenizer
    groups = probe.load_typed_dataset(DATA / "type_embedding" / "processed_lama")
    if args.relations:
        wanted = args.relations.split(",")
        unknown = [r for r in wanted if r not in groups]
        if unknown:
            raise ValueError(f"unknown relations {unknown}")
        qual = qualifying({g: groups[g] for g in wanted}, tok)
    else:
        qual = qualifying(groups, tok)
    names = [g for g, q in qual.items() if q["qualifies"]]
    log(f"{len(names)} of {len(groups)} relations qualify for the decoder: {names}")
    types = sorted({g.split("/")[0] for g in names})
    kg = DATA / "type_embedding" / "kg_samples"
    tes_k, samples = sampling.type_vectors(pm.embedding(), tok, kg, types, n=10, seed=args.seed)
    by_type = dict(zip(types, tes_k))
    lams = [float(x) for x in args.lambdas.split(",")]
    layer = args.layer if args.mode == "layer" else None
    selection = None
    if args.mode == "layer" and args.layers:
        selection = select_layer(
            pm,
            {g: groups[g] for g in names},
            {g: by_type[g.split("/")[0]] for g in names},
            [int(x) for x in args.layers.split(",")],
            lams,
            seed=args.seed,
            batch_size=args.batch_size,
            max_holdout=args.max_holdout,
            log=log,
        )
        layer = selection["chosen"]
    unit = lambda_unit(pm, args.lambda_unit, layer, {g: groups[g] for g in names}, args.seed)
    log(f"lambda unit ({args.lambda_unit}) = {unit:.4f}")
    rep = probe.evaluate(
        pm,
        {g: groups[g] for g in names},
        {g: by_type[g.split("/")[0]] for g in names},
        mode=args.mode,
        lam_grid=lams,
        holdout=0.05,
        max_test=args.max_test,
        max_holdout=args.max_holdout,
        seed=args.seed,
        batch_size=args.batch_size,
        log=log,
        layer=layer,
        lam_unit=unit,
    )
    log("macro", json.dumps({m: rep["macro"][m]["P@1"] for m in METHODS}))

    # ---------------------------------------------------------------- type switching (Table 6)
    switch = type_switching(
        pm,
        groups,
        by_type["City"],
        kg,
        mode=args.mode,
        layer=layer,
        lams=lams,
        unit=unit,
        max_switch=args.max_switch,
        max_holdout=args.max_holdout,
        seed=args.seed,
        batch_size=args.batch_size,
    )

    b1, te1 = rep["macro"]["B"]["P@1"], rep["macro"]["TE"]["P@1"]
    return {
        "model": "smollm2-135m",
        "identity": lm.identity,
        "seconds": time.time() - t0,
        "protocol": {
            "mode": args.mode,
            "layer": layer,
            "lambda_unit": args.lambda_unit,
            "lambda_unit_value": unit,
            "lambda_grid": lams,
            "post_grid": rep["post_grid"],
            "holdout": 0.05,
            "max_test_per_relation": args.max_test,
            "max_switch": args.max_switch,
            "seed": args.seed,
            "layer_selection": selection,
            "type_examples": "10 per type, weighted by KG degree, single-token (leading-space) entries",
            "tuning": "per relation, best hold-out P@1; ties: mean P@10/50/100, then smaller value",
            "deviations": [
                "decoder instead of BERT: the answer is the next token after the prompt cut before [MASK]",
                "TE at the predicting position (the last prompt token) since a decoder has no [MASK] slot"
                + (
                    f"; mode 'layer': in the residual stream after layer {layer}, not the input embedding"
                    if layer is not None
                    else ""
                ),
                f"lambda grid in units of '{args.lambda_unit}' ({unit:.4f}), not the paper's absolute 0..5",
                "reported prompts subsampled to max_test per relation (CPU budget)",
                YEAR_DEVIATION,
            ],
        },
        "qualifying": qual,
        "relations": names,
        "type_samples": {s.type_name: s.report() for s in samples},
        "probe": rep,
        "type_switching": switch,
        "targets": {
            "TE_over_B_P@1": (te1 / b1) if b1 > 0 else None,
            "TE_ge_1.25x_B": te1 >= 1.25 * b1,
            "TE_beats_BTo": te1 > rep["macro"]["BTo"]["P@1"],
            "TE_beats_PostTE": te1 > rep["macro"]["PostTE"]["P@1"],
            **switch_targets(switch),
        },
    }


def layer_selection_md(sel) -> list:
    if not sel:
        return []
    lines = [
        "## Layer chosen on the hold-out",
        "",
        f"Rule: {sel['rule']}.",
        "",
        "| layer | hold-out macro P@1 | P@10 | lambda unit |",
        "|---:|---:|---:|---:|",
    ]
    for layer in sel["candidates"]:
        t = sel["per_layer"][str(layer)]
        mark = " **(chosen)**" if layer == sel["chosen"] else ""
        lines.append(
            f"| {layer}{mark} | {t['holdout_macro']['P@1']:.3f} | {t['holdout_macro']['P@10']:.3f} | "
            f"{t['lambda_unit_value']:.1f} |"
        )
    return lines + [""]


def markdown(res: dict) -> str:
    rep = res["probe"]
    lines = [
        "# Type Embeddings on LAMA - SmolLM2-135M (decoder)",
        "",
        f"TE mode: `{res['protocol']['mode']}`"
        + (f" (layer {res['protocol']['layer']})" if res["protocol"].get("layer") is not None else "")
        + f"; lambda grid {res['protocol']['lambda_grid']}"
        + (
            f" in units of `{res['protocol']['lambda_unit']}` = {res['protocol']['lambda_unit_value']:.3f}"
            if "lambda_unit" in res["protocol"]
            else ""
        )
        + " tuned per relation "
        f"on a 5% hold-out; at most {res['protocol']['max_test_per_relation']} reported prompts per relation.",
        "",
        *layer_selection_md(res["protocol"].get("layer_selection")),
        "## P@1 / P@10 per relation (paper Tables 4, 7, 8)",
        "",
        "| relation | n | "
        + " | ".join(f"{m} P@1" for m in METHODS)
        + " | "
        + " | ".join(f"{m} P@10" for m in METHODS)
        + " | lambda | w | BTo form |",
        "|---|---:|" + "---:|" * (2 * len(METHODS)) + "---:|---:|---|",
    ]
    for g in res["relations"]:
        r = rep["per_group"][g]
        t = rep["tuning"][g]
        lines.append(
            f"| {g} | {r['n_test']} | "
            + " | ".join(f"{r[m]['P@1']:.3f}" for m in METHODS)
            + " | "
            + " | ".join(f"{r[m]['P@10']:.3f}" for m in METHODS)
            + f" | {t['lambda']:g} | {t['post_weight']:g} | "
            f"{r.get('BTo_form', '')} |"
        )
    lines.append(
        "| **macro** | | "
        + " | ".join(f"**{rep['macro'][m]['P@1']:.3f}**" for m in METHODS)
        + " | "
        + " | ".join(f"{rep['macro'][m]['P@10']:.3f}" for m in METHODS)
        + " | | | |"
    )
    forms = rep.get("bto_forms", [])
    if len(forms) > 1:
        lines += [
            "",
            "BTo phrasing, hold-out macro P@1 per form (the form used per relation is its hold-out best):",
            "",
            "| form | hold-out macro P@1 | relations using it |",
            "|---|---:|---:|",
        ]
        for f in forms:
            hold = [
                rep["tuning"][g]["bto_table"][f]["P@1"] for g in res["relations"] if "bto_table" in rep["tuning"][g]
            ]
            used = sum(rep["per_group"][g].get("BTo_form") == f for g in res["relations"])
            lines.append(f"| {f} [MASK] | {np.mean(hold):.3f} | {used} |")
    lines += ["", "## Macro P@k", "", "| method | P@1 | P@10 | P@50 | P@100 |", "|---|---:|---:|---:|---:|"]
    for m in METHODS:
        p = rep["macro"][m]
        lines.append(f"| {m} | {p['P@1']:.3f} | {p['P@10']:.3f} | {p['P@50']:.3f} | {p['P@100']:.3f} |")
    sw = res["type_switching"]
    lines += [
        "",
        "## Type switching (paper Table 6): date-of-birth prompts, place-of-birth answers",
        "",
        f"Example: `{sw['prompt_example']}` -> {sw['gold_example']}; "
        f"cos(E_city, E_year) = {sw['cos_city_year']:.3f}; "
        f"E_year from the tokens {sw['year_tokens']}",
        "",
        "| vector | lambda | n | B P@1 | TE P@1 | B P@10 | TE P@10 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k in ("E_city", "E_city_optim"):
        s = sw[k]
        lines.append(
            f"| {k} | {s['lambda']:g} | {s['n_test']} | {s['B']['P@1']:.3f} | {s['TE']['P@1']:.3f} | "
            f"{s['B']['P@10']:.3f} | {s['TE']['P@10']:.3f} |"
        )
    tg = res["targets"]
    lines += [
        "",
        "## Targets",
        "",
        "```",
        json.dumps(tg, indent=1),
        "```",
        "",
        "Relations that qualify for a decoder (answer = next token) and usable prompts:",
        "",
    ]
    for g, q in res["qualifying"].items():
        lines.append(
            f"- {g}: {'yes' if q['qualifies'] else 'no'} ({q['usable']} usable of {q['prompts']}; skips {q['skips']})"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = res["probe"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ks = ["P@1", "P@10", "P@50", "P@100"]
    x = np.arange(len(ks))
    for i, m in enumerate(METHODS):
        axes[0].bar(x + (i - 1.5) * 0.2, [rep["macro"][m][k] for k in ks], 0.2, label=m)
    axes[0].set_xticks(x, ks)
    axes[0].set_title("SmolLM2-135M, LAMA macro precision")
    axes[0].legend()
    rels = res["relations"]
    xr = np.arange(len(rels))
    for i, m in enumerate(METHODS):
        axes[1].bar(xr + (i - 1.5) * 0.2, [rep["per_group"][g][m]["P@1"] for g in rels], 0.2, label=m)
    axes[1].set_xticks(xr, rels, rotation=75, fontsize=7)
    axes[1].set_title("P@1 per relation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None, description: str | None = None) -> int:
    """The command line of ``experiments/typevec_lama.py`` (``description``: its ``--help`` text):
    runs the experiment and writes ``lama_<tag>.json`` / ``.md`` / ``.png`` under :data:`OUT`,
    read when called (the notebook points it elsewhere)."""
    ap = argparse.ArgumentParser(
        description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--max-test", type=int, default=100)
    ap.add_argument("--max-switch", type=int, default=300)
    ap.add_argument("--mode", choices=("pos", "all", "layer"), default="pos")
    ap.add_argument("--layer", type=int, default=None, help="decoder layer for --mode layer")
    ap.add_argument(
        "--layers",
        default=None,
        help="--mode layer: comma-separated candidate layers, one chosen on the hold-out (overrides --layer)",
    )
    ap.add_argument("--lambda-unit", choices=LAMBDA_UNITS, default="row_norm")
    ap.add_argument("--lambdas", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.75,0.9,1.0,1.25,1.5")
    ap.add_argument("--relations", default=None, help="comma-separated subset (default: all that qualify)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-holdout", type=int, default=None, help="cap the 5%% hold-out (tiny runs only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--small",
        action="store_true",
        help="tiny run (2 relations, 8 test / 8 switching / 8 hold-out prompts, lambda 0 / 0.75) for CI / notebooks",
    )
    ap.add_argument("--tag", default="smollm2")
    ap.add_argument(
        "--switch-only",
        action="store_true",
        help="re-run only type switching (Table 6) on the existing lama_<tag>.json, with its protocol",
    )
    args = ap.parse_args(argv)
    if args.small or os.environ.get("JSTEER_SMALL") == "1":
        args.max_test, args.max_switch, args.max_holdout = 8, 8, 8
        args.relations = args.relations or "City/P36,Country/P1376"
        args.lambdas = "0,0.75"
        args.batch_size = 16
        args.tag = args.tag + "_small"
    res = rerun_switching(args, OUT / f"lama_{args.tag}.json") if args.switch_only else run(args)
    OUT.mkdir(parents=True, exist_ok=True)
    write_json(OUT / f"lama_{args.tag}.json", res)
    (OUT / f"lama_{args.tag}.md").write_text(markdown(res))
    plot(res, OUT / f"lama_{args.tag}.png")
    log(f"wrote {OUT}/lama_{args.tag}.{{json,md,png}}")
    return 0
