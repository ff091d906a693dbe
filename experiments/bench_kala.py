"""Training throughput: plain fine-tuning vs KALA in jsteer vs HF PyTorch plain fine-tuning.

    python experiments/bench_kala.py [--steps 6] [--rounds 3] [--batch-size 32]

One process, the same CoNLL-2003 batches (MiniLM, batch 32, length-bucketed) for every
system. Steps of the systems are *interleaved* round by round (``--rounds`` x ``--steps``
each), and the median step time is reported, so a machine shared with other jobs slows all
of them alike. jsteer steps are the shared Trainer's jitted train step (AdamW, clipping),
compiled before timing; relational KALA runs twice, on the default graph buckets and on
the same batches with ``--graph-rungs`` smaller ones (``TrainConfig.graph_rungs``). HF PyTorch
is ``BertForTokenClassification`` + ``torch.optim.AdamW`` on the same weights (fp32,
``--torch-threads``, default the CPU count).

On an accelerator (jax's default backend is not the CPU) both sides run there: jsteer steps in
``--precision`` (default bf16 compute with fp32 master params; fp32 on the CPU), HF PyTorch on
``cuda`` under ``torch.autocast`` in the same dtype, each step synchronised before its clock is
read. Model FLOP utilisation (``mfu``) is reported against ``--peak-tflops`` (default: the
device's dense bf16 peak when known, see jsteer.train.bench.PEAK_BF16_TFLOPS), counting the encoder's
matrix products on real (unpadded) tokens: 6 x non-embedding params per token plus attention's
12 x layers x hidden x padded length per token (forward + backward). KALA's graph and FiLM work
is not counted, so its MFU is the encoder work it gets done per second.

Writes experiments/results/kala/bench.json and bench.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import pickle
import re
import statistics
import sys
import time

from jsteer.kala import protocol

OUT = protocol.OUT


def train_flops(n_params_matmul: int, tokens: float, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs of one train step over ``tokens`` real tokens: 6 x (non-embedding) params per
    token for the dense layers, plus 12 x layers x hidden x seq per token for QK^T and PV
    (2 products x 2 FLOPs x seq x hidden forward, x3 with the backward)."""
    return 6.0 * n_params_matmul * tokens + 12.0 * layers * hidden * seq * tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--examples", type=int, default=512)
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="device peak for MFU (default on accelerators: the dense bf16 peak of a known device)",
    )
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="compute dtype of both systems (default: bf16 on accelerators, fp32 on the CPU)",
    )
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--methods",
        default="finetune,relational",
        help="KALA methods timed (KalaConfig.method): e.g. finetune,pointwise,relational, where "
        "pointwise (the entity memory and FiLM, no graph) splits relational's cost from the graph's",
    )
    ap.add_argument(
        "--graph-rungs",
        type=int,
        default=2,
        help="also time relational KALA on the same batches with this many smaller graph buckets",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads; match XLA's (1 under --xla_cpu_multi_thread_eigen=false)",
    )
    ap.add_argument(
        "--save-data",
        metavar="F",
        help="only read CoNLL (--examples train, 32 test) and write it to F (gzipped pickle), for --data elsewhere",
    )
    ap.add_argument(
        "--data",
        metavar="F",
        help="the data pickled by --save-data (a machine without tensorflow_datasets or CoNLL)",
    )
    ap.add_argument(
        "--fused-dropout",
        action="store_true",
        help="jsteer's attention dropout through the Pallas kernel on GPUs (attention.fused_dropout)",
    )
    ap.add_argument(
        "--trace",
        metavar="DIR",
        help="after timing, 3 steps of each jsteer system under jax.profiler -> DIR/<method>/trace.json.gz "
        "(gpu_trace_ops.py sums one per model op with the HLO of --xla_dump_to)",
    )
    ap.add_argument("--out", default=str(OUT / "bench.json"))
    args = ap.parse_args(argv)
    from jsteer.backbones.attention import fused_dropout

    with fused_dropout(args.fused_dropout):
        return run(args)


