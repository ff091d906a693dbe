"""The demo's sections as functions: each computes its "before / after" and returns a dict
(printed by :mod:`jsteer.demo`, drawn by :mod:`jsteer.demo.summary`, checked by
``tests/test_demo.py``). Numbers a section reads from committed results carry the file they came
from; everything else is computed when the function runs.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
STEER_FILE = ASSETS / "sentiment_steer_r32.safetensors"
STEER_CARD = ASSETS / "sentiment_steer_r32.json"

# neutral openings (not from the steer's training or evaluation prompts)
STEER_PROMPTS = ("The weather this weekend", "My neighbour's new car", "The meeting on Tuesday")
STEER_VALUE = 5.0  # x eps0: the committed held-out choice for + (the r32 row of sweep_smollm2.json)
BORN_PROMPTS = ("My grandmother was born in", "The author of this book was born in")
# Type Embeddings: the committed LAMA run whose setting the demo uses (layer, lambda unit, lambda)
TYPEVEC_RESULTS = "experiments/results/typevec/lama_smollm2_layersel.json"
TYPEVEC_LAYER, TYPEVEC_UNIT, TYPEVEC_LAMBDA = 26, 559.4555053710938, 0.4  # City/place_of_birth's
# activation steering: the committed CAA recipe (experiments/results/actsteer/smollm2.json)
ACT_RESULTS = "experiments/results/actsteer/smollm2.json"
ACT_LAYER, ACT_PAIRS, ACT_STRENGTH = 15, 32, 2.0
ACT_PROMPTS = ("The restaurant down the street", "Yesterday the train")
COMPOSE_PROMPT = "She was born in"
COMPOSE_VALUE = 8.0  # beyond the committed evaluation's +-5: stronger, less fluent


def _decode(lm, i: int) -> str:
    return lm.tokenizer.decode([int(i)])


# ----------------------------------------------------------------------------- sentiment scorer


def sentiment_scorer(minilm, n_train: int = 600, n_test: int = 300, max_len: int = 48):
    """A cheap independent positivity scorer, fitted now: a logistic probe on MiniLM's mean-pooled
    final hidden states of ``n_train`` SST-5 texts of the evaluator half (texts no steer saw),
    its accuracy measured on ``n_test`` SST-5 test texts. -> (score(texts) -> P(positive) [N], info)."""
    from jsteer.steer import data
    from jsteer.train.probe import fit_logistic

    (x, y), (xt, yt) = data.sentiment_data()
    rng = np.random.default_rng(0)
    tr, te = rng.choice(len(x), n_train, replace=False), rng.choice(len(xt), n_test, replace=False)

    def feats(texts):
        out = []
        for i in range(0, len(texts), 100):
            ids, mask = minilm.encode_batch(list(texts[i : i + 100]) + [""] * (-len(texts[i:]) % 100), max_len=max_len)
            ids, mask = _pad_cols(ids, mask, max_len)
            h = np.asarray(minilm.forward(ids, mask).hidden, np.float32)
            m = np.asarray(mask, np.float32)[..., None]
            out.append((h * m).sum(1) / np.maximum(m.sum(1), 1.0))
        return np.concatenate(out)[: len(texts)]

    probe = fit_logistic(feats([x[i] for i in tr]), np.asarray(y)[tr].astype(np.float32))
    acc = float(((np.asarray(probe.prob(feats([xt[i] for i in te]))) > 0.5) == (np.asarray(yt)[te] == 1)).mean())
    info = {"accuracy": acc, "train_texts": n_train, "test_texts": n_test}
    return (lambda texts: np.asarray(probe.prob(feats(list(texts))), np.float64)), info


def _pad_cols(ids, mask, t: int):
    """Right-pad [B, T'] to [B, t] so every batch shares one compiled forward."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    pad = t - ids.shape[1]
    if pad > 0:
        ids = np.pad(ids, ((0, 0), (0, pad)))
        mask = np.pad(mask, ((0, 0), (0, pad)))
    return ids, mask


# ----------------------------------------------------------------------------- 1. LM-Steer


def load_steer(lm=None):
    """The shipped sentiment steer -> (params, meta, card). With ``lm`` the artifact must belong to
    that model (:class:`jsteer.steer.artifact.WrongModelError` otherwise)."""
    from jsteer.steer import artifact

    params, meta = artifact.load(str(STEER_FILE), model_identity=None if lm is None else lm.identity)
    return params, meta, json.loads(STEER_CARD.read_text())


def steer_projection(lm, params) -> np.ndarray:
    """Each token's logit change per unit eps at the typical context (the mean final hidden state
    of a few generic openings, as ``jsteer steer explain``): E W c_bar [V]."""
    from jsteer.steer import head
    from jsteer.steer.cli import GENERIC_CONTEXTS, _mean_context

    w = np.asarray(head.full_matrix({k: jnp.asarray(v) for k, v in params.items()}), np.float64)[0]
    emb = np.asarray(lm.output_embeddings(), np.float64)
    return emb @ (w @ _mean_context(lm, GENERIC_CONTEXTS))


def projection_scores(proj: np.ndarray, tokens, lengths) -> list:
    """Mean of ``proj`` (:func:`steer_projection`, in units of its std over the vocabulary) over
    each row's generated tokens: how far the steer's own reading calls a continuation positive."""
    tok, unit = np.asarray(tokens), proj.std()
    return [float(proj[tok[i, : int(n)]].mean() / unit) if int(n) else 0.0 for i, n in enumerate(np.asarray(lengths))]


def english_words(minilm) -> set:
    """Lower-case whole words of MiniLM's WordPiece vocabulary (a cheap English word list that
    keeps sub-word fragments out of the steer's token lists)."""
    return {w for w in minilm.tokenizer.backend.get_vocab() if w.isalpha() and len(w) >= 4}


def _words(lm, order, words: Optional[set], k: int = 12) -> list:
    out = []
    for i in order[:5000]:
        t = _decode(lm, i)
        if re.fullmatch(r" [A-Za-z]{4,}", t) and (words is None or t.strip().lower() in words):
            out.append(t.strip())
            if len(out) == k:
                break
    return out


def steer_section(
    lm,
    scorer=None,
    words: Optional[set] = None,
    value: float = STEER_VALUE,
    prompts: Sequence[str] = STEER_PROMPTS,
    max_new_tokens: int = 20,
) -> dict:
    """Greedy continuations at -value, 0, +value (x eps0) in one ``generate`` call (one steer
    value per row: traced), their positivity by ``scorer`` and by the steer's own projection
    (mean logit change of the continuation's tokens), the steer's top / bottom tokens, and its
    committed evaluation (the card). ``words``: the whole words the token lists keep
    (:func:`english_words`; None: every space-led alphabetic token)."""
    from jsteer.steer import head

    params, meta, card = load_steer(lm)
    values = (-value, 0.0, value)
    rows = [(p, v) for p in prompts for v in values]
    eps = jnp.asarray([[v * meta["eps0"]] for _, v in rows], jnp.float32)  # [B, 1]: per-row strength
    texts, tokens, lengths = lm.generate(
        [p for p, _ in rows], max_new_tokens=max_new_tokens, hooks=head.to_hooks(params, eps), return_ids=True
    )
    proj = steer_projection(lm, params)
    proj_score = projection_scores(proj, tokens, lengths)
    pos = scorer(texts) if scorer is not None else np.full(len(texts), np.nan)
    order = np.argsort(-proj)
    by_value = {v: {"projection": [], "positivity": []} for v in values}
    for (_, v), s, p in zip(rows, proj_score, pos):
        by_value[v]["projection"].append(s)
        by_value[v]["positivity"].append(float(p))
    return {
        "rank": int(params["p1"].shape[-1]),
        "base_model": meta["base_model"],
        "file": str(STEER_FILE),
        "bytes": STEER_FILE.stat().st_size,
        "values": list(values),
        "rows": [{"prompt": p, "value": v, "text": t} for (p, v), t in zip(rows, texts)],
        "mean": {v: {k: float(np.mean(x)) for k, x in d.items()} for v, d in by_value.items()},
        "top": _words(lm, order, words),
        "bottom": _words(lm, order[::-1], words),
        "committed": card["evaluation"],
        "card": str(STEER_CARD),
    }


# ----------------------------------------------------------------------------- 2. Type Embeddings


def city_type(lm, data_root: Optional[pathlib.Path] = None):
    """The City type vector from the KG examples -> (TE [D], TypeSample, every City token id)."""
    from jsteer import typevec as tv
    from jsteer.workspace import DATA

    root = pathlib.Path(data_root or DATA) / "type_embedding" / "kg_samples"
    if not root.is_dir():
        raise FileNotFoundError(f"the KG examples are missing: {root} (the data sets live in ../shared/data)")
    s = tv.sampling.sample_type(root, "City", lm.tokenizer)  # weighted, 10 examples, seed 0
    te = tv.make(lm.input_embeddings(), jnp.asarray(s.token_ids))
    cands, _ = tv.sampling.candidates(tv.sampling.load_kg_samples(tv.sampling.kg_path(root, "City")), lm.tokenizer)
    return te, s, np.asarray(sorted({c[1] for c in cands}))


def typevec_hooks(te, mask, lam_units: float = TYPEVEC_LAMBDA):
    """TE added to the residual stream after layer 26 at each prompt's last token (the committed
    setting). ``lam_units`` may be a scalar or [B]: traced."""
    from jsteer.typevec import inject

    lam = jnp.asarray(lam_units, jnp.float32) * TYPEVEC_UNIT
    return inject.residual_hooks(te, lam, inject.last_positions(jnp.asarray(mask)), TYPEVEC_LAYER)


def typevec_section(lm, prompts: Sequence[str] = BORN_PROMPTS, k: int = 5) -> dict:
    """Next-token top-k and the probability mass on City tokens (all single-token City labels of
    the KG, and those not among the 10 examples) without / with the City type vector."""
    te, sample, city_ids = city_type(lm)
    held_out = np.setdiff1d(city_ids, np.asarray(sample.token_ids))
    ids, mask = lm.encode_batch(list(prompts))
    out = {}
    for name, hooks in (("before", None), ("after", typevec_hooks(te, mask))):
        p = np.asarray(jnp.exp(_last_logprobs(lm, ids, mask, hooks)), np.float64)
        out[name] = [
            {
                "top": [(_decode(lm, i), float(p[b, i])) for i in np.argsort(-p[b])[:k]],
                "city_mass": float(p[b, city_ids].sum()),
                "held_out_city_mass": float(p[b, held_out].sum()),
            }
            for b in range(len(prompts))
        ]
    return {
        "prompts": list(prompts),
        "examples": list(sample.labels),
        "n_city_tokens": int(len(city_ids)),
        "n_held_out": int(len(held_out)),
        "layer": TYPEVEC_LAYER,
        "lambda": TYPEVEC_LAMBDA,
        "unit": TYPEVEC_UNIT,
        "setting_from": TYPEVEC_RESULTS,
        **out,
    }


def _last_logprobs(lm, ids, mask, hooks=None):
    logits = lm.forward(ids, mask, hooks=hooks).logits[:, -1].astype(jnp.float32)  # left padding
    return logits - jax_logsumexp(logits)


def jax_logsumexp(x):
    import jax

    return jax.nn.logsumexp(x, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- 3. KALA


def kala_section(seed: int = 0, epochs: int = 15, n_train: int = 192, n_seen: int = 64, n_test: int = 64) -> dict:
    """The synthetic unseen-entity NER task (:mod:`jsteer.kala.synthetic`): a tiny BERT fine-tuned
    plainly vs with relational KALA (entity memory + KG neighbours), entity-level F1 on held-out
    sentences about *seen* entities (in training) and on the test sentences about *unseen* ones
    (new tokens, outside the entity vocabulary, linked in the KG to seen entities of their class)."""
    import jax

    from jsteer.backbones.bert import BertConfig
    from jsteer.kala import data as kdata
    from jsteer.kala import entities, synthetic
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig, KalaModel, init_params

    task = synthetic.make_task(seed, n_train=n_train + n_seen, n_test=n_test)
    train, seen = task.train[:n_train], task.train[n_train:]
    tok = task.tokenizer()
    vocab = entities.EntityVocab.from_mentions([m for _, _, m in train])
    rels = entities.RelationVocab.from_facts(task.facts)
    kg = entities.KnowledgeGraph(task.facts, rels)
    if any(vocab(m.id) == 0 for _, _, ms in seen for m in ms):
        raise AssertionError("a held-out 'seen' sentence mentions an entity the training split lacks")

    def enc(split):
        return [kdata.encode_ner(w, t, m, tok, synthetic.LABELS, vocab, kg, max_len=16) for w, t, m in split]

    bert = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    cfg = ktrain.TrainConfig(lr=2e-3, kala_lr=2e-3, batch_size=32, epochs=epochs, warmup_ratio=0.1)
    data = {"train": enc(train), "seen": enc(seen), "unseen": enc(task.test)}
    gold = {"seen": [t for _, t, _ in seen], "unseen": [t for _, t, _ in task.test]}
    f1 = {}
    for method in ("finetune", "relational"):
        model = KalaModel(
            bert,
            KalaConfig(method=method, num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
            num_labels=len(synthetic.LABELS),
        )
        fit = ktrain.fit(model, init_params(model, jax.random.PRNGKey(0)), data["train"], cfg)
        f1[method] = {
            split: float(
                ktrain.evaluate_ner(model, fit.params, data[split], gold[split], synthetic.LABELS, batch_size=32)["f1"]
            )
            for split in ("seen", "unseen")
        }
        f1[method]["loss_first_last"] = [float(fit.losses[0]), float(fit.losses[-1])]
    return {"f1": f1, "train": n_train, "seen": n_seen, "unseen": n_test, "epochs": epochs}


# ----------------------------------------------------------------------------- 4. activation steering


def control_vector(lm, pairs: int = ACT_PAIRS, layer: int = ACT_LAYER):
    """The committed CAA recipe's control vector (32 positive / 32 negative SST-5 steer-half
    sentences, detokenised; last token; resid_post of layer 15)."""
    from jsteer import actsteer
    from jsteer.steer import data

    texts, values = data.sentiment_steer_texts(2 * pairs)
    texts = [data.detok_sst(t) for t in texts]
    pos = [t for t, v in zip(texts, values[:, 0]) if v > 0]
    neg = [t for t, v in zip(texts, values[:, 0]) if v < 0]
    return actsteer.train(lm, pos, neg, layers=[layer], method="caa")


def actsteer_section(
    lm, scorer=None, strength: float = ACT_STRENGTH, prompts: Sequence[str] = ACT_PROMPTS, max_new_tokens: int = 20
) -> dict:
    """Greedy continuations at -s, 0, +s in one ``generate`` call (per-row strength) and their
    positivity by ``scorer``; the committed evaluation at this layer and strength."""
    from jsteer.workspace import ROOT

    cv = control_vector(lm)
    strengths = (-strength, 0.0, strength)
    rows = [(p, s) for p in prompts for s in strengths]
    texts = lm.generate(
        [p for p, _ in rows],
        max_new_tokens=max_new_tokens,
        hooks=cv.hooks(jnp.asarray([s for _, s in rows], jnp.float32)),
    )
    pos = scorer(texts) if scorer is not None else np.full(len(texts), np.nan)
    committed = json.loads((ROOT / ACT_RESULTS).read_text())
    return {
        "layer": ACT_LAYER,
        "strengths": list(strengths),
        "recipe": cv.recipe,
        "rows": [
            {"prompt": p, "strength": s, "text": t, "positivity": float(q)} for (p, s), t, q in zip(rows, texts, pos)
        ],
        "mean_positivity": {s: float(np.mean([q for (_, s2), q in zip(rows, pos) if s2 == s])) for s in strengths},
        "committed": {
            "file": ACT_RESULTS,
            "texts_sha256": committed["vector"]["recipe"]["texts_sha256"],
            "held_out": committed["selection"]["strengths"].get(f"{ACT_LAYER}@{strength:g}"),
            "unsteered": committed["selection"]["base"],
        },
    }


# ----------------------------------------------------------------------------- 5. composition


def compose_section(lm, prompt: str = COMPOSE_PROMPT, value: float = COMPOSE_VALUE, max_new_tokens: int = 20):
    """One ``generate`` call carrying the sentiment steer and the City type vector together, each
    with its own per-row strength: (steer, type) = (0, 0), (0, on), (+v, on), (-v, on); whether
    each row's first token is a City token, and the steer projection of the rest
    (:func:`projection_scores`). A second call with other strengths reuses the compiled loop
    (timed, and its newly compiled programs counted)."""
    import time

    from jsteer import decode
    from jsteer.hooks import compose
    from jsteer.steer import head

    params, meta, _ = load_steer(lm)
    te, _, city_ids = city_type(lm)
    settings = [(0.0, 0.0), (0.0, TYPEVEC_LAMBDA), (value, TYPEVEC_LAMBDA), (-value, TYPEVEC_LAMBDA)]
    prompts = [prompt] * len(settings)
    ids, mask = lm.encode_batch(prompts)

    def run(settings):
        eps = jnp.asarray([[v * meta["eps0"]] for v, _ in settings], jnp.float32)
        lam = jnp.asarray([t for _, t in settings], jnp.float32)
        hooks = compose(head.to_hooks(params, eps), typevec_hooks(te, mask, lam))
        t0 = time.perf_counter()
        texts, tokens, lengths = lm.generate(prompts, max_new_tokens=max_new_tokens, hooks=hooks, return_ids=True)
        return texts, np.asarray(tokens), np.asarray(lengths), time.perf_counter() - t0

    texts, tokens, lengths, first_s = run(settings)
    again = [(value / 2, TYPEVEC_LAMBDA / 2), (-value / 2, TYPEVEC_LAMBDA / 2), (2.0, 0.0), (-2.0, 0.0)]
    n0 = decode.compiled_count()
    *_, second_s = run(again)
    new_programs = decode.compiled_count() - n0
    proj = projection_scores(steer_projection(lm, params), tokens[:, 1:], np.maximum(lengths - 1, 0))
    return {
        "prompt": prompt,
        "rows": [
            {
                "steer": v,
                "type": t,
                "text": x,
                "first_token_is_city": bool(tok[0] in set(city_ids)),
                "projection": q,
            }
            for (v, t), x, tok, q in zip(settings, texts, tokens, proj)
        ],
        "first_call_s": first_s,
        "second_call_s": second_s,
        "second_call_new_programs": new_programs,
    }
