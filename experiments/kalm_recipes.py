"""KALM on the recipe data: perplexity vs the plain LM head, and unsupervised typing of
ingredient words whose lexicon entries were held out of the type vocabularies.

    python experiments/kalm_recipes.py                       # full run: ~12 min on a shared 2-core CPU
    python experiments/kalm_recipes.py --small               # minutes-scale smoke run
    python experiments/kalm_recipes.py --report experiments/results/kalm/recipes.json   # markdown only

Writes ``experiments/results/kalm/recipes[_small].json`` (incrementally, after every model)
and a markdown table beside it; per-model training metrics go to ``runs/kalm/*.jsonl``.

Data (``../shared/data/kalm_namedentitylm``): the 8 ingredient types of ``superingredients/``
become word-level type vocabularies (:func:`jsteer.kalm.data.word_types`); there is no train
file, so models train on ``uncleaned_valid_ing.txt`` and are evaluated on a seeded subset of
``uncleaned_test_ing.txt`` (ingredient lists, one recipe a line). The word vocabulary is the
training words seen >= 3 times.

Held-out typing: ``--held-out`` of each type's single-type, in-vocabulary words that occur in
the test lines are removed from every type vocabulary; they remain ordinary words of the
general vocabulary (the type vocabularies are disjoint from the general one, so an entity word
is generated only through its types and the latent type is identifiable). Every test
occurrence of a held-out word is then typed from its context alone -- the type prior of a word
outside the lexicon is uniform (:func:`jsteer.kalm.decode.type_prior`):

- KALM fwd: argmax_j P(type_t = j | c_<t) over the 8 entity types;
- KALM bi: a second KALM trained right-to-left adds P(type_t = j | c_>t), divided by the
  average type distribution P(j) (product of experts);
Accuracy is reported over occurrences, macro over distinct held-out words (frequent words such
as "salt" would otherwise dominate) and macro over types.

- baselines: the most frequent type of the lexicon words in the training text; the plain LM's
  context with the lexicon (argmax_j sum_{w in V_j} P(w | c_<t)); the plain LM's output
  embedding of the word itself (nearest type centroid of the kept lexicon words, cosine).

Models: a random-init LLaMA (``--hidden`` wide, ``--layers`` layers, word-level, tied
embeddings) trained as an LM for ``--steps`` steps of ``--batch`` lines (truncated to
``--length`` tokens), identical for the plain head, KALM and KALM with type input.
Perplexity: every real next-token prediction of the test lines (same vocabulary for all).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "kalm_namedentitylm"
OUT = ROOT / "experiments" / "results" / "kalm"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-lines", type=int, default=None)
    ap.add_argument("--test-lines", type=int, default=2000)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--held-out", type=float, default=0.25)
    ap.add_argument(
        "--untied", action="store_true", help="free typed output rows instead of word embedding + type offset"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="+", default=["plain", "kalm", "kalm_bwd", "kalm_type_input"])
    ap.add_argument("--small", action="store_true", help="smoke run: 600 lines, 30 steps, tiny model")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="only (re)write the markdown table of a saved result JSON beside it",
    )
    args = ap.parse_args(argv)
    if args.report:
        path = pathlib.Path(args.report)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        print(path.with_suffix(".md").read_text())
        return 0
    if args.small:
        args.train_lines, args.test_lines, args.steps, args.hidden, args.layers = 600, 200, 30, 32, 1
    out = pathlib.Path(args.out) if args.out else OUT / ("recipes_small.json" if args.small else "recipes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args, lambda partial: out.write_text(json.dumps(partial, indent=1)))
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(json.dumps({k: result[k] for k in ("perplexity", "typing")}, indent=1))
    return 0


def markdown(result: dict) -> str:
    """The perplexity and typing tables of a result (partial results: what is there)."""
    s = result["setup"]
    lines = [
        f"# KALM on the recipe data{' (partial)' if result.get('partial') else ''}",
        "",
        f"Random-init LLaMA, hidden {s['hidden']}, {s['layers']} layers, word-level vocab {s['vocab']}; "
        f"{s['steps']} steps x {s['batch']} lines (length {s['length']}, {s.get('epochs', float('nan')):.2f} "
        f"epochs of {s['train_lines']} training lines), lr {s['lr']}; typed output rows shared with the word "
        f"embedding: {s.get('share_word_embedding', False)}. Test: {s['test_lines']} lines of "
        f"uncleaned_test_ing.txt; {len(s['held_out_words'])} lexicon words held out of the type vocabularies.",
        "",
        "| model | test perplexity | test NLL | tokens | final train loss (mean last 50) | train s |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in result["perplexity"].items():
        t = result["timing"][name]
        lines.append(
            f"| {name} | {p['perplexity']:.2f} | {p['nll']:.4f} | {p['tokens']} | "
            f"{t.get('final_loss_mean50', t['final_loss']):.3f} | {t['train_seconds']:.0f} |"
        )
    typing = result.get("typing")
    if typing:
        lines += [
            "",
            f"Typing of held-out words from context: {typing['occurrences']} occurrences of "
            f"{typing['distinct_words']} words; chance {typing['chance']:.3f}.",
            "",
            "kalm_fwd / kalm_bwd: argmax over the 8 entity types of P(type | left / right context) of the "
            "forward / right-to-left KALM; kalm_bi: their product divided by the average type distribution; "
            "plain_lm_context_lexicon: the type whose (kept) lexicon words get the most next-word mass from the "
            "plain LM; plain_lm_embedding_centroid: nearest type centroid of the plain LM's embedding of the "
            "word itself (a word-level, not per-occurrence, decision); majority: the most frequent type of "
            "lexicon-word tokens in training.",
            "",
            "| method | accuracy (occurrences) | macro over words | macro over types |",
            "|---|---|---|---|",
        ]
        for name, v in typing.items():
            if isinstance(v, dict) and "accuracy" in v:
                label = f"{name} ({v['type']})" if "type" in v else name
                lines.append(
                    f"| {label} | {v['accuracy']:.3f} | {v.get('word_macro', float('nan')):.3f} | "
                    f"{v.get('type_macro', float('nan')):.3f} |"
                )
    return "\n".join(lines) + "\n"


def out_stem(args) -> str:
    return "recipes_small" if args.small else "recipes"


def run(args, checkpoint=lambda partial: None) -> dict:
    """The experiment; ``checkpoint(partial result)`` is called after every trained model."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(ROOT / "runs" / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from jsteer.kalm import data as kdata
    from jsteer.kalm import decode
    from jsteer.kalm import train as ktrain
    from jsteer.kalm.head import TypedVocab

    t0 = time.time()
    lexicon = kdata.read_lexicon(DATA)
    train_lines = kdata.read_lines(DATA / "raw_data" / "uncleaned_valid_ing.txt", args.train_lines)
    all_test = kdata.read_lines(DATA / "raw_data" / "uncleaned_test_ing.txt")
    pick = np.random.default_rng(args.seed).choice(
        len(all_test), size=min(args.test_lines, len(all_test)), replace=False
    )
    test_lines = [all_test[i] for i in sorted(pick)]
    vocab = kdata.Vocab.build(train_lines, min_count=3)
    types = kdata.word_types(lexicon, vocab.words)
    test_words = collections.Counter(w for line in test_lines for w in line)
    held = kdata.split_held_out(types, vocab, args.held_out, seed=args.seed, eligible=test_words)
    names = kdata.TYPE_NAMES
    tv = TypedVocab.build(len(vocab), kdata.type_word_ids(types, vocab, names, exclude=held), disjoint=True)
    held_gold = {w: names.index(types[w][0]) + 1 for w in held}

    ids, mask = kdata.encode_lines(train_lines, vocab, args.length)
    rids, rmask = kdata.encode_lines(train_lines, vocab, args.length, reverse=True)
    tids, tmask = kdata.encode_lines(test_lines, vocab, args.length)
    trids, trmask = kdata.encode_lines(test_lines, vocab, args.length, reverse=True)
    backbone = ktrain.tiny_llama(len(vocab), hidden=args.hidden, layers=args.layers, heads=4, max_len=args.length + 1)
    cfg = ktrain.LMTrainConfig(lr=args.lr, batch_size=args.batch, steps=args.steps, seed=args.seed)
    share = not args.untied
    setup = {
        "train_lines": len(train_lines),
        "test_lines": len(test_lines),
        "vocab": len(vocab),
        "typed_pairs": tv.num_pairs,
        "lexicon_words_in_vocab": len(types),
        "held_out_words": sorted(held),
        "held_out_per_type": dict(collections.Counter(types[w][0] for w in held)),
        "length": args.length,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "hidden": args.hidden,
        "layers": args.layers,
        "seed": args.seed,
        "train_lines_seen": int(args.steps * args.batch),
        "epochs": args.steps * args.batch / len(train_lines),
        "share_word_embedding": share,
        "warmup_steps": min(cfg.warmup_steps, max(args.steps // 10, 1)),
        "type_dim": 32,
        "device": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(
        f"setup {time.time() - t0:.0f}s: vocab {len(vocab)}, typed pairs {tv.num_pairs}, held out {len(held)}",
        flush=True,
    )

    models, params, timing, ppl = {}, {}, {}, {}
    for name in args.models:
        kind = "kalm" if name == "kalm_bwd" else name
        model = ktrain.make_model(kind, backbone, tv, share_word_embedding=share)
        p = ktrain.init_params(model, jax.random.PRNGKey(args.seed), tv)
        x, m = (rids, rmask) if name == "kalm_bwd" else (ids, mask)
        log = ROOT / "runs" / "kalm" / f"{out_stem(args)}_{name}.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        p, info = ktrain.train(model, p, x, m, tv, cfg, log_path=log)
        models[name], params[name] = model, p
        timing[name] = {
            "train_seconds": info["seconds"],
            "compile_seconds": info["compile_seconds"],
            "final_loss": info["losses"][-1],
            "final_loss_mean50": float(np.mean(info["losses"][-50:])),
            "loss_curve": {
                str(i + 1): float(np.mean(info["losses"][max(i - 24, 0) : i + 1]))
                for i in range(24, len(info["losses"]), 50)
            },
        }
        tx, tm = (trids, trmask) if name == "kalm_bwd" else (tids, tmask)
        ppl[name] = ktrain.perplexity(model, p, tx, tm, tv)
        print(f"{name}: test perplexity {ppl[name]['perplexity']:.2f} train {info['seconds']:.0f}s", flush=True)
        checkpoint({"setup": setup, "perplexity": ppl, "timing": timing, "partial": True})

    # ---- typing of held-out words from context
    pos = decode.word_positions(test_lines, held_gold, args.length)
    li = np.array([p[0] for p in pos])
    fi = np.array([p[1] for p in pos])
    bi = np.array([p[2] for p in pos])
    gold = np.array([p[3] for p in pos])
    words = [test_lines[a][f] for a, f in zip(li, fi)]
    prior = decode.type_prior(vocab, types, names, exclude=held)
    word_prior = prior[[vocab(w) for w in words]]
    typing = {"occurrences": len(pos), "distinct_words": len(set(words))}

    word_arr = np.array(words)

    def acc(pred):
        """accuracy over occurrences, macro over distinct words (each held-out word counts
        once) and over types, and per type."""
        pred = np.asarray(pred)
        per_type = {names[j - 1]: float((pred[gold == j] == j).mean()) for j in sorted(set(gold.tolist()))}
        per_word = [float((pred[word_arr == w] == gold[word_arr == w]).mean()) for w in sorted(set(words))]
        return {
            "accuracy": float((pred == gold).mean()),
            "word_macro": float(np.mean(per_word)),
            "type_macro": float(np.mean(list(per_type.values()))),
            "per_type": per_type,
        }

    train_type_counts = collections.Counter(
        types[w][0] for line in train_lines for w in line if w in types and len(types[w]) == 1 and w not in held
    )
    majority = names.index(train_type_counts.most_common(1)[0][0]) + 1
    typing["majority_type_baseline"] = {"type": names[majority - 1], **acc(np.full(len(gold), majority))}
    typing["chance"] = 1.0 / len(names)
    ctx = {}
    for name in ("kalm", "kalm_type_input", "kalm_bwd"):
        if name in models:
            x, m = (trids, trmask) if name == "kalm_bwd" else (tids, tmask)
            ctx[name] = ktrain.context_types(models[name], params[name], x, m, tv)
    if "kalm" in ctx:
        fwd = ctx["kalm"][li, fi]
        typing["kalm_fwd"] = acc(decode.decode_types([fwd], word_prior))
        if "kalm_bwd" in ctx:
            bwd = ctx["kalm_bwd"][li, bi]
            marg = ktrain.mean_type_distribution(ctx["kalm"], tmask)
            typing["kalm_bwd"] = acc(decode.decode_types([bwd], word_prior))
            typing["kalm_bi"] = acc(decode.decode_types([fwd, bwd], word_prior, marg))
    if "kalm_type_input" in ctx:
        typing["kalm_type_input_fwd"] = acc(decode.decode_types([ctx["kalm_type_input"][li, fi]], word_prior))
    if "plain" in models:
        typing["plain_lm_context_lexicon"] = acc(
            plain_context_typing(models["plain"], params["plain"], tids, tmask, tv, li, fi)
        )
        typing["plain_lm_embedding_centroid"] = acc(embedding_typing(params["plain"], tv, [vocab(w) for w in words]))
    return {"setup": setup, "perplexity": ppl, "timing": timing, "typing": typing, "wall_seconds": time.time() - t0}


def plain_context_typing(model, params, ids, mask, tv, li, fi, batch_size: int = 128) -> np.ndarray:
    """argmax_j sum_{w in V_j} P(w | c_<t) with the plain LM (j = 1..K)."""
    import jax
    import jax.numpy as jnp

    words = np.asarray(tv.pair_word)
    fn = jax.jit(lambda p, i, m: jax.nn.log_softmax(model.apply({"params": p}, i, m).logits, -1)[..., words])
    rows = sorted(set(li.tolist()))
    where = {r: k for k, r in enumerate(rows)}
    lp = []
    for s in range(0, len(rows), batch_size):
        sel = rows[s : s + batch_size]
        i = np.zeros((batch_size, ids.shape[1]), ids.dtype)
        m = np.zeros_like(i)
        i[: len(sel)], m[: len(sel)] = ids[sel], mask[sel]
        lp.append(np.asarray(fn(params, jnp.asarray(i), jnp.asarray(m)))[: len(sel)])
    lp = np.concatenate(lp)  # [rows, L, P]
    probs = np.exp(lp[[where[r] for r in li], fi]).astype(np.float64)  # [n, P]: P(pair word | c)
    mass = np.stack([probs[:, np.asarray(tv.pair_type) == j].sum(-1) for j in range(tv.num_types)], -1)
    return 1 + np.argmax(mass, axis=-1)


def embedding_typing(params, tv, word_ids) -> np.ndarray:
    """Nearest type centroid (cosine) of the plain LM's embedding of the word itself."""
    emb = np.asarray(params["embed"]["embedding"], np.float64)
    emb = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
    cents = np.stack([emb[tv.words_of(j + 1)].mean(0) for j in range(tv.num_types)])
    cents /= np.linalg.norm(cents, axis=-1, keepdims=True)
    return 1 + np.argmax(emb[word_ids] @ cents.T, axis=-1)


if __name__ == "__main__":
    sys.exit(main())
