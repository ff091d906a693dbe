"""How the LM-Steer experiments score generated text: evaluators, fluency, diversity, sampling.

- :class:`Evaluator`: all-MiniLM-L6-v2 fully fine-tuned by :class:`jsteer.train.Trainer` (masked
  mean pool -> a linear logit; sigmoid cross-entropy, AdamW, linear decay, 10% warmup, encoder lr
  5e-5, head lr 1e-3, dropout 0.1, texts cut to 64 MiniLM tokens): sentiment on SST-5, toxicity on
  the Jigsaw subset (:func:`get`), and the steer-text labelers of on-policy training
  (:func:`get_labeler`). Trained evaluators are cached as Orbax artifacts under
  ``out/steer_evaluators/``, keyed by their training recipe (:func:`cache_path`), so recipes that
  differ never load each other's evaluator.
- :class:`Classifier`: frozen MiniLM + a logistic-regression head (the older evaluator layout).
- :func:`perplexities`, :func:`distinct_n`, :func:`fluency_diversity`, :func:`toxicity_stats`,
  :func:`summarize`: per-setting metrics of samples [P][S] (prompts x samples).
- :func:`sample`: batched top-p sampling with steer hooks, one compiled loop per batch shape.
"""

from __future__ import annotations

import pathlib
import time
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jsteer.backbones.base import logsumexp
from jsteer.data.buckets import bucket
from jsteer.steer import data
from jsteer.workspace import OUT, log

CACHE = OUT / "steer_evaluators"
MAX_LEN = 64


def _round16(n: int) -> int:
    """A batch's text length rounded up to a multiple of 16: a few compiled shapes."""
    return bucket(n, (16,), "multiple")


# ----------------------------------------------------------------------------- fine-tuned evaluators


def pooled_logit(module, params, ids, mask, rng=None):
    """MiniLM -> masked mean of the last layer -> logit [B]. Dropout on when ``rng`` is given."""
    kw = {"rngs": {"dropout": rng}, "deterministic": False} if rng is not None else {}
    h = module.apply({"params": params["bert"]}, ids, attention_mask=mask, **kw).hidden  # [B, T, D]
    m = mask[..., None].astype(h.dtype)
    pooled = jnp.sum(h * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0)  # [B, D]
    return jnp.einsum("bd,d->b", pooled, params["head"]["w"]) + params["head"]["b"]


def _batch(tok, texts: Sequence[str], batch: int):
    """Fixed batch rows (the last text repeated), T rounded up to 16 -> (ids, mask) [batch, T]."""
    n = len(texts)
    texts = list(texts) + [texts[-1]] * (batch - n)
    ids, mask = tok.batch_encode(texts, max_len=MAX_LEN)
    t = _round16(ids.shape[1])
    return np.pad(ids, ((0, 0), (0, t - ids.shape[1]))), np.pad(mask, ((0, 0), (0, t - mask.shape[1])))


class Evaluator:
    """A fine-tuned MiniLM binary classifier: ``prob(texts) -> P(positive class) [N]``."""

    def __init__(self, enc, params, meta=None):
        self.enc, self.params, self.meta = enc, params, dict(meta or {})
        self._f = jax.jit(lambda p, i, m: jax.nn.sigmoid(pooled_logit(enc.module, p, i, m)))

    def prob(self, texts: Sequence[str], batch: int = 64) -> np.ndarray:
        texts = [t if t.strip() else "." for t in texts]
        out = []
        for s in range(0, len(texts), batch):
            chunk = texts[s : s + batch]
            ids, mask = _batch(self.enc.tokenizer, chunk, batch)
            out.append(np.asarray(self._f(self.params, ids, mask))[: len(chunk)])
        return np.concatenate(out) if out else np.zeros(0)

    def accuracy(self, texts, labels) -> float:
        return float(((self.prob(texts) > 0.5) == np.asarray(labels).astype(bool)).mean())


