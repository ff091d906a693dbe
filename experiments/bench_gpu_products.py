"""What a bf16 matrix product costs forward + backward in each form jsteer has used (issue #36).

    python experiments/bench_gpu_products.py --out F.json [--tiny] [--reps N]

At the 1B decoder's training shapes (4 x 2048 = 8192 tokens, hidden 2048, MLP 8192, vocab 128256),
the gradient of <y, g> (g a fixed cotangent, so the backward's two products run as in training):

  layer  [8192, 2048] @ [2048, 8192] -> bf16
    f32_then_cast  ``preferred_element_type=float32`` then ``.astype(bf16)`` (jsteer before session 36:
                   the backward's products get an fp32 cotangent against a bf16 operand)
    bf16           bf16 product (cuBLAS accumulates in fp32), the backward bf16 x bf16
    torch          ``torch.nn.functional.linear`` on bf16 tensors
  logits [8192, 2048] @ [128256, 2048]^T -> f32
    f32_plain      ``preferred_element_type=float32`` (the backward: fp32 cotangent x bf16)
    dot_fp32_out   ``jsteer.backbones.matmul.dot_fp32_out`` (fp32 logits, bf16 backward)
    bf16_then_f32  bf16 logits, then ``.astype(float32)`` (HF's form)
    torch          ``F.linear(h, table).float()``

MFU against the chip's dense bf16 peak, counting 3 products of 2 M K N FLOPs each.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from jsteer import perf
from jsteer.train.bench import peak_tflops
from jsteer.train.gpu_bench import jax_sync, median_time, torch_device, torch_sync


def shapes(tiny: bool) -> dict:
    m, d, f, v = (64, 32, 128, 1000) if tiny else (8192, 2048, 8192, 128256)
    return {"layer": (m, d, f), "logits": (m, d, v)}


def jax_rows(a, res):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jsteer.backbones.matmul import dot_fp32_out

    nn_ = (((1,), (0,)), ((), ()))
    nt = (((1,), (1,)), ((), ()))
    forms = {
        "layer": {
            "f32_then_cast": lambda x, w: lax.dot_general(x, w, nn_, preferred_element_type=jnp.float32).astype(
                x.dtype
            ),
            "bf16": lambda x, w: lax.dot_general(x, w, nn_),
        },
        "logits": {
            "f32_plain": lambda x, w: lax.dot_general(x, w, nt, preferred_element_type=jnp.float32),
            "dot_fp32_out": lambda x, w: dot_fp32_out(x, w, nt),
            "bf16_then_f32": lambda x, w: lax.dot_general(x, w, nt).astype(jnp.float32),
        },
    }
    for case, (m, k, n) in shapes(a.tiny).items():
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(ks[1], (k, n) if case == "layer" else (n, k), jnp.bfloat16) * 0.02
        g = jax.random.normal(ks[2], (m, n), jnp.bfloat16 if case == "layer" else jnp.float32)
        for name, f in forms[case].items():
            step = jax.jit(
                jax.grad(lambda x, w, g, f=f: jnp.vdot(f(x, w).astype(g.dtype), g).astype(jnp.float32), (0, 1))
            )
            first, s = median_time(lambda: step(x, w, g), jax_sync, a.reps, 2)
            record(res, case, name, first, s, m, k, n)


def torch_rows(a, res):
    import torch

    dev = torch_device()
    for case, (m, k, n) in shapes(a.tiny).items():
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
        g = torch.randn(m, n, device=dev, generator=gen, dtype=torch.bfloat16 if case == "layer" else torch.float32)

        def step():
            y = torch.nn.functional.linear(x, w)
            y = y if case == "layer" else y.float()
            return torch.autograd.grad((y * g).sum(), (x, w))

        first, s = median_time(step, torch_sync, a.reps, 2)
        record(res, case, "torch", first, s, m, k, n)


def record(res, case, name, first, s, m, k, n):
    flops = 3 * 2 * m * k * n
    row = {"first_s": first, "fwd_bwd_ms": s * 1e3, "tflops": flops / s / 1e12}
    if res.get("peak_bf16_tflops"):
        row["mfu"] = row["tflops"] / res["peak_bf16_tflops"]
    res.setdefault(case, {"m_k_n": [m, k, n]})[name] = row
    print(case, name, row, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=("jax", "torch", "both"), default="both")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res = {"tiny": a.tiny, "reps": a.reps, "machine": perf.machine()}
    if a.framework in ("jax", "both"):
        import jax

        res.update(jax=jax.__version__, device=jax.devices()[0].device_kind)
    res["peak_bf16_tflops"] = peak_tflops(res.get("device", ""))
    t0 = time.perf_counter()
    if a.framework in ("jax", "both"):
        jax_rows(a, res)
    if a.framework in ("torch", "both"):
        torch_rows(a, res)
    res["wall_s"] = time.perf_counter() - t0
    pathlib.Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
