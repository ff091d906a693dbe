"""jsteer (JAX/Flax) vs HF transformers (PyTorch) backbones, side by side in one process.

Measures, with the same weights on both sides (fp32):

- SmolLM2-135M forward on a [B=8, T=128] batch (seconds per call);
- SmolLM2-135M greedy decoding of 64 new tokens after a 16-token prompt, batch 1 and 8, and of
  32 after a ``--long-prompt`` (1000 tokens) at batch 1 (tokens/s, prefill included; no early
  stop on either side);
- MiniLM (all-MiniLM-L6-v2) forward on [B=32, T=128];
- one MiniLM token-classification training step on [32, 128] (AdamW; dropout on; HF
  ``BertForTokenClassification`` + ``torch.optim.AdamW`` vs jsteer + ``optax.adamw``).

Compilation / warm-up calls are excluded; each number is the median of ``--reps`` timed calls,
jsteer's and HF's interleaved, each timed call right after an untimed one of the same side
(``speedup``: ratio of the medians; ``speedup_paired_median``: median of the per-pair ratios, the
steadier of the two on a shared machine).
PyTorch gets ``torch.set_num_threads(--threads)`` (default: all cores). Decoding is also
compared with the memory-bandwidth bound: one decode step must read every parameter once, so
tokens/s <= batch * bandwidth / param_bytes (``fraction_of_bound``; with each row's KV cache read
too: ``fraction_of_bound_with_cache``). On a GPU the bandwidth is ``--bandwidth`` (default
H100 SXM 3.35e12 B/s); on a CPU it is measured here (best of a jitted and a NumPy full read of
a 1 GiB array, far larger than the caches), and both sides' fraction of that bound is reported.
Each model's section starts with a matmul probe: one bare fp32 matmul of its FFN shape
([B*T, D] x [D, F]) timed under jax and under torch, interleaved. Both backbones spend most of
their time in such products, so the probe's ratio is about the ceiling of the backbone ratios on
the machine at hand (it is what moves between VMs; see BUILD.md).
The compute-bound cases (the two forwards and the train step) also get a *products floor*: every
matrix product of the case (its dense layers, the output embedding where the case computes logits,
attention's batched products, and for the train step each product's two backward products) timed
alone under jax and under torch, and summed at the faster library's time per product
(``products_floor``). ``hf_over_floor`` = HF's time / that floor is the largest speed-up over HF
the case could reach on this machine in fp32 if everything other than the products took no time;
a target above it cannot be met here with either library's matrix products.
Decoding 1-64 rows on a CPU with AVX-512 or AVX2 + FMA multiplies through jsteer's CPU kernel
(``jsteer.backbones.cpu``; ``env.jsteer_cpu_kernel`` says whether it ran) from a packed copy of
the weights, which generate makes once per param set (SmolLM2: ~0.26 s, in the untimed warm-up).

    python experiments/bench_backbones.py            # full sizes, writes out/bench_backbones.json
    python experiments/bench_backbones.py --quick    # smaller shapes, 2 reps (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys

from jsteer.perf import SETTLE, attention_products, dense_products, read_bandwidth, time_products, timed_pair


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench_backbones.json")
    ap.add_argument("--quick", action="store_true", help="small shapes and 2 reps (smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 7; quick 2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: all cores)")
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=3.35e12,
        help="accelerator memory bandwidth in bytes/s for the decode bound (default H100 SXM)",
    )
    ap.add_argument("--only", default="all", choices=("all", "smollm2", "minilm"))
    ap.add_argument("--no-torch", action="store_true", help="time jsteer only")
    ap.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help="also decode batch 1 after a prompt this long, half the new tokens (default 1000; quick 64; 0: off)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.smol_b, args.smol_t, args.new_tokens, args.decode_batches = 2, 32, 16, (1, 2)
        args.sample_batch, args.sample_tokens = 4, 8
        args.mini_b, args.mini_t = 8, 32
    else:
        args.smol_b, args.smol_t, args.new_tokens, args.decode_batches = 8, 128, 64, (1, 8)
        args.sample_batch, args.sample_tokens = 50, 20  # LM-Steer's evaluation decoding
        args.mini_b, args.mini_t = 32, 128
    args.prompt_t = 16
    if args.long_prompt is None:
        args.long_prompt = 64 if args.quick else 1000
    args.reps = args.reps or (2 if args.quick else 7)
    return args


_OUT: dict = {}  # what main() writes; refreshed after every case so a killed run keeps its numbers


def _flush(results: dict) -> None:
    if "path" in _OUT:
        _OUT["path"].write_text(json.dumps({**_OUT["head"], "results": results}, indent=1))


def compare(name: str, results: dict, j: dict, h: dict | None, work: float | None = None, unit: str = "") -> None:
    """Record jsteer/HF timings; speedup = HF time / jsteer time (> 1: jsteer faster)."""
    row = {"jsteer": j}
    if work is not None:
        row[f"jsteer_{unit}"] = work / j["median_s"]
    if h is not None:
        row["hf_torch"] = h
        row["speedup"] = h["median_s"] / j["median_s"]
        if "paired_ratios" in h:  # median over the interleaved (jsteer, HF) pairs
            row["speedup_paired_median"] = statistics.median(h["paired_ratios"])
        if work is not None:
            row[f"hf_{unit}"] = work / h["median_s"]
    results[name] = row
    _flush(results)
    msg = f"{name:<32} jsteer {j['median_s']:8.4f}s"
    if work is not None:
        msg += f" ({row[f'jsteer_{unit}']:8.1f} {unit})"
    if h is not None:
        msg += f" | HF torch {h['median_s']:8.4f}s"
        if work is not None:
            msg += f" ({row[f'hf_{unit}']:8.1f} {unit})"
        msg += f" | speedup x{row['speedup']:.2f}"
        if "speedup_paired_median" in row:
            msg += f" (paired x{row['speedup_paired_median']:.2f})"
    print(msg, flush=True)


def matmul_probe(name: str, results: dict, m: int, k: int, n: int, reps: int, use_torch: bool) -> None:
    """Time one jitted fp32 [m, k] x [k, n] product under jax and under torch (same operands,
    calls interleaved, 3 * reps each) and record GFLOP/s of the medians and their ratio."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    aj, bj = jnp.asarray(a), jnp.asarray(b)
    mm = jax.jit(jnp.matmul)
    fh = None
    if use_torch:
        import torch

        at, bt = torch.from_numpy(a), torch.from_numpy(b)
        fh = lambda: at @ bt  # noqa: E731
    j, h = timed_pair(lambda: mm(aj, bj).block_until_ready(), fh, 3 * reps)
    gflop = 2 * m * k * n / 1e9
    row = {"shape": [m, k, n], "jax_gflops": gflop / j["median_s"]}
    msg = f"{name:<32} jax {row['jax_gflops']:6.0f} GFLOP/s"
    if h is not None:
        row["torch_gflops"] = gflop / h["median_s"]
        row["jax_over_torch"] = row["jax_gflops"] / row["torch_gflops"]
        msg += f" | torch {row['torch_gflops']:6.0f} GFLOP/s | jax/torch x{row['jax_over_torch']:.2f}"
    results[name] = row
    _flush(results)
    print(msg, flush=True)


