"""LAMA cloze probing with type embeddings: the methods, their tuning and P@k.

Data and encoding live in :mod:`jsteer.typevec.lama`, batched jitted scoring in
:mod:`jsteer.typevec.scoring`; this module re-exports their names, so ``probe.X`` keeps
working for all of them. Results are P@k over the gold's rank among non-special tokens
(rank 0: the top prediction), per group and macro-averaged.

Methods (paper, Tables 4/7/8)
  * B: plain prompt; * BTo: type words before the answer, "the <type> [MASK]" (the paper's)
    or "the <type> of [MASK]" / "the <type> called [MASK]" (:data:`BTO_FORMS`), the form tuned
    per relation on the hold-out like TE's lambda (a decoder rarely continues "... born in the
    city" with the name, so the paper's form alone makes BTo a straw man there);
  * PostTE: scores + w * cos(E_v, TE), w tuned on the hold-out over 0..30;
  * TE: lambda * TE added at the [MASK] (MLM) / predicting position or all prompt tokens
    (decoders), lambda tuned on a 5% hold-out over 0..5 and reported on the rest.
    Decoders also have ``mode="layer"`` (not in the paper): lambda * TE added to the residual
    stream of the predicting position after decoder layer ``layer`` (see
    :mod:`jsteer.typevec.inject`). ``lam_unit`` rescales the grid (lambda_abs = value * unit)
    so a grid can be given in units of the embedding-row norm or of the residual norm.
  Tuning picks the best hold-out P@1, ties broken by the mean of P@10/50/100, then the smaller
  value. (The paper's script picks the smallest lambda reaching the largest gain in *any*
  P@k; we tune for P@1, the headline metric.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import zlib
from typing import Callable, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jsteer.progress import bar as progress_bar
from jsteer.progress import callback as progress_callback
from jsteer.typevec.lama import (  # noqa: F401  (re-exported: probe.X is the public path)
    BTO_FORMS,
    GOOGLE_RE_TEMPLATES,
    LAMA_TYPES,
    MASK,
    Example,
    Prompt,
    Skips,
    bto_text,
    decoder_prefix,
    decoder_qualifies,
    encode_prompts,
    fill_template,
    load_lama_dataset,
    load_lama_jsonl,
    load_relations,
    load_typed_csv,
    load_typed_dataset,
    mask_token,
    mlm_text,
)
from jsteer.typevec.scoring import (  # noqa: F401
    POST_GRID,
    GridResult,
    ProbeModel,
    RowResult,
    check_mode,
    for_bert_mlm,
    for_decoder,
    from_lm,
    score,
    score_constants,
    score_grid,
    score_rows,
)

Array = jnp.ndarray

KS = (1, 10, 50, 100)
LAMBDA_GRID = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)

# ----------------------------------------------------------------------------- metrics & tuning


def precision_at(ranks: Sequence[int] | np.ndarray, ks: Sequence[int] = KS) -> dict[str, float]:
    """{"P@k": fraction of ranks < k}; rank 0 = the gold is the top prediction."""
    ranks = np.asarray(ranks)
    if ranks.size == 0:
        return {f"P@{k}": float("nan") for k in ks}
    return {f"P@{k}": float(np.mean(ranks < k)) for k in ks}


def macro(per_group: Mapping[str, Mapping[str, float]], ks: Sequence[int] = KS) -> dict[str, float]:
    """Unweighted mean over groups of each P@k (groups with no examples are left out)."""
    out = {}
    for k in ks:
        vals = [v[f"P@{k}"] for v in per_group.values() if not math.isnan(v[f"P@{k}"])]
        out[f"P@{k}"] = float(np.mean(vals)) if vals else float("nan")
    return out


def choose(values: Sequence[float], ranks_per_value: Sequence[np.ndarray]) -> tuple[float, dict]:
    """Best value by P@1, then mean(P@10, P@50, P@100), then the smaller value."""
    best, best_key, table = None, None, {}
    for v, rk in zip(values, ranks_per_value):
        p = precision_at(rk)
        table[str(v)] = p
        key = (p["P@1"], (p["P@10"] + p["P@50"] + p["P@100"]) / 3.0, -v)
        if best_key is None or key > best_key:
            best, best_key = v, key
    return float(best), table


def split_holdout(n: int, frac: float, seed: int, group: str) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic per-group split -> (holdout idx, rest idx); at least 1 hold-out when n >= 2
    and frac > 0; none when frac == 0."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"hold-out fraction must be in [0, 1), got {frac}")
    rng = np.random.default_rng([seed, zlib.crc32(group.encode())])
    perm = rng.permutation(n)
    h = 0 if n < 2 or frac == 0 else max(1, int(round(frac * n)))
    return np.sort(perm[:h]), np.sort(perm[h:])


# ----------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class GroupData:
    examples: list[Example]
    bto: list[list[Optional[int]]]  # per BTo form, per example: index into the BTo examples (None: skipped)
    holdout: np.ndarray  # global example indices
    test: np.ndarray
    offset: int  # global index of this group's first example


def evaluate(
    model: ProbeModel,
    groups: Mapping[str, Sequence[Prompt]],
    tes: Mapping[str, Array],
    *,
    type_names: Optional[Mapping[str, str]] = None,
    mode: str = "pos",
    lam_grid: Sequence[float] = LAMBDA_GRID,
    post_grid: Sequence[float] = POST_GRID,
    holdout: float = 0.05,
    max_test: Optional[int] = None,
    max_holdout: Optional[int] = None,
    seed: int = 0,
    batch_size: int = 32,
    methods: Sequence[str] = ("B", "BTo", "PostTE", "TE"),
    log: Optional[Callable[[str], None]] = None,
    layer: Optional[int] = None,
    lam_unit: float = 1.0,
    bto_forms: Sequence[str] = BTO_FORMS,
    progress: bool = False,
) -> dict:
    """Probe every group (relation) with B / BTo / PostTE / TE and return a JSON-able report.

    groups: {name: prompts}; tes: {name: TE [D]} (a group without a TE is probed with B/BTo only);
    type_names: {name: type} for BTo (default: each prompt's ``type_name``); ``bto_forms``: the
    BTo phrasings (:func:`bto_text`), one chosen per group on its hold-out.
    ``max_test`` caps the reported (non-hold-out) prompts per group (seeded subsample);
    ``max_holdout`` caps the hold-out (tiny runs only; the rest of the hold-out is not used).
    ``mode``/``layer``: where TE goes (see :func:`score_rows`); ``lam_unit``: lambda grid values
    are in this unit (absolute lambda = value * lam_unit; the report gives values in units).

    A group with a TE but no hold-out prompt (``holdout=0``, a 1-prompt group) is *untuned*:
    lambda 0 and PostTE weight 0 (so TE = PostTE = B), marked ``"untuned": true`` in
    ``per_group`` and ``tuning``. The macro of every method is over the same groups: those with
    reported prompts and a result for every method (``macro_relations``); groups without a TE
    while TE / PostTE are asked for are listed in ``no_te`` and warned about (through ``log``
    when given, else :func:`warnings.warn`); every group left out of the macro is in
    ``macro_excluded`` with the reason.
    """
    check_mode(mode, layer, model.kind)
    if not groups:
        raise ValueError("evaluate: no groups (relations) to probe")
    if "BTo" in methods and not bto_forms:
        raise ValueError("BTo needs at least one form in bto_forms")
    lam_unit = float(lam_unit)
    if not lam_unit > 0:
        raise ValueError(f"lam_unit must be positive, got {lam_unit}")
    warn = (lambda s: log("warning: " + s)) if log else (lambda s: warnings.warn(s, stacklevel=3))
    log = log or (lambda s: None)
    kind = model.kind
    lam_grid = sorted({0.0, *(float(x) for x in lam_grid)})  # lambda = 0 is B and tunes PostTE
    post_grid = [float(x) for x in post_grid]
    all_examples: list[Example] = []
    bto_examples: list[Example] = []
    data: dict[str, GroupData] = {}
    skips_report = {}
    for name, prompts in groups.items():
        sk = Skips()
        exs, _ = encode_prompts(prompts, model.tokenizer, kind, skips=sk)
        tname = (type_names or {}).get(name)
        bto_idx: list[list[Optional[int]]] = [[None] * len(exs) for _ in bto_forms]
        if "BTo" in methods:
            sk_b = Skips()
            for f, form in enumerate(bto_forms):
                for j, e in enumerate(exs):
                    t = tname or e.prompt.type_name
                    if not t:
                        raise ValueError(f"group {name}: BTo needs a type name (type_names or Prompt.type_name)")
                    b, _ = encode_prompts(
                        [e.prompt],
                        model.tokenizer,
                        kind,
                        skips=sk_b,
                        text_fn=lambda p, t=t, form=form: bto_text(p.text, t, form),
                    )
                    if b:
                        bto_idx[f][j] = len(bto_examples)
                        bto_examples.extend(b)
            skips_report[f"{name}/BTo"] = sk_b.report()  # summed over the forms
        hold, test = split_holdout(len(exs), holdout, seed, name)
        if max_holdout is not None:
            hold = hold[:max_holdout]
        if max_test is not None and len(test) > max_test:
            rng = np.random.default_rng([seed + 1, zlib.crc32(name.encode())])
            test = np.sort(rng.choice(test, size=max_test, replace=False))
        offset = len(all_examples)
        all_examples.extend(exs)
        data[name] = GroupData(exs, bto_idx, hold + offset, test + offset, offset)
        skips_report[name] = sk.report()
        log(
            f"{name}: {len(exs)} usable / {len(prompts)} prompts, hold-out {len(hold)}, test {len(test)}, "
            f"skipped {sk.total}"
        )

    names_te = [n for n in data if n in tes]
    te_index = {n: i for i, n in enumerate(names_te)}
    d = model.embedding().shape[1]
    te_table = jnp.stack([jnp.asarray(tes[n], jnp.float32) for n in names_te]) if names_te else jnp.zeros((1, d))
    _run = functools.partial(score, model, mode=mode, post_grid=post_grid, batch_size=batch_size, layer=layer)

    def run(exs, idx, lams, te_idx, table, desc="probe", **kw):
        with progress_bar(desc=desc, total=len(idx), unit="row", enabled=progress) as b:
            lams = np.asarray(lams, np.float32) * lam_unit
            return _run(exs, idx, lams, te_idx, table, progress=progress_callback(b), **kw)

    # phase 1: hold-out prompts x the lambda grid (lambda = 0, column 0, also tunes PostTE)
    best_lam, best_w, tuning = {}, {}, {}
    grid = lam_grid if "TE" in methods else [0.0]
    hold_idx = [i for n in names_te for i in data[n].holdout]
    if hold_idx:
        hold_grp = np.array([n for n in names_te for _ in data[n].holdout])
        res = run(
            all_examples,
            hold_idx,
            np.asarray(grid, np.float32),
            [te_index[n] for n in hold_grp],
            te_table,
            desc="probe hold-out",
        )
        for n in names_te:
            sel = hold_grp == n
            if not sel.any():  # no hold-out prompt in this group: untuned (below)
                continue
            lam_star, lam_table = choose(grid, [res.rank[sel, j] for j in range(len(grid))])
            w_star, w_table = choose(post_grid, [res.post_rank[w, sel, 0] for w in range(len(post_grid))])
            best_lam[n], best_w[n] = lam_star, w_star
            tuning[n] = {
                "lambda": lam_star,
                "lambda_table": lam_table,
                "post_weight": w_star,
                "post_table": w_table,
                "n_holdout": int(sel.sum()),
            }
            log(f"{n}: tuned lambda={lam_star} post_weight={w_star}")
    untuned = [n for n in names_te if n not in best_lam]
    for n in untuned:  # no hold-out prompt: nothing to tune on, so the TE is not applied
        best_lam[n], best_w[n] = 0.0, 0.0
        tuning[n] = {"lambda": 0.0, "post_weight": 0.0, "untuned": True, "n_holdout": 0}
        log(f"{n}: no hold-out prompt, untuned (lambda 0, post_weight 0: TE and PostTE equal B)")

    # phase 2: reported prompts at lambda 0 (B, PostTE) and at the tuned lambda (TE)
    test_idx = [i for g in data.values() for i in g.test]
    test_grp = np.array([n for n, g in data.items() for _ in g.test])
    lam2 = np.array([[0.0, best_lam.get(n, 0.0)] for n in test_grp], np.float32).reshape(-1, 2)
    res = (
        run(all_examples, test_idx, lam2, [te_index.get(n, 0) for n in test_grp], te_table, desc="probe test")
        if test_idx
        else None
    )
    results: dict[str, dict] = {n: {} for n in data}
    predictions: dict[str, list] = {n: [] for n in data}
    tok = model.tokenizer
    dec = (lambda i: tok.decode([int(i)])) if hasattr(tok, "decode") else int
    for n, g in data.items():
        sel = test_grp == n if res is not None else np.zeros(0, bool)
        rb = res.rank[sel, 0] if res is not None else np.array([])
        results[n]["B"] = precision_at(rb)
        results[n]["n_test"] = int(len(g.test))
        if n in te_index:
            results[n]["untuned"] = n in untuned
        if n in te_index and res is not None:  # res is None when no prompt is reported (max_test=0)
            if "PostTE" in methods:  # weight 0 (untuned) leaves B's scores, whatever post_grid holds
                post = rb if n in untuned else res.post_rank[post_grid.index(best_w[n]), sel, 0]
                results[n]["PostTE"] = precision_at(post)
            if "TE" in methods:
                results[n]["TE"] = precision_at(res.rank[sel, 1])
        for j in np.flatnonzero(sel)[:5]:
            ex = all_examples[test_idx[j]]
            entry = {"prompt": ex.prompt.text, "gold": ex.prompt.gold, "B_top1": dec(res.top1[j, 0])}
            if n in te_index and "TE" in methods:
                entry["TE_top1"] = dec(res.top1[j, 1])
            predictions[n].append(entry)

    if "BTo" in methods:

        def bto_ranks(rows):
            """Gold ranks of (group, global example index, form) rows; a prompt whose BTo form
            could not be encoded is a miss (same denominator as B)."""
            at = [data[n].bto[f][i - data[n].offset] for n, i, f in rows]
            ok = np.array([x is not None for x in at], bool)
            ranks = np.full(len(rows), np.iinfo(np.int32).max, np.int64)
            if ok.any():
                n_ok = int(ok.sum())
                rb = run(
                    bto_examples,
                    [x for x in at if x is not None],
                    np.zeros((n_ok, 1), np.float32),
                    [0] * n_ok,
                    te_table,
                    post_grid=(0.0,),
                    desc="probe BTo",
                )
                ranks[ok] = rb.rank[:, 0]
            return ranks, ok

        form_of = {n: 0 for n in data}
        if len(bto_forms) > 1:  # the phrasing per group, on its hold-out
            rows = [(n, i, f) for n, g in data.items() for f in range(len(bto_forms)) for i in g.holdout]
            ranks, _ = bto_ranks(rows)
            grp, form = np.array([r[0] for r in rows]), np.array([r[2] for r in rows])
            for n, g in data.items():
                if not len(g.holdout):
                    continue
                per = [ranks[(grp == n) & (form == f)] for f in range(len(bto_forms))]
                f_star, table = choose(range(len(bto_forms)), per)
                form_of[n] = int(f_star)
                tuning.setdefault(n, {})["bto_form"] = bto_forms[form_of[n]]
                tuning[n]["bto_table"] = {bto_forms[int(k)]: v for k, v in table.items()}
        rows = [(n, i, form_of[n]) for n, g in data.items() for i in g.test]
        ranks, ok = bto_ranks(rows)
        grp = np.array([n for n, _, _ in rows])
        for n in data:
            sel = grp == n
            results[n]["BTo"] = precision_at(ranks[sel]) if sel.any() else {f"P@{k}": float("nan") for k in KS}
            results[n]["BTo_encoded"] = int(ok[sel].sum())
            results[n]["BTo_form"] = bto_forms[form_of[n]]

    reported = [m for m in ("B", "BTo", "PostTE", "TE") if m in methods]
    excluded = macro_exclusions(results, reported)
    no_te = [n for n in data if n not in te_index] if {"TE", "PostTE"} & set(methods) else []
    if no_te:
        msg = (
            f"{len(no_te)} of {len(data)} groups have no type vector (probed with B/BTo only, not in the "
            f"macro): {no_te}"
        )
        warn(msg)
    in_macro = [n for n in results if n not in excluded]
    macro_all = {m: macro({n: results[n][m] for n in in_macro}) for m in reported}
    return {
        "kind": kind,
        "mode": mode,
        "layer": layer,
        "lambda_unit": lam_unit,
        "identity": model.identity,
        "lambda_grid": list(lam_grid),
        "post_grid": list(post_grid),
        "bto_forms": list(bto_forms),
        "holdout": holdout,
        "max_test": max_test,
        "max_holdout": max_holdout,
        "seed": seed,
        "per_group": results,
        "macro": macro_all,
        "macro_relations": in_macro,
        "macro_excluded": excluded,
        "no_te": no_te,
        "untuned": untuned,
        "tuning": tuning,
        "skips": skips_report,
        "predictions": predictions,
    }


def macro_exclusions(results: Mapping[str, Mapping], methods: Sequence[str]) -> dict[str, str]:
    """{group: why it is left out of the macro}: no reported prompt, or no result for one of
    ``methods`` (every method's macro is then over the same groups)."""
    out = {}
    for n, r in results.items():
        lacking = [m for m in methods if m not in r]
        if r["n_test"] == 0:
            out[n] = "no reported prompt"
        elif lacking:
            out[n] = f"no {'/'.join(lacking)} result (no type vector)"
    return out


# ----------------------------------------------------------------------------- type switching


def switch_prompts(
    pob_prompts: Sequence[Prompt],
    template: str = GOOGLE_RE_TEMPLATES["date_of_birth"],
    source_template: str = GOOGLE_RE_TEMPLATES["place_of_birth"],
) -> list[Prompt]:
    """Type switching (Table 6): place-of-birth facts asked with the date-of-birth template,
    e.g. "Khatchig Mouradian (born [MASK])." with gold "Lebanon". Subjects are recovered from
    prompts written with ``source_template`` (or taken from ``Prompt.subject``)."""
    pre, post = source_template.split("[X]")[0], source_template.split("[X]")[1]
    tail = post.replace("[Y]", MASK)
    out = []
    for p in pob_prompts:
        sub = p.subject
        if not sub:
            if not (p.text.startswith(pre) and p.text.endswith(tail)):
                continue
            sub = p.text[len(pre) : len(p.text) - len(tail)]
        out.append(Prompt(fill_template(template, sub), p.gold, "date_of_birth->place_of_birth", p.type_name, sub))
    return out
