"""Where a jsteer BERT train step spends its time on a GPU, beside HF PyTorch (one process).

    python experiments/gpu_step_anatomy.py --out OUT.json

For BERT-base (batch 32 x 128) and MiniLM-shaped (batch 256 x 32), random weights: the
Trainer's full step in bf16 and fp32 (host numpy batch and a device-resident batch), a bf16
forward, bf16 gradients with and without dropout; HF ``BertForTokenClassification`` under
bf16 autocast: forward, and forward + backward + AdamW. Medians of 10 timed calls after 3.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jsteer.backbones import bert, bert_heads
from jsteer.train.bench import init_token_classifier, token_classifier_trainer
from jsteer.train.gpu_bench import median_time


def timeit(f, sync=jax.block_until_ready, n=10, warm=3):
    return median_time(f, sync, n, warm)[1]


def anatomy(config, B, T, labels=9):
    init = init_token_classifier(config, labels)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (B, T)).astype(np.int32)
    batch = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "labels": rng.integers(0, labels, (B, T)).astype(np.int32),
    }
    dbatch = jax.device_put(batch)
    r = {}
    for prec in ("bf16", "fp32"):
        tr = token_classifier_trainer(None, labels, 5e-5, 1000, dtype=prec, config=config, params=init)[0]
        r[f"jsteer_step_{prec}"] = timeit(lambda tr=tr: tr.train_step(batch, 1000)["loss"])
        r[f"jsteer_step_{prec}_device_batch"] = timeit(lambda tr=tr: tr.train_step(dbatch, 1000)["loss"])
    module = bert_heads.BertForTokenClassification(config, labels, dtype=jnp.bfloat16)
    pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init)
    fwd = jax.jit(lambda p, b: module.apply({"params": p}, b["input_ids"], attention_mask=b["attention_mask"]).logits)
    r["jsteer_forward_bf16"] = timeit(lambda: fwd(pb, dbatch))

    def loss(p, b, key, det):
        out = module.apply(
            {"params": p}, b["input_ids"], attention_mask=b["attention_mask"], deterministic=det, rngs={"dropout": key}
        )
        lp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
        return -jnp.take_along_axis(lp, b["labels"][..., None], -1).mean()

    key = jax.random.PRNGKey(0)
    g_det = jax.jit(jax.grad(lambda p, b: loss(p, b, key, True)))
    g_drop = jax.jit(jax.grad(lambda p, b, k: loss(p, b, k, False)))
    r["jsteer_grad_bf16_no_dropout"] = timeit(lambda: g_det(pb, dbatch))
    r["jsteer_grad_bf16_dropout"] = timeit(lambda: g_drop(pb, dbatch, key))

    import torch
    from transformers import BertConfig, BertForTokenClassification

    hf = (
        BertForTokenClassification(
            BertConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                intermediate_size=config.intermediate_size,
                num_labels=labels,
            )
        )
        .cuda()
        .train()
    )
    opt = torch.optim.AdamW(hf.parameters(), lr=5e-5, weight_decay=0.01)
    tb = {k: torch.as_tensor(v, dtype=torch.long, device="cuda") for k, v in batch.items()}
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731

    def t_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = hf(**tb).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    def t_fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            hf(**tb)

    r["hf_step_bf16"] = timeit(t_step, sync)
    r["hf_forward_bf16"] = timeit(t_fwd, sync)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_step_anatomy.json")
    a = ap.parse_args()
    cases = {
        "bert-base b32x128": (
            bert.BertConfig(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
            32,
            128,
        ),
        "minilm b256x32": (
            bert.BertConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536),
            256,
            32,
        ),
    }
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name, (cfg, B, T) in cases.items():
        res[name] = anatomy(cfg, B, T)
        print(name, json.dumps({k: round(v * 1e3, 2) for k, v in res[name].items()}), "(ms)", flush=True)
        pathlib.Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