def run(args) -> int:
    """main's work on the parsed ``args``."""
    import jax
    import numpy as np

    import jsteer
    from jsteer import perf
    from jsteer.data import ner as ner_lib
    from jsteer.kala import data as kdata
    from jsteer.kala import pipeline
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import METHODS, KalaConfig
    from jsteer.train import Trainer, data_mesh

    on_accel = jax.default_backend() != "cpu"
    precision = args.precision or ("bf16" if on_accel else "fp32")
    if args.peak_tflops is None and on_accel:
        from jsteer.train.bench import peak_tflops

        args.peak_tflops = peak_tflops(jax.devices()[0].device_kind)
    lm = jsteer.load("minilm")
    if args.data:
        with gzip.open(args.data, "rb") as f:
            data = pickle.load(f)
        if len(data.train) != args.examples:
            raise SystemExit(f"bench_kala: {args.data} holds {len(data.train)} train examples, not {args.examples}")
    else:
        data = protocol.load_data("conll", lm.tokenizer, train_size=args.examples, test_size=32)
    if args.save_data:
        with gzip.open(args.save_data, "wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
        print(f"wrote {args.save_data}: {len(data.train)} train examples")
        return 0
    memory = pipeline.memory_from_backbone(lm.config, lm.params["encoder"], data.train, data.vocab)
    # the same example groups collated with the default graph buckets and with --graph-rungs
    # smaller ones (same seed: same shuffled, length-grouped batches)
    ladders = {
        r: [b for _, b in kdata.batches(data.train, args.batch_size, shuffle=True, group_by_length=True, graph_rungs=r)]
        for r in (0, args.graph_rungs)
    }
    # one fixed shape for every system: the most common (length, graph buckets) of training batches
    signature = lambda b: (
        b["input_ids"].shape,
        b["graph_entity"].shape,
        b["graph_senders"].shape,  # noqa: E731
        b["graph_mention"].shape,
    )

    def most_common(idx, bs):
        sig = [signature(bs[i]) for i in idx]
        top = max(set(sig), key=sig.count)
        return [i for i, s in zip(idx, sig) if s == top]

    pick = most_common(range(len(ladders[0])), ladders[0])
    pick = most_common(pick, ladders[args.graph_rungs])[: args.steps]
    batches = [ladders[0][i] for i in pick]
    small = [ladders[args.graph_rungs][i] for i in pick]
    common = batches[0]["input_ids"].shape
    gshapes = {r: (bs[pick[0]]["graph_entity"].size, bs[pick[0]]["graph_senders"].size) for r, bs in ladders.items()}
    real_graph = [float(np.mean([b[k].sum() for b in batches])) for k in ("graph_n_node", "graph_n_edge")]
    tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))

    systems = {}
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "finetune" not in methods:
        raise SystemExit(f"--methods {methods}: KALA has {list(METHODS)}; finetune (the reference) must be one")
    runs = [(m, f"jsteer {m}", batches) for m in methods]
    if args.graph_rungs and "relational" in methods:
        runs.append(("relational", f"jsteer relational, graph_rungs={args.graph_rungs}", small))
    for method, name, feed in runs:
        model, params = pipeline.build_model(lm.config, lm.params["encoder"], data, KalaConfig(method=method), memory)
        cfg = ktrain.TrainConfig()
        tr = Trainer(
            ktrain.ner_loss(model),
            params,
            ktrain.optimizer_config(cfg, 1000),
            precision=precision,
            mesh=data_mesh(jax.devices()[:1]),
            progress=False,
            exit_on_preempt=False,
        )
        own = [kdata.device_batch(b, model.kala.uses_knowledge) for b in feed]  # as ktrain.fit feeds them
        t = time.perf_counter()
        jax.block_until_ready(tr.train_step(own[0], 1000)["loss"])
        compile_s = time.perf_counter() - t

        def run(tr=tr, own=own):
            out = []
            for b in own:
                t = time.perf_counter()
                jax.block_until_ready(tr.train_step(b, 1000)["loss"])
                out.append(time.perf_counter() - t)
            return out

        systems[name] = {
            "run": run,
            "compile_s": compile_s,
            "params": ktrain.count_params(params),
            "step": lambda tr=tr, b=own[0]: tr.train_step(b, 1000)["loss"],
        }

    if not args.no_torch:
        import torch
        from transformers import BertForTokenClassification

        from jsteer.io import embedded_path

        torch.set_num_threads(args.torch_threads)
        dev = "cuda" if on_accel and torch.cuda.is_available() else "cpu"
        if on_accel and dev == "cpu":
            raise RuntimeError(f"jax runs on {jax.default_backend()} but torch sees no CUDA device; pass --no-torch")
        hf = (
            BertForTokenClassification.from_pretrained(
                str(embedded_path("minilm")), num_labels=len(ner_lib.CONLL2003_LABELS)
            )
            .float()
            .to(dev)
        )
        hf.train()
        opt = torch.optim.AdamW(hf.parameters(), lr=5e-5, weight_decay=0.01)
        tb = [
            {
                k: torch.as_tensor(np.asarray(b[k]), dtype=torch.long, device=dev)
                for k in ("input_ids", "attention_mask", "labels")
            }
            for b in batches
        ]
        cast = torch.autocast(dev, dtype=torch.bfloat16, enabled=precision == "bf16")
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

        def run_torch():
            out = []
            for b in tb:
                t = time.perf_counter()
                with cast:
                    loss = hf(**b).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                sync()
                out.append(time.perf_counter() - t)
            return out

        run_torch()  # warm-up
        systems["HF PyTorch finetune"] = {
            "run": run_torch,
            "compile_s": 0.0,
            "params": sum(p.numel() for p in hf.parameters()),
        }

    times = {k: [] for k in systems}
    for _ in range(args.rounds):
        for k, s in systems.items():
            times[k] += s["run"]()
    if args.trace:
        from jsteer.train import trace_ops

        for k, s in systems.items():
            if "step" in s:  # jsteer's: "jsteer relational, graph_rungs=2" -> relational_graph_rungs_2
                slug = "_".join(re.findall(r"[a-z0-9]+", k.removeprefix("jsteer ")))
                trace_ops.record(s["step"], pathlib.Path(args.trace) / slug, calls=3)
    enc = lm.params["encoder"]
    matmul_params = ktrain.count_params(enc) - ktrain.count_params(enc["embeddings"])
    flops = train_flops(
        matmul_params, tokens / len(batches), lm.config.num_layers, lm.config.hidden_size, int(common[1])
    )
    rows = {}
    for k, s in systems.items():
        med = statistics.median(times[k])
        row = {
            "median_step_s": med,
            "examples_per_s": args.batch_size / med,
            "tokens_per_s": tokens / len(batches) / med,
            "compile_s": s["compile_s"],
            "params": s["params"],
            "steps_timed": len(times[k]),
        }
        if args.peak_tflops:
            row["mfu"] = flops / med / (args.peak_tflops * 1e12)
        rows[k] = row
    base = rows["jsteer finetune"]["median_step_s"]
    for r in rows.values():
        r["time_vs_jsteer_finetune"] = r["median_step_s"] / base
    result = {
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "precision": precision,
        "peak_tflops": args.peak_tflops,
        "model_flops_per_step": flops,
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "machine": perf.machine(),
        "fused_dropout": args.fused_dropout,
        "torch_threads": None if args.no_torch else args.torch_threads,
        "batch": [args.batch_size, int(common[1])],
        "graph_nodes_edges": {f"graph_rungs={r}": list(g) for r, g in gshapes.items()},
        "graph_real_nodes_edges": real_graph,
        "load_avg": os.getloadavg(),
        "systems": rows,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    lines = [
        f"Train throughput, MiniLM on CoNLL-2003, batch {args.batch_size} x {common[1]} tokens, "
        f"{result['platform']} {result['device']} ({result['cpu_count']} CPUs, "
        f"load {result['load_avg'][0]:.1f}, XLA flags "
        f"'{result['xla_flags']}', torch threads {result['torch_threads']}); median of "
        f"{args.rounds * len(batches)} interleaved steps. Graph: {real_graph[0]:.0f} nodes / "
        f"{real_graph[1]:.0f} edges on average, padded to "
        + ", ".join(f"{g[0]} / {g[1]} (graph_rungs={r})" for r, g in gshapes.items())
        + "; the most common shapes of training batches.",
        "",
        "| system | examples/s | tokens/s | step (s) | vs jsteer fine-tuning | compile (s) |"
        + (" MFU |" if args.peak_tflops else ""),
        "|---|---|---|---|---|---|" + ("---|" if args.peak_tflops else ""),
    ]
    for k, r in rows.items():
        lines.append(
            f"| {k} | {r['examples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['median_step_s']:.4f} | "
            f"{r['time_vs_jsteer_finetune']:.2f}x | {r['compile_s']:.1f} |"
            + (f" {r['mfu']:.2%} |" if args.peak_tflops else "")
        )
    if args.peak_tflops:
        lines += [
            "",
            f"{precision} compute; MFU = model FLOPs {flops / 1e9:.1f} GFLOP/step (encoder products, "
            f"real tokens) / step time / {args.peak_tflops:.0f} TFLOP/s.",
        ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
