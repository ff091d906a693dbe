"""jsteer against HF PyTorch on one GPU, bf16 compute (issue #36's prepared device run).

    python experiments/bench_gpu.py --part PART --framework jax|torch|both --out F.json [--tiny]

Parts (each writes one JSON; ``--tiny`` runs toy shapes on any backend as a smoke test):
  attention      causal GQA attention at 4 x 2048 (32 query heads, 8 KV heads, head 64), bf16,
                 forward and forward + backward: jsteer's hand-written path against
                 ``jax.nn.dot_product_attention`` (XLA and cuDNN) and torch SDPA.
  bert           BERT-base token classification, train step (fp32 masters, bf16 compute,
                 AdamW, dropout 0.1) at 32 x 128 and 32 x 512: jsteer's Trainer vs HF under
                 ``torch.autocast(bfloat16)`` with fused AdamW.
  decoder-train  a Llama-3.2-1B-shaped decoder (random weights), causal-LM train step at
                 4 x 2048, fp32 masters, bf16 compute.
  decode         the same decoder stored bf16: greedy, 128 new tokens after a 128-token prompt
                 at batch 1 and 64 (jsteer ``generate`` vs HF ``generate`` with its dynamic and
                 static caches), and at batch 64 with an LM-Steer steer (2 steers, rank 1000).

MFU counts matrix-product FLOPs (PaLM's 6 N + 12 L d T per trained token; attention at full T
x T, causal or not) against the chip's dense bf16 peak. Decoding is judged against the HBM
bound: a step must read every parameter byte and the KV cache; the bandwidth is measured here
with a device-to-device copy (bytes read + written) and the spec sheet's figure is recorded.
Timings: median of the timed calls after the warm-up ones (the first call's compile recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time

import numpy as np

from jsteer import perf
from jsteer.train import trace_ops
from jsteer.train.bench import peak_tflops
from jsteer.train.gpu_bench import (
    LLAMA_1B,
    LLAMA_TINY,
    decode_bound,
    hf_llama_config,
    jax_sync,
    jsteer_llama,
    llama_flops_per_token,
    llama_param_count,
    measured_bandwidth_jax,
    median_time,
    spec_hbm_tbps,
    torch_device,
    torch_sync,
)

# ----------------------------------------------------------------------------- attention


def part_attention(a, res):
    b, t, n, k, h = (2, 128, 4, 2, 16) if a.tiny else (4, 2048, 32, 8, 64)
    flops_fwd = 4 * b * n * t * t * h  # full T x T (a causal kernel may skip half)
    res["shape"] = dict(batch=b, seq=t, q_heads=n, kv_heads=k, head_dim=h, dtype="bfloat16", causal=True)
    res["flops_fwd_full"] = flops_fwd
    rows = {}
    if a.framework in ("jax", "both"):
        import jax
        import jax.numpy as jnp

        from jsteer.backbones.attention import dot_product_attention

        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(ks[0], (b, t, n, h), jnp.bfloat16)
        kk = jax.random.normal(ks[1], (b, t, k, h), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, t, k, h), jnp.bfloat16)
        cot = jax.random.normal(ks[3], (b, t, n, h), jnp.bfloat16)
        causal = jnp.tril(jnp.ones((t, t), bool))

        def mine(q, kk, v):
            out = dot_product_attention(
                q.reshape(b, t, k, n // k, h), kk, v, scale=1 / math.sqrt(h), visible=causal[None, None, None]
            )
            return out.reshape(b, t, n, h)

        impls = {
            "jsteer": mine,
            "jax_xla": lambda q, kk, v: jax.nn.dot_product_attention(q, kk, v, is_causal=True, implementation="xla"),
        }
        if jax.default_backend() == "gpu":
            impls["jax_cudnn"] = lambda q, kk, v: jax.nn.dot_product_attention(
                q, kk, v, is_causal=True, implementation="cudnn"
            )
            from jsteer.backbones.attention import RightPadded, attention

            def fused(q, kk, v, lengths):  # the decoder's path: dense mask, or lengths when right-padded
                out = attention(
                    q.reshape(b, t, k, n // k, h),
                    kk,
                    v,
                    scale=1 / math.sqrt(h),
                    visible=causal[None, None, None],
                    right_padded=RightPadded.of(jnp.ones((b, t), jnp.int32)) if lengths else None,
                )
                return out.reshape(b, t, n, h)

            impls["jsteer_fused_mask"] = lambda q, kk, v: fused(q, kk, v, False)
            impls["jsteer_fused_lengths"] = lambda q, kk, v: fused(q, kk, v, True)
        ref = None
        for name, f in impls.items():
            fwd = jax.jit(f)
            grad = jax.jit(
                jax.grad(lambda q, kk, v, f=f: jnp.sum(f(q, kk, v).astype(jnp.float32) * cot), argnums=(0, 1, 2))
            )
            try:
                out = fwd(q, kk, v)
                c1, tf = median_time(lambda: fwd(q, kk, v), jax_sync, a.reps, 2)
                c2, tb = median_time(lambda: grad(q, kk, v), jax_sync, a.reps, 2)
            except Exception as e:  # noqa: BLE001 - a backend may lack an implementation
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            if ref is None:
                ref = np.asarray(out, np.float32)
            rows[name] = {
                "fwd_ms": tf * 1e3,
                "fwd_bwd_ms": tb * 1e3,
                "fwd_tflops_full": flops_fwd / tf / 1e12,
                "max_abs_diff_vs_jsteer": float(np.abs(np.asarray(out, np.float32) - ref).max()),
            }
            print(name, rows[name], flush=True)
    if a.framework in ("torch", "both"):
        import torch

        dev = torch_device()
        g = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16
        q = torch.randn(b, n, t, h, device=dev, dtype=dt, generator=g, requires_grad=True)
        kk = torch.randn(b, k, t, h, device=dev, dtype=dt, generator=g, requires_grad=True)
        v = torch.randn(b, k, t, h, device=dev, dtype=dt, generator=g, requires_grad=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            with torch.no_grad():
                return sdpa(q, kk, v, is_causal=True, enable_gqa=True)

        def fb():
            out = sdpa(q, kk, v, is_causal=True, enable_gqa=True)
            out.float().sum().backward()
            return out

        _, tf = median_time(fwd, torch_sync, a.reps, 2)
        _, tb = median_time(fb, torch_sync, a.reps, 2)
        rows["torch_sdpa"] = {"fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3, "fwd_tflops_full": flops_fwd / tf / 1e12}
        print("torch_sdpa", rows["torch_sdpa"], flush=True)
    res["runs"] = rows


# ----------------------------------------------------------------------------- BERT-base

BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
BERT_TINY = dict(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)


def bert_flops(c: dict, batch: int, seq: int, labels: int) -> float:
    d, f, L = c["hidden_size"], c["intermediate_size"], c["num_layers"]
    per_token = L * (2 * 4 * d * d + 2 * 2 * d * f) + 2 * d * labels
    return 3.0 * (per_token * batch * seq + L * 4 * batch * seq * seq * d)


def part_bert(a, res):
    c = BERT_TINY if a.tiny else BERT_BASE
    if a.attention_dropout is not None:
        c = dict(c, attention_dropout=a.attention_dropout)
    shapes = [(4, 16), (4, 32)] if a.tiny else [(32, 128), (32, 512)]
    shapes = [(b, t) for b, t in shapes if not a.sizes or f"{b}x{t}" in a.sizes]
    labels = 9
    peak = res.get("peak_bf16_tflops")
    rows = []
    for batch, seq in shapes:
        rng = np.random.default_rng(0)
        batches = []
        for _ in range(4):
            ids = rng.integers(100, c["vocab_size"], (batch, seq)).astype(np.int32)
            batches.append(
                {
                    "input_ids": ids,
                    "attention_mask": np.ones_like(ids),
                    "labels": rng.integers(0, labels, (batch, seq)).astype(np.int32),
                }
            )
        flops = bert_flops(c, batch, seq, labels)
        row = {"batch": batch, "seq": seq, "flops_per_step": flops}
        if a.framework in ("jax", "both"):
            row["jsteer"] = _bert_jax(a, c, labels, batches, flops, peak)
        if a.framework in ("torch", "both"):
            row["hf"] = _bert_torch(a, c, labels, batches, flops, peak)
        if "jsteer" in row and "hf" in row:
            row["jsteer_over_hf_examples_per_s"] = row["jsteer"]["examples_per_s"] / row["hf"]["examples_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    res["config"] = c
    res["runs"] = rows


def _rates(dt, batch, seq, flops, peak, first):
    return {
        "compile_first_step_s": first,
        "s_per_step": dt,
        "examples_per_s": batch / dt,
        "tokens_per_s": batch * seq / dt,
        "tflops": flops / dt / 1e12,
        "mfu": flops / dt / 1e12 / peak if peak else None,
    }


def _bert_jax(a, c, labels, batches, flops, peak):
    import jax
    import jax.numpy as jnp

    from jsteer.backbones import bert, bert_heads
    from jsteer.train import OptimizerConfig, Trainer, data_mesh
    from jsteer.train.bench import token_classification_loss

    config = bert.BertConfig(**c)
    module = bert_heads.BertForTokenClassification(config, labels, dtype=jnp.bfloat16)
    init = jax.jit(bert_heads.BertForTokenClassification(config, labels).init)(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)
    )["params"]

    loss_fn = token_classification_loss(module, masked=False)
    total = 10**6
    tr = Trainer(
        loss_fn,
        init,
        OptimizerConfig(learning_rate=5e-5, weight_decay=0.01, total_steps=total),
        mesh=data_mesh(jax.devices()[:1]),
        precision="bf16",
        progress=False,
        log_every=10**9,
    )
    i = iter(range(10**9))

    def step():
        return tr.train_step(batches[next(i) % 4], total)["loss"]

    first, dt = median_time(step, jax_sync, a.reps, 3)
    b, t = batches[0]["input_ids"].shape
    if a.trace:
        trace_ops.record(step, pathlib.Path(a.trace) / f"bert_{b}x{t}", calls=3)
    return _rates(dt, b, t, flops, peak, first)


def _bert_torch(a, c, labels, batches, flops, peak):
    import torch
    import transformers

    dev = torch_device()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        intermediate_size=c["intermediate_size"],
        attention_probs_dropout_prob=c.get("attention_dropout", 0.1),
        num_labels=labels,
    )
    model = transformers.BertForTokenClassification(cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01, fused=dev == "cuda")
    tb = [{k: torch.as_tensor(v.astype(np.int64), device=dev) for k, v in b.items()} for b in batches]
    i = iter(range(10**9))

    def step():
        b = tb[next(i) % 4]
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first, dt = median_time(step, torch_sync, a.reps, 3)
    b, t = batches[0]["input_ids"].shape
    return _rates(dt, b, t, flops, peak, first)


# ----------------------------------------------------------------------------- decoder training


def part_decoder_train(a, res):
    c = LLAMA_TINY if a.tiny else LLAMA_1B
    batch, seq = (2, 64) if a.tiny else (4, 2048)
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, c["vocab_size"], (batch, seq)).astype(np.int32)} for _ in range(4)]
    flops = llama_flops_per_token(c, seq) * batch * seq
    peak = res.get("peak_bf16_tflops")
    res.update(
        config=c,
        params=llama_param_count(c),
        batch=batch,
        seq=seq,
        flops_per_step=flops,
        setting="causal LM, fp32 master params, bf16 compute, AdamW (clip 1.0), full-vocab fp32 loss",
    )
    if a.framework in ("jax", "both"):
        res["jsteer"] = _decoder_train_jax(a, c, batches, flops, peak)
        print("jsteer", res["jsteer"], flush=True)
    if a.framework in ("torch", "both"):
        res["hf"] = _decoder_train_torch(a, c, batches, flops, peak)
        print("hf", res["hf"], flush=True)


def _decoder_train_jax(a, c, batches, flops, peak):
    import jax
    import jax.numpy as jnp

    from jsteer.train import OptimizerConfig, Trainer, data_mesh

    module, params = jsteer_llama(c, jnp.bfloat16)  # bf16 compute, fp32 params

    def loss_fn(p, b, rng):
        ids = b["input_ids"]
        logits = module.apply({"params": p}, ids).logits[:, :-1].astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)
        return nll.mean(), {}

    total = 10**6
    tr = Trainer(
        loss_fn,
        params,
        OptimizerConfig(learning_rate=1e-4, weight_decay=0.0, total_steps=total),
        mesh=data_mesh(jax.devices()[:1]),
        precision="bf16",
        progress=False,
        log_every=10**9,
    )
    del params
    i = iter(range(10**9))
    first, dt = median_time(lambda: tr.train_step(batches[next(i) % 4], total)["loss"], jax_sync, a.reps, 2)
    b, t = batches[0]["input_ids"].shape
    out = _rates(dt, b, t, flops, peak, first)
    if a.anatomy:  # the same loss, bf16-cast params, no optimizer: forward, then forward + backward
        from jsteer.train.step import cast_floating

        def loss16(p, batch):
            return loss_fn(cast_floating(p, jnp.bfloat16), batch, None)[0]

        ids = jax.device_put(batches[0])
        parts = {"forward": jax.jit(loss16), "forward_backward": jax.jit(jax.value_and_grad(loss16))}
        out["anatomy_s"] = {
            k: median_time(lambda f=f: f(tr.params, ids), jax_sync, a.reps, 1)[1] for k, f in parts.items()
        }
    return out


def _decoder_train_torch(a, c, batches, flops, peak):
    import torch
    import transformers

    dev = torch_device()
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(hf_llama_config(c)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=dev == "cuda")
    tb = [torch.as_tensor(b["input_ids"].astype(np.int64), device=dev) for b in batches]
    i = iter(range(10**9))

    def step():
        ids = tb[next(i) % 4]
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first, dt = median_time(step, torch_sync, a.reps, 2)
    b, t = batches[0]["input_ids"].shape
    out = _rates(dt, b, t, flops, peak, first)
    if a.anatomy:  # forward (no grad graph), then forward + backward, no optimizer

        def forward():
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
                return model(input_ids=tb[0], labels=tb[0]).loss

        def forward_backward():
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = model(input_ids=tb[0], labels=tb[0]).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss

        parts = {"forward": forward, "forward_backward": forward_backward}
        out["anatomy_s"] = {k: median_time(f, torch_sync, a.reps, 1)[1] for k, f in parts.items()}
    return out


# ----------------------------------------------------------------------------- decoding


def part_decode(a, res):
    c = LLAMA_TINY if a.tiny else LLAMA_1B
    prompt, new = (16, 16) if a.tiny else (128, 128)
    batches = tuple(b for b in ((1, 4) if a.tiny else (1, 64)) if not a.sizes or str(b) in a.sizes)
    res.update(
        config=c,
        params=llama_param_count(c),
        prompt=prompt,
        new_tokens=new,
        setting="greedy, no stop token, bf16 weights and KV cache; time includes the prefill",
    )
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(1, c["vocab_size"], (b, prompt)).astype(np.int32) for b in batches}
    rows = {}
    if a.framework in ("jax", "both"):
        import jax

        bw = measured_bandwidth_jax()
        res["measured_copy_bandwidth_Bps"] = bw
        for b in batches:
            rows.setdefault(str(b), {})["bound_measured_bw"] = decode_bound(c, b, prompt, new, bw)
            spec = res.get("spec_hbm_TBps")
            if spec:
                rows[str(b)]["bound_spec_bw"] = decode_bound(c, b, prompt, new, spec * 1e12)
        _decode_jax(a, c, prompts, new, rows)
        res["jax_backend"] = jax.default_backend()
    if a.framework in ("torch", "both"):
        _decode_torch(a, c, prompts, new, rows)
    for b, r in rows.items():
        if "jsteer" in r:
            bound = r.get("bound_measured_bw")
            if bound:
                r["jsteer_fraction_of_bound"] = r["jsteer"]["tokens_per_s"] / bound["tokens_per_s"]
            hf = [r[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if k in r and "tokens_per_s" in r[k]]
            if hf:
                r["jsteer_over_best_hf"] = r["jsteer"]["tokens_per_s"] / max(hf)
        if "jsteer_steered" in r:
            r["steer_overhead_pct"] = 100 * (r["jsteer_steered"]["s"] / r["jsteer"]["s"] - 1)
    res["runs"] = rows
    print(json.dumps(rows, indent=1), flush=True)


def _decode_jax(a, c, prompts, new, rows):
    import jax
    import jax.numpy as jnp

    from jsteer.decode import generate
    from jsteer.steer import head

    module, params = jsteer_llama(c, jnp.bfloat16)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    for b, ids in prompts.items():
        ids = jnp.asarray(ids)
        runs = {"jsteer": None}
        if b == max(prompts) and b > 1:  # the steer overhead is measured at the large batch, not in a batch-1 A/B
            p = head.init(jax.random.PRNGKey(1), c["hidden_size"], 2, rank=min(1000, c["hidden_size"]), scale=0.05)
            runs["jsteer_steered"] = head.to_hooks(p, head.make_eps(np.full((b, 1), 5.0), 1e-3))
        for name, hooks in runs.items():
            first, dt = median_time(
                lambda: (
                    generate(
                        module, params, ids, max_new_tokens=new, hooks=hooks, steps_per_check=a.steps_per_check
                    ).tokens
                ),
                jax_sync,
                a.reps,
                1,
            )
            rows.setdefault(str(b), {})[name] = {
                "compile_first_call_s": first,
                "s": dt,
                "tokens_per_s": b * new / dt,
                "ms_per_token_step": dt / new * 1e3,
            }
            print(b, name, rows[str(b)][name], flush=True)


def _decode_torch(a, c, prompts, new, rows):
    import torch
    import transformers

    dev = torch_device()
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(hf_llama_config(c)).to(torch.bfloat16).eval()
    for b, ids in prompts.items():
        ids = torch.as_tensor(ids.astype(np.int64), device=dev)
        for name, extra in (("hf_dynamic", {}), ("hf_static", {"cache_implementation": "static"})):

            def gen():
                with torch.no_grad():
                    return model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                        pad_token_id=0,
                        **extra,
                    )

            try:
                first, dt = median_time(gen, torch_sync, a.reps, 1)
            except Exception as e:  # noqa: BLE001 - a transformers version may lack the static cache
                rows.setdefault(str(b), {})[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            rows.setdefault(str(b), {})[name] = {
                "first_call_s": first,
                "s": dt,
                "tokens_per_s": b * new / dt,
                "ms_per_token_step": dt / new * 1e3,
            }
            print(b, name, rows[str(b)][name], flush=True)


# ----------------------------------------------------------------------------- main

PARTS = {"attention": part_attention, "bert": part_bert, "decoder-train": part_decoder_train, "decode": part_decode}


def environment(a) -> dict:
    env = {
        "part": a.part,
        "framework": a.framework,
        "tiny": a.tiny,
        "reps": a.reps,
        "host": f"{platform.machine()} {platform.processor()}".strip(),
    }
    kind = ""
    if a.framework in ("jax", "both"):
        import flax
        import jax

        kind = jax.devices()[0].device_kind
        env.update(jax=jax.__version__, flax=flax.__version__, jax_device=kind)
    if a.framework in ("torch", "both"):
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__)
        if torch.cuda.is_available():
            kind = kind or torch.cuda.get_device_name(0)
            env["torch_device"] = torch.cuda.get_device_name(0)
    env["machine"] = perf.machine()
    env["peak_bf16_tflops"] = peak_tflops(kind)
    env["spec_hbm_TBps"] = spec_hbm_tbps(kind)
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per case")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (smoke test on any backend)")
    ap.add_argument(
        "--anatomy", action="store_true", help="decoder-train: also time forward and forward + backward alone"
    )
    ap.add_argument(
        "--sizes",
        type=lambda v: set(v.split(",")),
        default=None,
        help="only these decode batches (e.g. 64) or BERT shapes (e.g. 32x512)",
    )
    ap.add_argument(
        "--attention-products",
        choices=("fp32-out", "preferred"),
        default="fp32-out",
        help="the hand-written attention's two products: matmul.dot_fp32_out (jsteer's) or, for an A/B, the "
        "form before 062e1a5 (preferred_element_type=float32, plain autodiff: fp32 x bf16 backward products)",
    )
    ap.add_argument(
        "--steps-per-check",
        type=int,
        default=1,
        help="decode: jsteer's generate(steps_per_check=K), decode steps per host read of the loop's condition",
    )
    ap.add_argument(
        "--one-row-cache",
        choices=("default", "unbatched"),
        default="default",
        help="decode: 'unbatched' carries and writes a one-row KV cache without its batch axis on any backend "
        "(KVCache.unbatched, CPU-only by default): the A/B for the cache copies it removes on CPU",
    )
    ap.add_argument(
        "--o-barrier",
        action="store_true",
        help="decode: an optimization barrier between a decode step's attention and its output projection. "
        "XLA:GPU strength-reduces a batch-1 step's [1, D] x [D, D] products to multiply + reduce and fused the "
        "attention's normalisation into o's multiply, writing [heads, head_dim, D] (5.8 us) before reducing it "
        "(9.9 us a layer, s48 trace) where q's fused multiply-reduce of the same size takes 3.8 us: the A/B",
    )
    ap.add_argument(
        "--fused-dropout",
        action="store_true",
        help="BERT training: attention with dropout through the Pallas kernel (attention.fused_dropout)",
    )
    ap.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="BERT training, both frameworks: attention dropout (default BERT's 0.1); 0 sends jsteer to cuDNN's "
        "flash attention and HF to SDPA's flash kernel: the A/B for what attention dropout costs each",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="BERT training: DIR; after timing, 3 jsteer steps under jax.profiler -> DIR/bert_BxT/trace.json.gz "
        "(gpu_trace_ops.py sums it per model op with the HLO of --xla_dump_to)",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.attention_products == "preferred":
        import jax
        import jax.numpy as jnp

        from jsteer.backbones import attention

        attention.dot_fp32_out = lambda lhs, rhs, dn: jax.lax.dot_general(
            lhs, rhs, dn, preferred_element_type=jnp.float32
        )
    if a.one_row_cache == "unbatched":
        from jsteer.backbones.base import KVCache

        KVCache.unbatched = staticmethod(lambda batch: batch == 1)
    if a.o_barrier:
        import jax

        from jsteer.backbones import decoder

        plain = decoder.attention

        def barred(q, *args, **kw):  # q [B, T, K, G, H]: only a decode step's (T = 1) output
            out = plain(q, *args, **kw)
            return jax.lax.optimization_barrier(out) if q.shape[1] == 1 else out

        decoder.attention = barred
    res = environment(a)
    res["o_barrier"] = a.o_barrier
    res["attention_products"] = a.attention_products
    res["steps_per_check"] = a.steps_per_check
    res["fused_dropout"] = a.fused_dropout
    res["one_row_cache"] = a.one_row_cache
    from jsteer.backbones.attention import fused_dropout

    t0 = time.perf_counter()
    with fused_dropout(a.fused_dropout):
        PARTS[a.part](a, res)
    res["wall_s"] = time.perf_counter() - t0
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
