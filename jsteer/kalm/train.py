"""Training KALM (or the plain LM) as a language model, perplexity, and context type distributions.

Objective: mean negative log-likelihood of the next token over real positions (targets
``ids[:, 1:]`` where ``mask[:, 1:]``), on the shared :class:`jsteer.train.Trainer` (AdamW,
warmup + linear decay, global-norm clipping).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.kalm.head import KalmConfig, TypedVocab
from jsteer.kalm.model import KalmLM, next_token_log_probs
from jsteer.train import OptimizerConfig, Trainer, data_mesh

KINDS = ("plain", "kalm", "kalm_type_input")


@dataclasses.dataclass(frozen=True)
class LMTrainConfig:
    lr: float = 3e-3
    batch_size: int = 64
    steps: int = 600
    warmup_steps: int = 50
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    seed: int = 0


def tiny_llama(
    vocab_size: int, hidden: int = 128, layers: int = 2, heads: int = 4, max_len: int = 256
) -> DecoderConfig:
    """A small random-init LLaMA for word-level recipe text (tied embeddings)."""
    return DecoderConfig.llama(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )


def make_model(
    kind: str, backbone: DecoderConfig, vocab: TypedVocab, type_dim: int = 32, share_word_embedding: bool = True
):
    """``plain``: a Decoder; ``kalm`` / ``kalm_type_input``: :class:`KalmLM`."""
    if kind == "plain":
        return Decoder(backbone)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    cfg = KalmConfig(
        num_types=vocab.num_types,
        type_dim=type_dim,
        type_as_input=kind == "kalm_type_input",
        share_word_embedding=share_word_embedding,
    )
    return KalmLM(backbone, cfg, num_pairs=vocab.num_pairs)


def init_params(model, rng, vocab: TypedVocab, length: int = 8) -> dict:
    ids = jnp.zeros((1, length), jnp.int32)
    if isinstance(model, KalmLM):
        return model.init(rng, ids, jnp.ones_like(ids), vocab)["params"]
    return model.init(rng, ids, jnp.ones_like(ids))["params"]


def loss_fn(model, vocab: TypedVocab):
    """(params, batch {"ids", "mask"}, rng) -> (mean next-token NLL, aux)."""

    def fn(params, batch, rng):
        lp = next_token_log_probs(model, params, batch["ids"], batch["mask"], vocab)
        m = batch["mask"][:, 1:].astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        return -(lp * m).sum() / n, {"tokens": m.sum()}

    return fn


def _batches(ids: np.ndarray, mask: np.ndarray, batch_size: int, seed: int) -> Iterator[dict]:
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(ids))
        for s in range(0, len(order) - batch_size + 1, batch_size):
            sel = order[s : s + batch_size]
            yield {"ids": ids[sel], "mask": mask[sel]}


def train(
    model,
    params,
    ids: np.ndarray,
    mask: np.ndarray,
    vocab: TypedVocab,
    cfg: LMTrainConfig,
    log_path=None,
    progress: bool = False,
    mesh=None,
    rules=None,
) -> tuple[dict, dict]:
    """Train on ``ids`` / ``mask`` [N, L+1] (:func:`jsteer.kalm.data.encode_lines`) -> (params,
    info: losses, seconds (steps 2..N), compile_seconds). Data-parallel over ``mesh`` (default:
    every device; the batch size must divide by the device count). A SIGTERM ends the process
    after the current step (``sys.exit(143)``, the engine's preemption exit) rather than return
    a cut run. ``rules`` ("fsdp", "tp", "fsdp_tp" or a dict, :mod:`jsteer.sharding`) shards params
    and optimizer state over ``mesh`` by their logical axes (inferred from the param tree)."""
    if len(ids) < cfg.batch_size:
        raise ValueError(f"{len(ids)} training lines do not fill one batch of {cfg.batch_size}")
    # a short run still reaches the peak learning rate (warmup at most a tenth of the steps)
    warmup = min(cfg.warmup_steps, max(cfg.steps // 10, 1))
    opt = OptimizerConfig(
        learning_rate=cfg.lr,
        schedule="linear",
        warmup_steps=warmup,
        total_steps=cfg.steps,
        weight_decay=cfg.weight_decay,
        clip_norm=cfg.clip_norm,
    )
    # sync_steps: each step's loss is read anyway, and the step times are then device times
    trainer = Trainer(
        loss_fn(model, vocab),
        params,
        opt,
        mesh=mesh or data_mesh(),
        rules=rules,
        axes="auto" if rules else None,
        log_path=log_path,
        log_every=max(cfg.steps // 20, 1),
        seed=cfg.seed,
        progress=progress,
        sync_steps=True,
    )
    losses = []
    trainer.add_hook(lambda info: losses.append(info.loss))
    trainer.fit(_batches(ids, mask, cfg.batch_size, cfg.seed), cfg.steps)
    times = trainer.step_times
    return trainer.params, {
        "losses": losses,
        "seconds": float(np.sum(times[1:])) if len(times) > 1 else float("nan"),
        "compile_seconds": times[0] if times else float("nan"),
    }


def _chunks(n: int, size: int):
    for s in range(0, n, size):
        yield slice(s, min(s + size, n))


def perplexity(model, params, ids: np.ndarray, mask: np.ndarray, vocab: TypedVocab, batch_size: int = 128) -> dict:
    """Token-level perplexity exp(mean NLL) over every predicted real token, and the count."""
    fn = jax.jit(lambda p, i, m: next_token_log_probs(model, p, i, m, vocab))
    total, count = 0.0, 0
    for sl in _chunks(len(ids), batch_size):
        i, m = _pad_rows(ids[sl], batch_size), _pad_rows(mask[sl], batch_size)
        lp = np.asarray(fn(params, i, m), np.float64)
        keep = m[:, 1:] > 0
        total -= lp[keep].sum()
        count += int(keep.sum())
    return {"perplexity": float(np.exp(total / count)), "nll": total / count, "tokens": count}


def context_types(
    model: KalmLM, params, ids: np.ndarray, mask: np.ndarray, vocab: TypedVocab, batch_size: int = 128
) -> np.ndarray:
    """log P(type of token t+1 | tokens <= t) [N, L+1, K+1] (position t's prediction)."""
    if not isinstance(model, KalmLM):
        raise TypeError("context_types needs a KalmLM")
    fn = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m, vocab).type_logp)
    out = []
    for sl in _chunks(len(ids), batch_size):
        n = sl.stop - sl.start
        out.append(np.asarray(fn(params, _pad_rows(ids[sl], batch_size), _pad_rows(mask[sl], batch_size)))[:n])
    return np.concatenate(out)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """Pad a [n, ...] batch to ``rows`` rows (one compiled shape for every chunk)."""
    if len(x) == rows:
        return x
    return np.concatenate([x, np.zeros((rows - len(x),) + x.shape[1:], x.dtype)])


def mean_type_distribution(type_logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log of the average P(type | c) over real predicting positions: [K+1] (the marginal
    P(type) used to combine forward and backward evidence)."""
    keep = mask[:, 1:] > 0
    p = np.exp(type_logp[:, :-1][keep]).mean(0)
    return np.log(p)