def products_floor(case: str, results: dict, products: list, reps: int, use_torch: bool) -> None:
    """Record under ``results[case]["products_floor"]`` :func:`jsteer.perf.time_products` of
    ``products`` and, when HF was timed, ``hf_over_floor`` (see the module docstring)."""
    r = results[case]
    r["products_floor"] = fl = time_products(products, reps, use_torch)
    floor, gflop = fl["floor_s"], fl["gflop"]
    msg = f"{'':<32} products floor {floor:.3f}s ({gflop:.0f} GFLOP at the faster library per product)"
    if "hf_torch" in r:
        r["hf_over_floor"] = r["hf_torch"]["median_s"] / floor
        msg += f": at most x{r['hf_over_floor']:.2f} over HF here"
    _flush(results)
    print(msg, flush=True)


# ----------------------------------------------------------------------------- SmolLM2


def bench_smollm2(args, results: dict, on_gpu: bool, use_torch: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsteer import decode, io
    from jsteer.convert.gguf import read_gguf

    path = io.embedded_path("smollm2-135m")
    print(f"loading {path.name} (dequantising once for both sides) ...", flush=True)
    hf_config, sd, tok_json, _ = read_gguf(path)
    from jsteer.tokenizer import Tokenizer

    lm = io.from_state_dict(hf_config, sd, Tokenizer.from_json(tok_json))
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lm.params))
    results["smollm2_param_bytes"] = int(param_bytes)  # fp32

    hf = None
    if use_torch:
        import torch
        import transformers

        cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config.items() if k != "architectures"})
        hf = transformers.LlamaForCausalLM(cfg).eval()
        missing, unexpected = hf.load_state_dict(
            {k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()}, strict=False
        )
        bad = [m for m in missing if m != "lm_head.weight"]  # tied
        if bad or unexpected:
            raise RuntimeError(f"torch SmolLM2 state dict mismatch: missing {bad}, unexpected {unexpected}")
        hf.tie_weights()
    del sd

    rng = np.random.default_rng(0)
    b, t = args.smol_b, args.smol_t
    matmul_probe(
        "matmul_probe_smollm2_ffn",
        results,
        b * t,
        lm.config.hidden_size,
        lm.config.intermediate_size,
        args.reps,
        use_torch,
    )
    ids = rng.integers(100, 40000, size=(b, t)).astype(np.int32)
    ids_j = jnp.asarray(ids)
    hf_fwd = None
    if hf is not None:
        ids_t = torch.from_numpy(ids.astype(np.int64))

        def hf_fwd():
            with torch.inference_mode():
                hf(ids_t).logits

    j, h = timed_pair(lambda: lm.forward(ids_j).logits.block_until_ready(), hf_fwd, args.reps)
    compare(f"smollm2_forward_B{b}xT{t}", results, j, h)
    c = lm.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    products_floor(
        f"smollm2_forward_B{b}xT{t}",
        results,
        dense_products(
            b * t,
            c.num_layers,
            [
                ("q", c.hidden_size, q),
                ("k", c.hidden_size, kv),
                ("v", c.hidden_size, kv),
                ("o", q, c.hidden_size),
                ("gate", c.hidden_size, c.intermediate_size),
                ("up", c.hidden_size, c.intermediate_size),
                ("down", c.intermediate_size, c.hidden_size),
            ],
        )
        + [("logits", 1, (b * t, c.hidden_size), (c.vocab_size, c.hidden_size), False, True)]
        + attention_products(b * c.num_heads, t, c.head_dim, c.num_layers),
        args.reps,
        use_torch,
    )

    bandwidth = args.bandwidth if on_gpu else read_bandwidth()
    results["host_read_bandwidth_bytes_per_s" if not on_gpu else "assumed_bandwidth_bytes_per_s"] = bandwidth
    cases = [(bs, args.prompt_t, args.new_tokens) for bs in args.decode_batches]
    if args.long_prompt:
        cases.append((1, args.long_prompt, args.new_tokens // 2))
    for bs, prompt_t, n in cases:
        prompt = rng.integers(100, 40000, size=(bs, prompt_t)).astype(np.int32)
        p_j, m_j = jnp.asarray(prompt), jnp.ones_like(jnp.asarray(prompt))

        def jx_decode():
            out = decode.generate(lm.module, lm.params, p_j, m_j, max_new_tokens=n, stop_ids=())
            out.tokens.block_until_ready()
            assert int(out.lengths.min()) == n

        hf_decode = None
        if hf is not None:
            p_t = torch.from_numpy(prompt.astype(np.int64))

            def hf_decode():
                with torch.inference_mode():
                    out = hf.generate(
                        p_t,
                        attention_mask=torch.ones_like(p_t),
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                    )
                assert out.shape[1] == prompt_t + n

        j, h = timed_pair(jx_decode, hf_decode, args.reps)
        name = f"smollm2_greedy{n}_batch{bs}" + (f"_prompt{prompt_t}" if prompt_t != args.prompt_t else "")
        compare(name, results, j, h, work=bs * n, unit="tokens_per_s")
        bound = bs * bandwidth / param_bytes
        # a step also reads each row's KV cache so far: fp32 K and V of every layer, on average
        # prompt + (n + 1) / 2 slots (prefill's reads not counted)
        c = lm.config
        kv_bytes = bs * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 * (prompt_t + (n + 1) / 2)
        r = results[name]
        r["bandwidth_bytes_per_s"] = bandwidth
        r["bandwidth_bound_tokens_per_s"] = bound
        r["fraction_of_bound"] = r["jsteer_tokens_per_s"] / bound
        r["kv_cache_bytes_per_step"] = kv_bytes
        r["fraction_of_bound_with_cache"] = r["jsteer_tokens_per_s"] * (param_bytes + kv_bytes) / (bs * bandwidth)
        if "hf_tokens_per_s" in r:
            r["hf_fraction_of_bound"] = r["hf_tokens_per_s"] / bound
        print(
            f"{'':<32} bandwidth bound {bound:8.1f} tokens/s (jsteer {100 * r['fraction_of_bound']:.0f}%"
            + (f", HF {100 * r['hf_fraction_of_bound']:.0f}%" if "hf_fraction_of_bound" in r else "")
            + ")",
            flush=True,
        )

    # top-p sampling at temperature 1, as the LM-Steer evaluations decode (25 samples x 2 prompts per call)
    bs, n = args.sample_batch, args.sample_tokens
    prompt = rng.integers(100, 40000, size=(bs, args.prompt_t)).astype(np.int32)
    p_j, m_j = jnp.asarray(prompt), jnp.ones_like(jnp.asarray(prompt))
    seed = iter(range(1 << 30))

    def jx_sample():
        out = decode.generate(
            lm.module,
            lm.params,
            p_j,
            m_j,
            max_new_tokens=n,
            temperature=1.0,
            top_p=0.9,
            stop_ids=(),
            rng=jax.random.PRNGKey(next(seed)),
        )
        out.tokens.block_until_ready()

    hf_sample = None
    if hf is not None:
        p_t = torch.from_numpy(prompt.astype(np.int64))

        def hf_sample():
            with torch.inference_mode():
                hf.generate(
                    p_t,
                    attention_mask=torch.ones_like(p_t),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=True,
                    temperature=1.0,
                    top_p=0.9,
                    top_k=0,
                    pad_token_id=0,
                )

    j, h = timed_pair(jx_sample, hf_sample, args.reps)
    compare(f"smollm2_top_p0.9_sample{n}_batch{bs}", results, j, h, work=bs * n, unit="tokens_per_s")


# ----------------------------------------------------------------------------- MiniLM


def bench_minilm(args, results: dict, use_torch: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jsteer
    from jsteer import io
    from jsteer.backbones import bert_heads as jh

    path = io.embedded_path("minilm")
    lm = jsteer.load("minilm")
    b, t, labels = args.mini_b, args.mini_t, 9
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[b // 2 :, t * 3 // 4 :] = 0  # some padding, as in real batches
    y = rng.integers(0, labels, size=(b, t)).astype(np.int32)
    matmul_probe(
        "matmul_probe_minilm_ffn",
        results,
        b * t,
        lm.config.hidden_size,
        lm.config.intermediate_size,
        args.reps,
        use_torch,
    )
    ids_j, mask_j, y_j = map(jnp.asarray, (ids, mask, y))

    hf_enc = hf_tc = None
    if use_torch:
        import torch
        import transformers

        hf_enc = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
        hf_tc = transformers.BertForTokenClassification.from_pretrained(str(path), num_labels=labels).train()
        ids_t, mask_t, y_t = (torch.from_numpy(a.astype(np.int64)) for a in (ids, mask, y))

    hf_fwd = None
    if hf_enc is not None:

        def hf_fwd():
            with torch.inference_mode():
                hf_enc(ids_t, attention_mask=mask_t).last_hidden_state

    j, h = timed_pair(lambda: lm.forward(ids_j, mask_j).hidden.block_until_ready(), hf_fwd, args.reps)
    compare(f"minilm_forward_B{b}xT{t}", results, j, h)
    c = lm.config
    dims = [
        ("qkv", c.hidden_size, 3 * c.hidden_size),
        ("attention out", c.hidden_size, c.hidden_size),
        ("ffn up", c.hidden_size, c.intermediate_size),
        ("ffn down", c.intermediate_size, c.hidden_size),
    ]
    head_dim = c.hidden_size // c.num_heads

    def encoder_products(backward):
        return dense_products(b * t, c.num_layers, dims, backward=backward) + attention_products(
            b * c.num_heads, t, head_dim, c.num_layers, backward=backward
        )

    products_floor(f"minilm_forward_B{b}xT{t}", results, encoder_products(False), args.reps, use_torch)

    # token classification: encoder from MiniLM + fresh head, dropout on, AdamW
    module = jh.BertForTokenClassification(lm.config, num_labels=labels)
    params = {
        "encoder": lm.params["encoder"],
        "head": jh.init_head(jax.random.PRNGKey(0), lm.config, "token_classification", labels),
    }
    params = jax.tree.map(jnp.array, params)  # own copies: the step donates them
    opt = optax.adamw(5e-5, weight_decay=0.01)
    opt_state = opt.init(params)

    def loss_fn(p, key):
        logits = module.apply(
            {"params": p}, ids_j, attention_mask=mask_j, deterministic=False, rngs={"dropout": key}
        ).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y_j)
        return (ce * mask_j).sum() / mask_j.sum()

    def step(p, s, key):
        loss, g = jax.value_and_grad(loss_fn)(p, key)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    step = jax.jit(step, donate_argnums=(0, 1))  # params / optimizer state updated in place
    state = {"p": params, "s": opt_state, "k": jax.random.PRNGKey(1)}

    def jx_train():
        state["k"], k = jax.random.split(state["k"])
        state["p"], state["s"], loss = step(state["p"], state["s"], k)
        loss.block_until_ready()

    hf_train = None
    if hf_tc is not None:
        hopt = torch.optim.AdamW(hf_tc.parameters(), lr=5e-5, weight_decay=0.01)
        y_masked = torch.where(mask_t > 0, y_t, torch.full_like(y_t, -100))

        def hf_train():
            loss = hf_tc(ids_t, attention_mask=mask_t, labels=y_masked).loss
            loss.backward()
            hopt.step()
            hopt.zero_grad(set_to_none=True)

    j, h = timed_pair(jx_train, hf_train, args.reps)
    compare(f"minilm_tokcls_train_step_B{b}xT{t}", results, j, h)
    products_floor(f"minilm_tokcls_train_step_B{b}xT{t}", results, encoder_products(True), args.reps, use_torch)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    import jsteer  # first: its fp32 dot setting only takes effect before a JAX backend starts

    if jsteer.cpu_precision.STATE.startswith("too late"):
        raise SystemExit(f"bench_backbones: {jsteer.cpu_precision.STATE}; jsteer would be timed off its default dots")
    if jsteer.cpu_malloc.STATE.startswith("too late"):
        raise SystemExit(f"bench_backbones: {jsteer.cpu_malloc.STATE}; jsteer would be timed off its default")
    import jax

    on_gpu = jax.default_backend() == "gpu"
    use_torch = not args.no_torch
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
    }
    from jsteer.backbones import cpu

    # decoding with 2..MAX_ROWS rows multiplies through this kernel when it is available
    env["jsteer_cpu_kernel"] = cpu.available() or f"unavailable: {cpu.unavailable_reason()}"
    env["cpu"] = cpu.describe()
    if use_torch:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        env.update(
            torch=torch.__version__,
            transformers=transformers.__version__,
            torch_threads=torch.get_num_threads(),
            torch_device="cpu",
        )
        if on_gpu:
            print("note: jax runs on the GPU but the torch reference on the CPU; speedups compare devices", flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    settings["decode_batches"] = list(args.decode_batches)
    settings["settle_calls"] = SETTLE
    print(f"jax {jax.__version__} on {jax.default_backend()}; {os.cpu_count()} cores; reps {args.reps}", flush=True)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _OUT.update(path=out, head={"env": env, "settings": settings})
    results: dict = {}
    if args.only in ("all", "smollm2"):
        bench_smollm2(args, results, on_gpu, use_torch)
    if args.only in ("all", "minilm"):
        bench_minilm(args, results, use_torch)

    results["complete"] = True
    _flush(results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
