"""Fine-tuned MiniLM evaluators for the LM-Steer experiments (sentiment on SST-5, toxicity on
the Jigsaw subset), trained with jsteer's own engine (jsteer.train.Trainer).

Model: all-MiniLM-L6-v2 encoder (every weight trained) -> masked mean pool -> a linear logit
(binary: sentiment positive / text toxic). Loss: sigmoid cross-entropy; AdamW, linear decay,
10% warmup, encoder lr 5e-5, head lr 1e-3, dropout 0.1, texts cut to 64 MiniLM tokens.

    .venv/bin/python experiments/steer_evaluators.py [--epochs 2]

The trained evaluators are cached as Orbax artifacts under out/steer_evaluators/ (the accuracies
travel in their metadata); reruns load them instead of retraining. The cache is keyed by the
training recipe (:func:`cache_path`: ``sentiment`` / ``toxicity`` for the default 2 epochs on whole
splits, ``toxicity_e0.8_n1600_t1000`` for ``--epochs 0.8 --max-train 1600 --max-test 1000``), so
recipes that differ never load each other's evaluator.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import steer_common as C  # noqa: E402

import jsteer  # noqa: E402

CACHE = C.ROOT / "out" / "steer_evaluators"
MAX_LEN = 64


# ----------------------------------------------------------------------------- text


_DETOK = [(r" n't\b", "n't"), (r" '(s|re|ve|ll|d|m)\b", r"'\1"), (r" ([,.!?;:%])", r"\1"),
          (r"-lrb- ?", "("), (r" ?-rrb-", ")"), (r"`` ?", '"'), (r" ?''", '"'), (r"\$ (\d)", r"$\1"),
          (r"\s+", " ")]


def detok_sst(text: str) -> str:
    """SST's PTB-tokenised lower-case sentences -> ordinary English spacing, first letter
    upper-cased (e.g. 'it 's a film that wo n't sit still .' -> "It's a film that won't sit still.").
    Used for the steer's training texts (so that the dummy steer is not spent on PTB spacing)
    and for the sentiment evaluator (which judges ordinary generated text)."""
    t = text.strip()
    if len(t) >= 2 and t[0] == '"' and t[-1] == '"':
        t = t[1:-1].strip()
    for pat, rep in _DETOK:
        t = re.sub(pat, rep, t)
    t = t.strip()
    return t[:1].upper() + t[1:]


# ----------------------------------------------------------------------------- model


def pooled_logit(module, params, ids, mask, rng=None):
    """MiniLM -> masked mean of the last layer -> logit [B]. Dropout on when ``rng`` is given."""
    kw = {"rngs": {"dropout": rng}, "deterministic": False} if rng is not None else {}
    h = module.apply({"params": params["bert"]}, ids, attention_mask=mask, **kw).hidden  # [B, T, D]
    m = mask[..., None].astype(h.dtype)
    pooled = jnp.sum(h * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0)  # [B, D]
    return jnp.einsum("bd,d->b", pooled, params["head"]["w"]) + params["head"]["b"]


def _batch(tok, texts: Sequence[str], batch: int):
    """Fixed batch rows, T rounded up to 16 (a few compiled shapes)."""
    n = len(texts)
    texts = list(texts) + [texts[-1]] * (batch - n)
    ids, mask = tok.batch_encode(texts, max_len=MAX_LEN)
    t = int(-(-ids.shape[1] // 16) * 16)
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
            chunk = texts[s:s + batch]
            ids, mask = _batch(self.enc.tokenizer, chunk, batch)
            out.append(np.asarray(self._f(self.params, ids, mask))[:len(chunk)])
        return np.concatenate(out) if out else np.zeros(0)

    def accuracy(self, texts, labels) -> float:
        return float(((self.prob(texts) > 0.5) == np.asarray(labels).astype(bool)).mean())


def finetune(enc, texts, labels, epochs: float = 2.0, batch: int = 32, lr: float = 5e-5, head_lr: float = 1e-3,
             seed: int = 0, log_every: int = 20) -> tuple:
    """Full fine-tune of MiniLM + logit head with jsteer.train.Trainer -> (params, history).
    A SIGTERM exits (143) after the current step, so a cut evaluator is never saved."""
    from jsteer.train import OptimizerConfig, Trainer

    labels = np.asarray(labels, np.float32)
    n = len(texts)
    steps = max(1, int(round(epochs * n / batch)))
    d = enc.config.hidden_size
    params = {"bert": enc.params,
              "head": {"w": jnp.zeros((d,), jnp.float32), "b": jnp.zeros((), jnp.float32)}}
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
                blk = perm[s:s + batch * 50]
                blk = blk[np.argsort(lens[blk], kind="stable")]
                groups += [blk[i:i + batch] for i in range(0, len(blk), batch) if len(blk[i:i + batch]) == batch]
            for g in rng.permutation(len(groups)):
                idx = groups[g]
                ids, mask = _batch(enc.tokenizer, [texts[i] for i in idx], batch)
                yield {"ids": ids, "mask": mask, "y": labels[idx]}

    opt = OptimizerConfig(learning_rate={"enc": lr, "head": head_lr},
                          labels=lambda path, leaf: "head" if path[0] == "head" else "enc",
                          schedule="linear", warmup_steps=max(1, steps // 10), total_steps=steps,
                          weight_decay=0.01, clip_norm=1.0)
    trainer = Trainer(loss_fn, params, opt, progress=False, log_every=log_every, seed=seed)
    hist = {"step": [], "loss": [], "acc": []}
    t0 = time.time()

    def on_step(s, m):
        if s % log_every == 0 or s == steps:
            hist["step"].append(s)
            hist["loss"].append(float(m["loss"]))
            hist["acc"].append(float(m.get("acc", np.nan)))
            C.log(f"  step {s}/{steps}: loss {hist['loss'][-1]:.4f} ({time.time() - t0:.0f}s)")

    trainer.fit(batches(), steps, resume=False, on_step=on_step)
    hist["seconds"] = time.time() - t0
    hist["steps"] = steps
    return jax.device_get(trainer.params), hist


# ----------------------------------------------------------------------------- data


def sentiment_data():
    """(train texts, labels), (test texts, labels): SST-5 binary (0-1 vs 3-4), detokenised.
    Train = the half of SST-5 train that the steer never sees (same seeded split as the
    experiment) + SST-5 dev; test = SST-5 test."""
    tr, ytr = C.sst5("train")
    _, clf_idx = C.steer_split(len(tr))
    dv, ydv = C.sst5("dev")
    te, yte = C.sst5("test")
    x = [detok_sst(tr[i]) for i in clf_idx] + [detok_sst(t) for t in dv]
    y = np.concatenate([ytr[clf_idx], ydv])
    return (x, y), ([detok_sst(t) for t in te], yte)


def toxicity_data():
    """Jigsaw subset: evaluator split (40%) for training, test split (20%); label 1 = toxic."""
    _, clf, test = C.jigsaw_splits(0)
    return clf, test


def cache_path(name: str, epochs: float = 2.0, max_train: int = 0, max_test: int = 0) -> pathlib.Path:
    """Where :func:`get` caches evaluator ``name`` trained with this recipe: ``CACHE/<name>`` for
    the default (2 epochs, whole splits), else ``CACHE/<name>_e<epochs>[_n<max_train>][_t<max_test>]``."""
    if (epochs, max_train, max_test) == (2.0, 0, 0):
        return CACHE / name
    return CACHE / (f"{name}_e{epochs:g}" + (f"_n{max_train}" if max_train else "") + (f"_t{max_test}" if max_test else ""))


def _cached(path: pathlib.Path, enc, train, retrain: bool = False, recipe: Optional[dict] = None) -> Evaluator:
    """The classifier saved at ``path``; if absent (or ``retrain``, or saved with another
    ``recipe`` than its metadata's), ``train(enc)`` -> a fitted Evaluator with its meta (and
    ``recipe``), saved there first."""
    from jsteer.io import load_artifact, save_artifact

    enc = enc if enc is not None else jsteer.load("minilm")
    if path.exists() and not retrain:
        tree, meta = load_artifact(path)
        # caches written before the key held the recipe knew only their epochs
        saved = meta.get("recipe") or (recipe and {**recipe, "epochs": meta.get("epochs")})
        if saved == recipe:
            return Evaluator(enc, jax.tree.map(jnp.asarray, tree), meta)
        C.log(f"{path} was trained with {saved}, not {recipe}: retraining it")
    ev = train(enc)
    if recipe is not None:
        ev.meta["recipe"] = dict(recipe)
    save_artifact(path, ev.params, ev.meta)
    return ev


def get(name: str, enc=None, epochs: float = 2.0, retrain: bool = False, max_train: int = 0,
        max_test: int = 0) -> Evaluator:
    """Load the cached evaluator ``name`` ("sentiment" | "toxicity"), training it if absent."""

    def train(enc):
        (x, y), (xt, yt) = sentiment_data() if name == "sentiment" else toxicity_data()
        if max_train:
            x, y = x[:max_train], y[:max_train]  # both splits are already in seeded random order
        if max_test:
            xt, yt = xt[:max_test], yt[:max_test]
        C.log(f"fine-tuning the {name} evaluator on {len(x)} texts ({epochs} epochs)")
        params, hist = finetune(enc, x, y, epochs=epochs)
        ev = Evaluator(enc, params)
        t0 = time.time()
        acc = ev.accuracy(xt, yt)
        ev.meta = {"name": name, "accuracy": acc, "test_texts": len(xt), "train_texts": len(x),
                   "epochs": epochs, "steps": hist["steps"], "train_seconds": hist["seconds"],
                   "eval_seconds": time.time() - t0, "loss": hist["loss"], "loss_steps": hist["step"],
                   "model": "all-MiniLM-L6-v2 fully fine-tuned, mean pool + linear logit, max 64 tokens",
                   "train": ("SST-5 train half not used for the steer + SST-5 dev, binary (0-1 vs 3-4), detokenised"
                             if name == "sentiment" else "Jigsaw subset evaluator split (40%, not used for the steer)"),
                   "test": ("SST-5 test binary (0-1 vs 3-4), detokenised" if name == "sentiment"
                            else "Jigsaw subset test split (20%)")}
        C.log(f"{name} evaluator: test accuracy {acc:.4f}")
        return ev

    recipe = {"epochs": epochs, "max_train": max_train, "max_test": max_test}
    return _cached(cache_path(name, epochs, max_train, max_test), enc, train, retrain, recipe)


def get_labeler(enc=None, n: int = 1600, epochs: float = 2.0, task: str = "sentiment") -> Evaluator:
    """A classifier trained on a steer's own ``n`` training texts, cached under
    out/steer_evaluators/labeler_steer{n} (sentiment: the sentiment steer's SST-5 texts, detokenised,
    P(positive)) or labeler_detox{n} (toxicity: the detox steer's Jigsaw texts, P(toxic)). It labels
    the model's own continuations for on-policy steer training (``steer_common.ranked_continuations``)
    without the evaluator, which never sees these texts, taking part; its accuracy is on 1000 test
    texts of the evaluator's test set."""
    if task not in ("sentiment", "toxicity"):
        raise ValueError(f"get_labeler: task must be 'sentiment' or 'toxicity', got {task!r}")

    def train(enc):
        if task == "sentiment":
            texts, values = C.sentiment_steer_texts(n)
            texts, values = [detok_sst(t) for t in texts], values[:, 0]
            (_, _), (xt, yt) = sentiment_data()
            what = f"the sentiment steer's {n} SST-5 texts (steer half), binary, detokenised"
        else:
            texts, values = C.jigsaw_steer_texts(n)
            xt, yt = toxicity_data()[1]
            what = f"the detox steer's {n} Jigsaw texts (steer split), label 1 = toxic"
        labels = (values > 0) if task == "sentiment" else (values < 0)
        C.log(f"fine-tuning the {task} steer-text labeler on {n} texts ({epochs} epochs)")
        params, hist = finetune(enc, list(texts), labels.astype(np.float32), epochs=epochs)
        ev = Evaluator(enc, params)
        ev.meta = {"name": name, "accuracy": ev.accuracy(xt[:1000], yt[:1000]), "test_texts": 1000,
                   "train_texts": n, "epochs": epochs, "steps": hist["steps"], "train_seconds": hist["seconds"],
                   "train": what}
        C.log(f"labeler: test accuracy {ev.meta['accuracy']:.4f}")
        return ev

    name = f"labeler_steer{n}" if task == "sentiment" else f"labeler_detox{n}"
    return _cached(CACHE / name, enc, train)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--only", default="sentiment,toxicity")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--max-train", type=int, default=0, help="0: every text of the split")
    ap.add_argument("--max-test", type=int, default=0)
    a = ap.parse_args()
    enc = jsteer.load("minilm")
    old = C.json.loads((C.RESULTS / "evaluators.json").read_text()) if (C.RESULTS / "evaluators.json").exists() else {}
    out = {k: v for k, v in old.items() if isinstance(v, dict) and "steps" in v}  # keep fine-tuned entries only
    for name in a.only.split(","):
        ev = get(name, enc, epochs=a.epochs, retrain=a.retrain, max_train=a.max_train, max_test=a.max_test)
        out[name] = {k: v for k, v in ev.meta.items() if k not in ("loss", "loss_steps")}
        C.write_json(C.RESULTS / "evaluators.json", out)
    print(out)


if __name__ == "__main__":
    main()
