"""What the training benchmarks share (experiments/bench_train.py, bench_kala.py, gpu_step_anatomy.py).

* :func:`peak_tflops`: a device's dense bf16 peak (TFLOP/s) by its ``device_kind``, for model
  FLOP utilisation.
* :func:`token_classifier_trainer`: a BERT token classifier on :class:`jsteer.train.Trainer`
  (AdamW with decay, warmup + linear decay, clipping at 1.0, dropout on), from HF weights or
  given params; :func:`init_token_classifier` gives random params for a config.
"""

from __future__ import annotations

import json
from typing import Optional

PEAK_BF16_TFLOPS = {"H100 SXM": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(kind: str) -> Optional[float]:
    """Dense bf16 peak of the first :data:`PEAK_BF16_TFLOPS` entry whose words all occur in
    ``kind`` (e.g. "NVIDIA H100 80GB HBM3"); None for an unknown device."""
    for k, v in PEAK_BF16_TFLOPS.items():
        if all(part in kind for part in k.split()):
            return v
    return None


def init_token_classifier(config, num_labels: int):
    """Random params (PRNGKey(0)) of ``bert_heads.BertForTokenClassification(config, num_labels)``."""
    import jax
    import jax.numpy as jnp

    from jsteer.backbones import bert_heads

    m = bert_heads.BertForTokenClassification(config, num_labels)
    return jax.jit(m.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]


def token_classification_loss(module, masked: bool = True):
    """``(params, batch, rng) -> (loss, {})`` of a token classifier ``module`` with dropout on: the
    mean token cross-entropy (fp32) of ``batch["labels"]`` [B, T]; ``masked``: over the labels
    that are not -100 only."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p, b, rng):
        out = module.apply(
            {"params": p},
            b["input_ids"],
            attention_mask=b["attention_mask"],
            deterministic=False,
            rngs={"dropout": rng},
        )
        logits = out.logits.astype(jnp.float32)
        if not masked:
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["labels"][..., None], -1).mean(), {}
        valid = b["labels"] != -100
        lab = jnp.where(valid, b["labels"], 0)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), lab[..., None], -1)[..., 0]
        w = valid.astype(jnp.float32)
        return (nll * w).sum() / jnp.maximum(w.sum(), 1.0), {}

    return loss_fn


def token_classifier_trainer(
    model_dir, num_labels: int, lr: float, total_steps: int, dtype: str = "fp32", config=None, params=None
):
    """-> (Trainer, module, params, config) of a BERT token classifier: weights from the HF folder
    ``model_dir`` (a fresh head) unless ``config`` / ``params`` are given; ``dtype`` the compute
    precision ("fp32" or "bf16", fp32 masters). Batches: input_ids, attention_mask, labels
    (-100 ignored) [B, T]."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jsteer.backbones import bert, bert_heads, bert_hf
    from jsteer.train import OptimizerConfig, Trainer, data_mesh

    if config is None:
        config = bert.BertConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    compute = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    module = bert_heads.BertForTokenClassification(config, num_labels, dtype=compute)
    if params is None:
        sd = load_file(str(model_dir / "model.safetensors"))
        params = bert_hf.params_from_hf(
            sd,
            config,
            head="token_classification",
            num_labels=num_labels,
            allow_missing_head=True,
            rng=jax.random.PRNGKey(0),
        )

    loss_fn = token_classification_loss(module)
    cfg = OptimizerConfig(
        learning_rate=lr, schedule="linear", warmup_steps=2, total_steps=total_steps, weight_decay=0.01, clip_norm=1.0
    )
    trainer = Trainer(
        loss_fn, params, cfg, mesh=data_mesh(jax.devices()[:1]), precision=dtype, progress=False, log_every=10**9
    )
    return trainer, module, params, config