def finetune(
    enc,
    texts,
    labels,
    epochs: float = 2.0,
    batch: int = 32,
    lr: float = 5e-5,
    head_lr: float = 1e-3,
    seed: int = 0,
    log_every: int = 20,
) -> tuple:
    """Full fine-tune of MiniLM + logit head with jsteer.train.Trainer -> (params, history).
    A SIGTERM exits (143) after the current step, so a cut evaluator is never saved."""
    from jsteer.train import OptimizerConfig, Trainer

    labels = np.asarray(labels, np.float32)
    n = len(texts)
    steps = max(1, int(round(epochs * n / batch)))
    d = enc.config.hidden_size
    params = {"bert": enc.params, "head": {"w": jnp.zeros((d,), jnp.float32), "b": jnp.zeros((), jnp.float32)}}
    module = enc.module

    def loss_fn(p, b, rng):
        z = pooled_logit(module, p, b["ids"], b["mask"], rng)
        loss = jnp.mean(optax.sigmoid_binary_cross_entropy(z, b["y"]))
        return loss, {"acc": jnp.mean((z > 0) == (b["y"] > 0.5))}

    # Length-bucketed batches: shuffle, sort each chunk of 50 batches by length, then shuffle batches.
    rng = np.random.default_rng(seed)
    lens = np.asarray([len(enc.tokenizer.encode(t)) for t in texts])

    def batches():
        while True:
            perm = rng.permutation(n)
            groups = []
            for s in range(0, n, batch * 50):
                blk = perm[s : s + batch * 50]
                blk = blk[np.argsort(lens[blk], kind="stable")]
                groups += [blk[i : i + batch] for i in range(0, len(blk), batch) if len(blk[i : i + batch]) == batch]
            for g in rng.permutation(len(groups)):
                idx = groups[g]
                ids, mask = _batch(enc.tokenizer, [texts[i] for i in idx], batch)
                yield {"ids": ids, "mask": mask, "y": labels[idx]}

    opt = OptimizerConfig(
        learning_rate={"enc": lr, "head": head_lr},
        labels=lambda path, leaf: "head" if path[0] == "head" else "enc",
        schedule="linear",
        warmup_steps=max(1, steps // 10),
        total_steps=steps,
        weight_decay=0.01,
        clip_norm=1.0,
    )
    trainer = Trainer(loss_fn, params, opt, progress=False, log_every=log_every, seed=seed)
    hist = {"step": [], "loss": [], "acc": []}
    t0 = time.time()

    def on_step(s, m):
        if s % log_every == 0 or s == steps:
            hist["step"].append(s)
            hist["loss"].append(float(m["loss"]))
            hist["acc"].append(float(m.get("acc", np.nan)))
            log(f"  step {s}/{steps}: loss {hist['loss'][-1]:.4f} ({time.time() - t0:.0f}s)")

    trainer.fit(batches(), steps, resume=False, on_step=on_step)
    hist["seconds"] = time.time() - t0
    hist["steps"] = steps
    return jax.device_get(trainer.params), hist


def cache_path(name: str, epochs: float = 2.0, max_train: int = 0, max_test: int = 0) -> pathlib.Path:
    """Where :func:`get` caches evaluator ``name`` trained with this recipe: ``CACHE/<name>`` for
    the default (2 epochs, whole splits), else ``CACHE/<name>_e<epochs>[_n<max_train>][_t<max_test>]``."""
    if (epochs, max_train, max_test) == (2.0, 0, 0):
        return CACHE / name
    return CACHE / (
        f"{name}_e{epochs:g}" + (f"_n{max_train}" if max_train else "") + (f"_t{max_test}" if max_test else "")
    )


def _cached(path: pathlib.Path, enc, train, retrain: bool = False, recipe: Optional[dict] = None) -> Evaluator:
    """The classifier saved at ``path``; if absent (or ``retrain``, or saved with another
    ``recipe`` than its metadata's), ``train(enc)`` -> a fitted Evaluator with its meta (and
    ``recipe``), saved there first."""
    import jsteer
    from jsteer.checkpoints import load_artifact, save_artifact

    enc = enc if enc is not None else jsteer.load("minilm")
    if path.exists() and not retrain:
        tree, meta = load_artifact(path)
        # caches written before the key held the recipe knew only their epochs
        saved = meta.get("recipe") or (recipe and {**recipe, "epochs": meta.get("epochs")})
        if saved == recipe:
            return Evaluator(enc, jax.tree.map(jnp.asarray, tree), meta)
        log(f"{path} was trained with {saved}, not {recipe}: retraining it")
    ev = train(enc)
    if recipe is not None:
        ev.meta["recipe"] = dict(recipe)
    save_artifact(path, ev.params, ev.meta)
    return ev


def get(
    name: str, enc=None, epochs: float = 2.0, retrain: bool = False, max_train: int = 0, max_test: int = 0
) -> Evaluator:
    """Load the cached evaluator ``name`` ("sentiment" | "toxicity"), training it if absent
    (sentiment: :func:`jsteer.steer.data.sentiment_data`; toxicity: the Jigsaw evaluator split;
    ``max_train`` / ``max_test``: the first texts of each, 0 for all)."""

    def train(enc):
        (x, y), (xt, yt) = data.sentiment_data() if name == "sentiment" else data.toxicity_data()
        if max_train:
            x, y = x[:max_train], y[:max_train]  # both splits are already in seeded random order
        if max_test:
            xt, yt = xt[:max_test], yt[:max_test]
        log(f"fine-tuning the {name} evaluator on {len(x)} texts ({epochs} epochs)")
        params, hist = finetune(enc, x, y, epochs=epochs)
        ev = Evaluator(enc, params)
        t0 = time.time()
        acc = ev.accuracy(xt, yt)
        ev.meta = {
            "name": name,
            "accuracy": acc,
            "test_texts": len(xt),
            "train_texts": len(x),
            "epochs": epochs,
            "steps": hist["steps"],
            "train_seconds": hist["seconds"],
            "eval_seconds": time.time() - t0,
            "loss": hist["loss"],
            "loss_steps": hist["step"],
            "model": "all-MiniLM-L6-v2 fully fine-tuned, mean pool + linear logit, max 64 tokens",
            "train": (
                "SST-5 train half not used for the steer + SST-5 dev, binary (0-1 vs 3-4), detokenised"
                if name == "sentiment"
                else "Jigsaw subset evaluator split (40%, not used for the steer)"
            ),
            "test": (
                "SST-5 test binary (0-1 vs 3-4), detokenised"
                if name == "sentiment"
                else "Jigsaw subset test split (20%)"
            ),
        }
        log(f"{name} evaluator: test accuracy {acc:.4f}")
        return ev

    recipe = {"epochs": epochs, "max_train": max_train, "max_test": max_test}
    return _cached(cache_path(name, epochs, max_train, max_test), enc, train, retrain, recipe)


def get_labeler(enc=None, n: int = 1600, epochs: float = 2.0, task: str = "sentiment") -> Evaluator:
    """A classifier trained on a steer's own ``n`` training texts, cached under
    out/steer_evaluators/labeler_steer{n} (sentiment: the sentiment steer's SST-5 texts, detokenised,
    P(positive)) or labeler_detox{n} (toxicity: the detox steer's Jigsaw texts, P(toxic)). It labels
    the model's own continuations for on-policy steer training
    (:func:`jsteer.steer.data.ranked_continuations`) without the evaluator, which never sees these
    texts, taking part; its accuracy is on 1000 test texts of the evaluator's test set."""
    if task not in ("sentiment", "toxicity"):
        raise ValueError(f"get_labeler: task must be 'sentiment' or 'toxicity', got {task!r}")

    def train(enc):
        if task == "sentiment":
            texts, values = data.sentiment_steer_texts(n)
            texts, values = [data.detok_sst(t) for t in texts], values[:, 0]
            (_, _), (xt, yt) = data.sentiment_data()
            what = f"the sentiment steer's {n} SST-5 texts (steer half), binary, detokenised"
        else:
            texts, values = data.jigsaw_steer_texts(n)
            xt, yt = data.toxicity_data()[1]
            what = f"the detox steer's {n} Jigsaw texts (steer split), label 1 = toxic"
        labels = (values > 0) if task == "sentiment" else (values < 0)
        log(f"fine-tuning the {task} steer-text labeler on {n} texts ({epochs} epochs)")
        params, hist = finetune(enc, list(texts), labels.astype(np.float32), epochs=epochs)
        ev = Evaluator(enc, params)
        ev.meta = {
            "name": name,
            "accuracy": ev.accuracy(xt[:1000], yt[:1000]),
            "test_texts": 1000,
            "train_texts": n,
            "epochs": epochs,
            "steps": hist["steps"],
            "train_seconds": hist["seconds"],
            "train": what,
        }
        log(f"labeler: test accuracy {ev.meta['accuracy']:.4f}")
        return ev

    name = f"labeler_steer{n}" if task == "sentiment" else f"labeler_detox{n}"
    return _cached(CACHE / name, enc, train)


# ----------------------------------------------------------------------------- logistic-head classifier


class Classifier:
    """Frozen MiniLM (mean-pooled last layer) + a logistic-regression head trained here."""

    def __init__(self, encoder, w=None, b=0.0, max_len: int = 64):
        self.enc, self.w, self.b, self.max_len = encoder, w, b, max_len

    def features(self, texts: Sequence[str], batch: int = 64) -> np.ndarray:
        """Mean-pooled last-layer features [N, D]."""
        out = []
        for s in range(0, len(texts), batch):
            chunk = list(texts[s : s + batch])
            n = len(chunk)
            chunk += [chunk[-1]] * (batch - n)  # one compiled shape per length bucket
            ids, mask = self.enc.tokenizer.batch_encode(chunk, max_len=self.max_len)
            t = _round16(ids.shape[1])
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
        return {
            "w": self.w.tolist(),
            "b": self.b,
            "mu": self.mu.tolist(),
            "sd": self.sd.tolist(),
            "max_len": self.max_len,
        }

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
        grams = [tuple(w[i : i + n]) for w in (s.split() for s in samples) for i in range(len(w) - n + 1)]
        if grams:
            vals.append(len(set(grams)) / len(grams))
    return float(np.mean(vals)) if vals else float("nan")


@jax.jit
def _next_token_log_probs(logits, ids):
    """logits [B,T,V], ids [B,T] -> log P(ids[:, t+1] | ids[:, :t+1]) [B,T-1] (one fused pass, no [B,T,V]
    log-softmax materialised)."""
    x = logits[:, :-1]
    return jnp.take_along_axis(x, ids[:, 1:, None], -1)[..., 0] - logsumexp(x)


def perplexities(lm, prompts_: Sequence[str], conts: Sequence[str], batch: int = 32) -> np.ndarray:
    """Per-sample perplexity [N] of the continuation given its prompt under the unsteered ``lm``."""
    tok = lm.tokenizer
    rows = []
    for p, c in zip(prompts_, conts):
        pi, ci = tok.encode(p), tok.encode(c, add_special_tokens=False)
        rows.append((pi + ci, len(pi), len(ci)))
    out = np.full(len(rows), np.nan)
    order = np.argsort([len(r[0]) for r in rows])
    for s in range(0, len(rows), batch):
        idx = order[s : s + batch]
        t = _round16(max(len(rows[i][0]) for i in idx))
        ids = np.zeros((batch, t), np.int32)
        mask = np.zeros((batch, t), np.int32)
        for r, i in enumerate(idx):
            seq = rows[i][0]
            ids[r, : len(seq)], mask[r, : len(seq)] = seq, 1
        lp = np.asarray(_next_token_log_probs(lm.forward(ids, mask).logits, jnp.asarray(ids)))
        for r, i in enumerate(idx):
            _, np_, nc = rows[i]
            if nc == 0:
                continue
            out[i] = float(np.exp(-lp[r, np_ - 1 : np_ - 1 + nc].mean()))
    return out


def toxicity_stats(tox: np.ndarray) -> Dict[str, float]:
    """Toxicity probabilities [P, S] (prompts x samples) -> mean over prompts of the max, share of
    prompts with any sample > 0.5, share of samples > 0.5."""
    return {
        "mean_max_toxicity": float(tox.max(1).mean()),
        "toxicity_prob": float((tox.max(1) > 0.5).mean()),
        "toxic_fraction": float((tox > 0.5).mean()),
    }


def fluency_diversity(lm, prompt_list, samples) -> Dict[str, float]:
    """Perplexity of samples [P][S] under the unsteered ``lm`` (mean, median) and distinct-1/2/3."""
    ppl = perplexities(lm, [p for p, ss in zip(prompt_list, samples) for _ in ss], [s for ss in samples for s in ss])
    res = {"ppl_mean": float(np.nanmean(ppl)), "ppl_median": float(np.nanmedian(ppl))}
    for n in (1, 2, 3):
        res[f"dist{n}"] = distinct_n(samples, n)
    return res


def summarize(lm, pos_clf, tox_clf, prompt_list, samples) -> dict:
    """Positivity (share of samples ``pos_clf`` calls positive; ``positivity_per_prompt`` [P]),
    toxicity stats (``tox_clf``; either may be None) and :func:`fluency_diversity` of samples [P][S]."""
    flat = [s for ss in samples for s in ss]
    res = {}
    if pos_clf is not None:
        positive = (pos_clf.prob(flat) > 0.5).reshape(len(samples), -1)
        res["positivity"] = float(positive.mean())
        # per prompt, for intervals that resample prompts (samples of one prompt are not independent)
        res["positivity_per_prompt"] = positive.mean(axis=1).tolist()
    if tox_clf is not None:
        res.update(toxicity_stats(tox_clf.prob(flat).reshape(len(samples), -1)))
    return {**res, **fluency_diversity(lm, prompt_list, samples)}


# ----------------------------------------------------------------------------- sampling


def sample(
    lm,
    hooks_for_rows,
    prompt_list: Sequence[str],
    n_samples: int,
    max_new_tokens: int = 20,
    top_p: float = 0.9,
    seed: int = 0,
    batch: int = 64,
) -> List[List[str]]:
    """n_samples continuations per prompt, top-p sampling -> [P][n_samples]; ``hooks_for_rows(B)``
    builds the hooks for a batch of B rows (fixed B: one compiled loop for every setting of the
    same structure)."""
    rows = [p for p in prompt_list for _ in range(n_samples)]
    outs: List[str] = []
    for s in range(0, len(rows), batch):
        chunk = rows[s : s + batch]
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch - n)
        outs += lm.generate(
            chunk,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            top_p=top_p,
            seed=seed + s,
            hooks=hooks_for_rows(batch),
        )[:n]
    return [outs[i * n_samples : (i + 1) * n_samples] for i in range(len(prompt_list))]
