"""Shared pieces of the LM-Steer experiments: data splits, the MiniLM evaluators, fluency
(perplexity under the unsteered model), diversity (distinct-n) and batched steered sampling.

Every random choice is seeded and recorded in the output JSON."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
from typing import Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "experiments" / "results" / "steer"


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def write_json(path, obj):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- data


def _sst5_records(split: str) -> list:
    from jsteer.data import readers

    return readers.read_jsonl_labeled(DATA / "sst5" / f"{split}.jsonl", label_set=("0", "1", "2", "3", "4"))


def sst5(split: str, fine: bool = False):
    """SST-5 without its neutral class 2 -> (texts, labels): binary (1 for 3-4, 0 for 0-1), or the
    five-class labels 0, 1, 3, 4 with ``fine``."""
    keep = [r for r in _sst5_records(split) if r.label != "2"]
    if fine:
        return [r.text for r in keep], np.asarray([int(r.label) for r in keep])
    return [r.text for r in keep], np.asarray([1 if r.label in ("3", "4") else 0 for r in keep])


def steer_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded halves of SST-5 train (without class 2, ``n`` texts): (steer half, evaluator half).
    The sentiment steer never sees the evaluator's half."""
    perm = np.random.default_rng(0).permutation(n)
    return perm[: n // 2], perm[n // 2:]


def balanced_keep(values: np.ndarray, n: int) -> np.ndarray:
    """Sorted indices of n // 2 texts with a positive and n // 2 with a negative steer value (seeded)."""
    pos, neg = np.flatnonzero(values > 0), np.flatnonzero(values < 0)
    r = np.random.default_rng(1)
    return np.sort(np.concatenate([r.choice(pos, n // 2, replace=False), r.choice(neg, n // 2, replace=False)]))


def sentiment_steer_texts(n: int) -> tuple[list, np.ndarray]:
    """The sentiment steer's training texts: n class-balanced texts of the steer half of SST-5 train
    -> (texts, values [n, 2]). Column 0: the issue's binary values (labels 3-4 -> +1, 0-1 -> -1);
    column 1: the original LM-Steer code's graded values label / 2 - 1 (-1, -0.5, +0.5, +1)."""
    texts, fine = sst5("train", fine=True)
    steer_idx, _ = steer_split(len(texts))
    fine = fine[steer_idx]
    values = np.stack([np.where(fine >= 3, 1.0, -1.0), fine / 2 - 1], axis=1).astype(np.float32)
    keep = balanced_keep(values[:, 0], n)
    return [texts[steer_idx[i]] for i in keep], values[keep]


def sentiment_neutral_texts(n: int) -> tuple[list, np.ndarray]:
    """n texts of SST-5 train's neutral class 2 (seeded), steer value 0 in both columns -> (texts,
    values [n, 2]). The original LM-Steer code trains on them too (label / 2 - 1 = 0: only the
    dummy steer fits them); the evaluators never see class 2."""
    neutral = [r.text for r in _sst5_records("train") if r.label == "2"]
    if n > len(neutral):
        raise ValueError(f"asked for {n} neutral SST-5 texts; train has {len(neutral)}")
    pick = np.sort(np.random.default_rng(2).choice(len(neutral), n, replace=False))
    return [neutral[i] for i in pick], np.zeros((n, 2), np.float32)


def self_generated_texts(lm, labeler, n: int, exclude: Sequence[str], n_prompts: int = 400, samples: int = 4,
                         max_new_tokens: int = 32, seed: int = 1) -> tuple[list, np.ndarray]:
    """On-policy steer texts: the unsteered model's own top-p continuations of ``n_prompts`` neutral
    prompts (seeded; none of ``exclude``, the held-out and test prompts), ``samples`` each, scored by
    ``labeler`` (a sentiment classifier trained on the steer's SST-5 texts only, never the evaluator).
    The n // 2 most and n // 2 least positive continuations, each with its prompt in front, are the
    texts -> (texts, values [n, 2]) with +1 / -1 in both columns (no graded form)."""
    pool = prompt_pool("neutral", exclude)
    if n_prompts > len(pool) or n > n_prompts * samples:
        raise ValueError(f"self_generated_texts: {n} texts from {n_prompts} of {len(pool)} prompts x {samples}")
    chosen = [pool[i] for i in sorted(np.random.default_rng(seed).choice(len(pool), n_prompts, replace=False))]
    return ranked_continuations(lm, labeler.prob, chosen, n, samples, max_new_tokens, seed, columns=2)


def cached_self_texts(lm, labeler, n: int, exclude: Sequence[str], work: pathlib.Path) -> tuple[list, np.ndarray]:
    """:func:`self_generated_texts` kept at ``work/texts_self{n}.json`` under a key of the model,
    the labeler, ``n`` and the excluded prompts (in order), so that every run excluding the same
    prompts (steer_sweep's ``_self`` configs, steer_smollm2 --sentiment-data self) shares them."""
    key = {"model": lm.identity, "labeler": labeler.meta["name"], "texts": n,
           "exclude_sha256": hashlib.sha256(json.dumps(list(exclude)).encode()).hexdigest()}
    return cached_texts(pathlib.Path(work) / f"texts_self{n}.json", key,  # ~4 min to generate
                        lambda: self_generated_texts(lm, labeler, n, exclude))


def ranked_continuations(lm, score, prompt_list: Sequence[str], n: int, samples: int, max_new_tokens: int = 32,
                         seed: int = 1, columns: int = 1) -> tuple[list, np.ndarray]:
    """The unsteered model's top-p continuations of ``prompt_list``, ``samples`` each (seed
    ``seed * 100003``), ranked by ``score(continuations) -> [m]`` (higher: the steer's + side): the
    n // 2 highest-scoring get +1, the n // 2 lowest -1; each text is its prompt + continuation
    -> (texts [n], values [n, columns])."""
    if n > len(prompt_list) * samples:
        raise ValueError(f"ranked_continuations: {n} texts from {len(prompt_list)} prompts x {samples}")
    conts = sample(lm, lambda b: None, prompt_list, samples, max_new_tokens=max_new_tokens, seed=seed * 100003,
                   batch=50)
    flat = [(p, c) for p, cs in zip(prompt_list, conts) for c in cs]
    order = np.argsort(np.asarray(score([c for _, c in flat])), kind="stable")
    keep = np.concatenate([order[: n // 2], order[len(order) - n // 2:]])
    values = np.repeat(np.where(np.arange(len(keep)) < n // 2, -1.0, 1.0)[:, None], columns, axis=1).astype(np.float32)
    return [flat[i][0] + flat[i][1] for i in keep], values


def cached_texts(path, key: dict, make) -> tuple[list, np.ndarray]:
    """(texts, values) saved at ``path`` (JSON) when it was made with this ``key``, else
    ``make()`` -> (texts, values), saved with the key (atomically) first. For texts that are
    costly to make, such as generated ones, so that :func:`cached_hidden` can check its own key
    without making them again."""
    path = pathlib.Path(path)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["texts"], np.asarray(saved["values"], np.float32)
        log(f"remaking {path.name}, made by another run: key {saved.get('key')} != {key}")
    texts, values = make()
    write_json(path, {"key": key, "texts": list(texts), "values": np.asarray(values, np.float32).tolist()})
    return texts, values


def hidden_cache_key(lm, texts: Sequence[str], values, max_len: int) -> dict:
    """What an experiment's cached hidden states depend on, in the fields of ``jsteer steer train
    --cache``'s key: the model's identity, ``data_sha256`` and ``max_len``. The experiments pick
    their texts from several files by seeded selections, so ``data_sha256`` hashes the chosen texts
    and their steer values themselves (the CLI hashes its one data file and records the format,
    limit and seed of its selection instead)."""
    v = np.ascontiguousarray(values, np.float32)
    h = hashlib.sha256(json.dumps(list(texts)).encode())
    h.update(json.dumps(v.shape).encode())
    h.update(v.tobytes())
    return {"model": lm.identity, "texts": len(texts), "data_sha256": h.hexdigest(), "max_len": max_len}


def cached_hidden(lm, path: pathlib.Path, texts_values, max_len: int, batch_size: int = 32):
    """The hidden-state cache at ``path`` when its key (:func:`hidden_cache_key`) matches this run:
    same model, texts, values and max_len. Otherwise (absent, or made by another model or from other
    texts: logged) built from ``texts_values()`` -> (texts, values) with ``train.cache_lm`` and saved
    there, with its key, first."""
    from jsteer.steer import train

    path = pathlib.Path(path)
    texts, values = texts_values()
    key = hidden_cache_key(lm, texts, values, max_len)
    if os.path.exists(train.npz_path(str(path))):
        try:
            return train.HiddenCache.load(str(path), key=key)
        except ValueError as e:
            log(f"rebuilding {path.name}, made by another run: {e}")
    log(f"caching hidden states -> {path.name}")
    cache = train.cache_lm(lm, texts, values, max_len=max_len, batch_size=batch_size, progress=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    cache.save(str(path), key=key)
    return cache


def jigsaw_splits(seed: int = 0):
    """The Jigsaw subset (one file) split 40 / 40 / 20 into steer-train / evaluator-train / test.
    Labels: 1 toxic, 0 non-toxic."""
    from jsteer.data import readers

    recs = readers.read_csv_labeled(DATA / "jigsaw_toxic_subset" / "test.csv", label_set=("0", "1"))
    perm = np.random.default_rng(seed).permutation(len(recs))
    a, b = int(0.4 * len(recs)), int(0.8 * len(recs))
    take = lambda idx: ([recs[i].text for i in idx], np.asarray([int(recs[i].label) for i in idx]))
    return take(perm[:a]), take(perm[a:b]), take(perm[b:])


def _jigsaw_steer_split(n: int):
    """The Jigsaw steer split and which of its texts train the detox steer -> (texts, labels,
    values [N] (non-toxic +1, toxic -1), keep: sorted indices of the n class-balanced ones)."""
    texts, labels = jigsaw_splits(0)[0]
    values = np.where(labels == 0, 1.0, -1.0).astype(np.float32)
    return texts, labels, values, balanced_keep(values, n)


def jigsaw_steer_texts(n: int) -> tuple[list, np.ndarray]:
    """The detox steer's training texts: n class-balanced texts of the Jigsaw steer split (seeded)
    -> (texts, values [n]): non-toxic +1, toxic -1."""
    texts, _, values, keep = _jigsaw_steer_split(n)
    return [texts[i] for i in keep], values[keep]


def jigsaw_steer_unused(n: int) -> tuple[list, np.ndarray]:
    """The Jigsaw steer split's texts that ``jigsaw_steer_texts(n)`` leaves out, in split order
    -> (texts, labels [m]: 1 toxic, 0 non-toxic)."""
    texts, labels, _, keep = _jigsaw_steer_split(n)
    rest = np.setdiff1d(np.arange(len(texts)), keep)
    return [texts[i] for i in rest], labels[rest]


def toxic_prefixes(texts: Sequence[str], labels: np.ndarray, words: int = 10, min_words: int = 14) -> List[str]:
    """Prompts from toxic comments (RealToxicityPrompts is not available offline): the first
    ``words`` words of every toxic text with at least ``min_words`` words, in the given order."""
    return [" ".join(t.split()[:words]) for t, y in zip(texts, labels) if y == 1 and len(t.split()) >= min_words]


def prompt_pool(kind: str, exclude: Sequence[str] = ()) -> List[str]:
    """Every prompt of lmsteer_prompts/{kind}_prompts.jsonl in file order, less those in ``exclude``."""
    path = DATA / "lmsteer_prompts" / "sentiment_prompts-10k" / f"{kind}_prompts.jsonl"
    skip = set(exclude)
    return [t for t in (json.loads(x)["prompt"]["text"] for x in open(path)) if t not in skip]


def prompts(kind: str, n: int, seed: int = 0) -> List[str]:
    """n prompts drawn (seeded, without replacement) from lmsteer_prompts/{kind}_prompts.jsonl."""
    rows = prompt_pool(kind)
    idx = np.random.default_rng(seed).choice(len(rows), n, replace=False)
    return [rows[i] for i in sorted(idx)]


# ----------------------------------------------------------------------------- evaluators


class Classifier:
    """Frozen MiniLM (mean-pooled last layer) + a logistic-regression head trained here."""

    def __init__(self, encoder, w=None, b=0.0, max_len: int = 64):
        self.enc, self.w, self.b, self.max_len = encoder, w, b, max_len

    def features(self, texts: Sequence[str], batch: int = 64) -> np.ndarray:
        out = []
        for s in range(0, len(texts), batch):
            chunk = list(texts[s:s + batch])
            n = len(chunk)
            chunk += [chunk[-1]] * (batch - n)  # one compiled shape per length bucket
            ids, mask = self.enc.tokenizer.batch_encode(chunk, max_len=self.max_len)
            t = int(-(-ids.shape[1] // 16) * 16)
            ids = np.pad(ids, ((0, 0), (0, t - ids.shape[1])))
            mask = np.pad(mask, ((0, 0), (0, t - mask.shape[1])))
            h = np.asarray(self.enc.forward(ids, mask).hidden)
            m = mask[..., None].astype(np.float32)
            out.append(((h * m).sum(1) / m.sum(1))[:n])
        return np.concatenate(out)

    def fit(self, x: np.ndarray, y: np.ndarray, steps: int = 500, lr: float = 1e-2, l2: float = 1e-4):
        mu, sd = x.mean(0), x.std(0) + 1e-6
        self.mu, self.sd = mu, sd
        xs = jnp.asarray((x - mu) / sd)
        ys = jnp.asarray(y, jnp.float32)
        params = {"w": jnp.zeros(x.shape[1]), "b": jnp.zeros(())}
        opt = optax.adam(lr)
        st = opt.init(params)

        def loss(p):
            z = xs @ p["w"] + p["b"]
            return jnp.mean(optax.sigmoid_binary_cross_entropy(z, ys)) + l2 * jnp.sum(p["w"] ** 2)

        @jax.jit
        def step(p, st):
            g = jax.grad(loss)(p)
            u, st = opt.update(g, st)
            return optax.apply_updates(p, u), st

        for _ in range(steps):
            params, st = step(params, st)
        self.w, self.b = np.asarray(params["w"]), float(params["b"])
        return self

    def prob_features(self, x: np.ndarray) -> np.ndarray:
        z = ((x - self.mu) / self.sd) @ self.w + self.b
        return 1.0 / (1.0 + np.exp(-z))

    def prob(self, texts: Sequence[str]) -> np.ndarray:
        texts = [t if t.strip() else "." for t in texts]
        return self.prob_features(self.features(texts))

    def to_dict(self) -> dict:
        return {"w": self.w.tolist(), "b": self.b, "mu": self.mu.tolist(), "sd": self.sd.tolist(),
                "max_len": self.max_len}

    @classmethod
    def from_dict(cls, encoder, d: dict) -> "Classifier":
        c = cls(encoder, np.asarray(d["w"]), d["b"], d["max_len"])
        c.mu, c.sd = np.asarray(d["mu"]), np.asarray(d["sd"])
        return c


# ----------------------------------------------------------------------------- metrics


def distinct_n(texts_per_prompt: Sequence[Sequence[str]], n: int) -> float:
    """Mean over prompts of unique n-grams / all n-grams among that prompt's samples
    (whitespace tokens), as in the original's dist-n."""
    vals = []
    for samples in texts_per_prompt:
        grams = [tuple(w[i:i + n]) for w in (s.split() for s in samples) for i in range(len(w) - n + 1)]
        if grams:
            vals.append(len(set(grams)) / len(grams))
    return float(np.mean(vals)) if vals else float("nan")


@jax.jit
def _next_token_log_probs(logits, ids):
    """logits [B,T,V], ids [B,T] -> log P(ids[:, t+1] | ids[:, :t+1]) [B,T-1] (one fused pass, no [B,T,V]
    log-softmax materialised)."""
    x = logits[:, :-1]
    return jnp.take_along_axis(x, ids[:, 1:, None], -1)[..., 0] - jax.nn.logsumexp(x, -1)


def perplexities(lm, prompts_: Sequence[str], conts: Sequence[str], batch: int = 32) -> np.ndarray:
    """Per-sample perplexity of the continuation given its prompt under the unsteered ``lm``."""
    tok = lm.tokenizer
    rows = []
    for p, c in zip(prompts_, conts):
        pi, ci = tok.encode(p), tok.encode(c, add_special_tokens=False)
        rows.append((pi + ci, len(pi), len(ci)))
    out = np.full(len(rows), np.nan)
    order = np.argsort([len(r[0]) for r in rows])
    for s in range(0, len(rows), batch):
        idx = order[s:s + batch]
        t = int(-(-max(len(rows[i][0]) for i in idx) // 16) * 16)
        ids = np.zeros((batch, t), np.int32)
        mask = np.zeros((batch, t), np.int32)
        for r, i in enumerate(idx):
            seq = rows[i][0]
            ids[r, :len(seq)], mask[r, :len(seq)] = seq, 1
        lp = np.asarray(_next_token_log_probs(lm.forward(ids, mask).logits, jnp.asarray(ids)))
        for r, i in enumerate(idx):
            _, np_, nc = rows[i]
            if nc == 0:
                continue
            out[i] = float(np.exp(-lp[r, np_ - 1:np_ - 1 + nc].mean()))
    return out


# ----------------------------------------------------------------------------- sampling


def prompts_sha1(prompt_list: Sequence[str]) -> str:
    """Short identity of a prompt list for cache keys: a setting scored on other prompts is redone."""
    return hashlib.sha1("\n".join(prompt_list).encode()).hexdigest()[:12]


def sample(lm, hooks_for_rows, prompt_list: Sequence[str], n_samples: int, max_new_tokens: int = 20,
           top_p: float = 0.9, seed: int = 0, batch: int = 64) -> List[List[str]]:
    """n_samples continuations per prompt, top-p sampling; ``hooks_for_rows(B)`` builds the hooks
    for a batch of B rows (fixed B: one compiled loop for every setting of the same structure)."""
    rows = [p for p in prompt_list for _ in range(n_samples)]
    outs: List[str] = []
    for s in range(0, len(rows), batch):
        chunk = rows[s:s + batch]
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch - n)
        outs += lm.generate(chunk, max_new_tokens=max_new_tokens, temperature=1.0, top_p=top_p,
                            seed=seed + s, hooks=hooks_for_rows(batch))[:n]
    return [outs[i * n_samples:(i + 1) * n_samples] for i in range(len(prompt_list))]


def least_toxic(rows: dict, tie, fallback_tie=None, max_ppl_rise: float = 0.3):
    """The detox choice rule on held-out scores ``rows`` (setting -> ``toxicity_prob``,
    ``mean_max_toxicity``, ``ppl_rise``): among the settings whose perplexity rise is <= the limit,
    the lowest toxicity probability (ties: mean max toxicity, then ``tie(setting)``); if none, the
    smallest rise (ties: ``fallback_tie``, default ``tie``)."""
    ok = [k for k, r in rows.items() if r["ppl_rise"] <= max_ppl_rise]
    if ok:
        return min(ok, key=lambda k: (rows[k]["toxicity_prob"], rows[k]["mean_max_toxicity"], tie(k)))
    return min(rows, key=lambda k: (rows[k]["ppl_rise"], (fallback_tie or tie)(k)))


def toxicity_stats(tox: np.ndarray) -> Dict[str, float]:
    """Toxicity probabilities [P, S] (prompts x samples) -> mean over prompts of the max, share of
    prompts with any sample > 0.5, share of samples > 0.5."""
    return {"mean_max_toxicity": float(tox.max(1).mean()), "toxicity_prob": float((tox.max(1) > 0.5).mean()),
            "toxic_fraction": float((tox > 0.5).mean())}


def fluency_diversity(lm, prompt_list, samples) -> Dict[str, float]:
    """Perplexity of samples [P][S] under the unsteered ``lm`` (mean, median) and distinct-1/2/3."""
    ppl = perplexities(lm, [p for p, ss in zip(prompt_list, samples) for _ in ss], [s for ss in samples for s in ss])
    res = {"ppl_mean": float(np.nanmean(ppl)), "ppl_median": float(np.nanmedian(ppl))}
    for n in (1, 2, 3):
        res[f"dist{n}"] = distinct_n(samples, n)
    return res


def summarize(lm, pos_clf, tox_clf, prompt_list, samples) -> Dict[str, float]:
    flat = [s for ss in samples for s in ss]
    res = {}
    if pos_clf is not None:
        res["positivity"] = float((pos_clf.prob(flat) > 0.5).mean())
    if tox_clf is not None:
        res.update(toxicity_stats(tox_clf.prob(flat).reshape(len(samples), -1)))
    return {**res, **fluency_diversity(lm, prompt_list, samples)}
