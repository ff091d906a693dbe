"""The LM-Steer experiments' texts: SST-5 / Jigsaw splits, prompts, on-policy texts and caches.

Every split is seeded, so each experiment (experiments/steer_*.py) and each evaluator
(:mod:`jsteer.steer.evaluate`) sees the same texts:

- SST-5 train without its neutral class, halved (:func:`steer_split`): the sentiment steer
  trains on one half (:func:`sentiment_steer_texts`), the sentiment evaluator on the other plus
  dev (:func:`sentiment_data`);
- the Jigsaw subset split 40 / 40 / 20 (:func:`jigsaw_splits`): detox steer texts, toxicity
  evaluator, test (toxic test comments' first words are the toxic prompts: :func:`toxic_prefixes`);
- the LM-Steer prompt files (:func:`prompts`, :func:`prompt_pool`);
- on-policy texts: the unsteered model's own continuations ranked by a labeler
  (:func:`ranked_continuations`, :func:`self_generated_texts`, :func:`self_detox_texts`);
- caches keyed by what made them (:func:`cached_texts`, :func:`cached_hidden`).

Texts are lists of str; steer values are float32 arrays [n] or [n, columns].
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import List, Sequence

import numpy as np

from jsteer.workspace import DATA, log, write_json

# ----------------------------------------------------------------------------- SST-5


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
    return perm[: n // 2], perm[n // 2 :]


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


_DETOK = [
    (r" n't\b", "n't"),
    (r" '(s|re|ve|ll|d|m)\b", r"'\1"),
    (r" ([,.!?;:%])", r"\1"),
    (r"-lrb- ?", "("),
    (r" ?-rrb-", ")"),
    (r"`` ?", '"'),
    (r" ?''", '"'),
    (r"\$ (\d)", r"$\1"),
    (r"\s+", " "),
]


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


def sentiment_data():
    """(train texts, labels), (test texts, labels): SST-5 binary (0-1 vs 3-4), detokenised.
    Train = the half of SST-5 train that the steer never sees (same seeded split as the
    experiment) + SST-5 dev; test = SST-5 test."""
    tr, ytr = sst5("train")
    _, clf_idx = steer_split(len(tr))
    dv, ydv = sst5("dev")
    te, yte = sst5("test")
    x = [detok_sst(tr[i]) for i in clf_idx] + [detok_sst(t) for t in dv]
    y = np.concatenate([ytr[clf_idx], ydv])
    return (x, y), ([detok_sst(t) for t in te], yte)


# ----------------------------------------------------------------------------- Jigsaw


def jigsaw_splits(seed: int = 0):
    """The Jigsaw subset (one file) split 40 / 40 / 20 into steer-train / evaluator-train / test.
    Labels: 1 toxic, 0 non-toxic."""
    from jsteer.data import readers

    recs = readers.read_csv_labeled(DATA / "jigsaw_toxic_subset" / "test.csv", label_set=("0", "1"))
    perm = np.random.default_rng(seed).permutation(len(recs))
    a, b = int(0.4 * len(recs)), int(0.8 * len(recs))

    def take(idx):
        return [recs[i].text for i in idx], np.asarray([int(recs[i].label) for i in idx])

    return take(perm[:a]), take(perm[a:b]), take(perm[b:])


def toxicity_data():
    """Jigsaw subset: evaluator split (40%) for training, test split (20%); label 1 = toxic."""
    _, clf, test = jigsaw_splits(0)
    return clf, test


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


# ----------------------------------------------------------------------------- prompts


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


def prompts_sha1(prompt_list: Sequence[str]) -> str:
    """Short identity of a prompt list for cache keys: a setting scored on other prompts is redone."""
    return hashlib.sha1("\n".join(prompt_list).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- on-policy texts


def ranked_continuations(
    lm,
    score,
    prompt_list: Sequence[str],
    n: int,
    samples: int,
    max_new_tokens: int = 32,
    seed: int = 1,
    columns: int = 1,
) -> tuple[list, np.ndarray]:
    """The unsteered model's top-p continuations of ``prompt_list``, ``samples`` each (seed
    ``seed * 100003``), ranked by ``score(continuations) -> [m]`` (higher: the steer's + side): the
    n // 2 highest-scoring get +1, the n // 2 lowest -1; each text is its prompt + continuation
    -> (texts [n], values [n, columns])."""
    from jsteer.steer.evaluate import sample

    if n > len(prompt_list) * samples:
        raise ValueError(f"ranked_continuations: {n} texts from {len(prompt_list)} prompts x {samples}")
    conts = sample(
        lm, lambda b: None, prompt_list, samples, max_new_tokens=max_new_tokens, seed=seed * 100003, batch=50
    )
    flat = [(p, c) for p, cs in zip(prompt_list, conts) for c in cs]
    order = np.argsort(np.asarray(score([c for _, c in flat])), kind="stable")
    keep = np.concatenate([order[: n // 2], order[len(order) - n // 2 :]])
    values = np.repeat(np.where(np.arange(len(keep)) < n // 2, -1.0, 1.0)[:, None], columns, axis=1).astype(np.float32)
    return [flat[i][0] + flat[i][1] for i in keep], values


def self_generated_texts(
    lm,
    labeler,
    n: int,
    exclude: Sequence[str],
    n_prompts: int = 400,
    samples: int = 4,
    max_new_tokens: int = 32,
    seed: int = 1,
) -> tuple[list, np.ndarray]:
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
    key = {
        "model": lm.identity,
        "labeler": labeler.meta["name"],
        "texts": n,
        "exclude_sha256": hashlib.sha256(json.dumps(list(exclude)).encode()).hexdigest(),
    }
    return cached_texts(
        pathlib.Path(work) / f"texts_self{n}.json",
        key,  # ~4 min to generate
        lambda: self_generated_texts(lm, labeler, n, exclude),
    )


def self_detox_texts(
    lm, labeler, exclude: Sequence[str], *, jigsaw_texts: int, self_texts: int, self_samples: int
) -> tuple[list, np.ndarray]:
    """On-policy detox texts (``steer_detox.py --data self``): continuations of the toxic prefixes of
    the detox steer's own ``jigsaw_texts`` Jigsaw texts (none of ``exclude``: the test, held-out
    and replication prompt pools), ``self_samples`` each, ranked by the labeler's P(toxic)
    -> (texts [self_texts], values [self_texts]: least toxic +1, most toxic -1)."""
    texts, values = jigsaw_steer_texts(jigsaw_texts)
    skip = set(exclude)
    prompt_list = [p for p in dict.fromkeys(toxic_prefixes(texts, (values < 0).astype(int))) if p not in skip]
    log(f"on-policy detox texts: {len(prompt_list)} prompts x {self_samples} continuations -> {self_texts}")
    out, vals = ranked_continuations(lm, lambda t: -np.asarray(labeler.prob(t)), prompt_list, self_texts, self_samples)
    return out, vals[:, 0]


# ----------------------------------------------------------------------------- caches


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
    """The hidden-state cache (:class:`jsteer.steer.train.HiddenCache`) at ``path`` when its key
    (:func:`hidden_cache_key`) matches this run: same model, texts, values and max_len. Otherwise
    (absent, or made by another model or from other texts: logged) built from ``texts_values()``
    -> (texts, values) with ``train.cache_lm`` and saved there, with its key, first."""
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
