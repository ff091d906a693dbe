"""Why batch-1 decoding slowed down with context on XLA:CPU: the KV cache was copied every step.

Two measurements (JSON to ``--out``):

1. ``generate``: SmolLM2-135M greedy decoding through ``jsteer.decode.generate`` at batch 1 and 2,
   prompts of 16 and 1000 tokens: ms per decode step (median over runs of 1 and 33 new tokens,
   differenced) and the ``copy`` instructions in the compiled decode loop's body. With the cache kept
   as [B, ...] at batch 1, XLA drops the size-1 batch axis from attention's products, updates each
   layer's cache twice a step (once per shape) and copies every slot of it; jsteer now carries and
   writes a one-row cache without that axis on CPU (``KVCache.unbatched``).
2. ``layouts``: the pattern reduced to a ``lax.while_loop`` of 4 layers, one cache each (K 3, H 64,
   S 1024), 32 steps: kept as [B, K, H, S] against the batch and head axes merged ([B*K, H, S]).

    python experiments/probe_kv_cache_copies.py     # ~2 min on 2 cores

Measured (session 39, shared 2-core VM), batch 1 before / after the change: 243 / 13 copies in the
loop body (batch 2: 13); 23.8 / 22.2 ms a step with a 16-token prompt, 45.1 / 31.8 ms with 1000
(batch 2: 24.2-26.7 and 45.7-48.1 ms). The reduced loop at batch 1: 17 copies and 15.6 ms as
[B, K, H, S], 6 copies and 2.0 ms merged.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jsteer
from jsteer import decode, io


def generate_case(lm, batch: int, prompt: int, reps: int) -> dict:
    ids = jnp.asarray(np.repeat(np.random.default_rng(0).integers(100, 40000, (1, prompt)), batch, 0), jnp.int32)
    hlo = {}
    real = decode._generate

    def spy(*a, **k):
        hlo["text"] = real.lower(*a, **k).compile().as_text()
        return real(*a, **k)

    def run(n):
        decode.generate(lm.module, lm.params, ids, max_new_tokens=n, stop_ids=()).tokens.block_until_ready()

    decode._generate = spy
    try:
        run(33)
    finally:
        decode._generate = real
    run(1)
    times = {1: [], 33: []}
    for _ in range(reps):
        for n in times:
            t = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - t)
    step = (np.median(times[33]) - np.median(times[1])) / 32
    return {
        "batch": batch,
        "prompt": prompt,
        "ms_per_step": 1e3 * step,
        "loop_copies": decode.loop_body_copies(hlo["text"]),
    }


def layout_case(batch: int, merged: bool, layers=4, k=3, h=64, s=1024, steps=32) -> dict:
    shape = (batch * k, h, s) if merged else (batch, k, h, s)

    def step(carry):
        i, x, caches = carry
        new = []
        for c in caches:
            kn = jnp.tanh(x)[:, None, :, None] * jnp.ones((batch, k, h, 1))
            q = jnp.repeat(x[:, None, :], k, 1)
            if merged:
                c = lax.dynamic_update_slice(c, kn.reshape(batch * k, h, 1), (0, 0, i))
                scores = jnp.einsum("nh,nhs->ns", q.reshape(batch * k, h), c)
            else:
                c = lax.dynamic_update_slice(c, kn, (0, 0, 0, i))
                scores = jnp.einsum("bkh,bkhs->bks", q, c)
            x = x + scores.reshape(batch, -1).mean(-1, keepdims=True)
            new.append(c)
        return i + 1, x, tuple(new)

    run = jax.jit(lambda x, cs: lax.while_loop(lambda c: c[0] < steps, step, (0, x, cs)))
    x, caches = jnp.ones((batch, h)), tuple(jnp.zeros(shape) for _ in range(layers))
    copies = decode.loop_body_copies(run.lower(x, caches).compile().as_text())
    run(x, caches)[1].block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        run(x, caches)[1].block_until_ready()
        times.append(time.perf_counter() - t)
    layout = "[B*K, H, S]" if merged else "[B, K, H, S]"
    return {"batch": batch, "layout": layout, "loop_copies": copies, "ms_min": 1e3 * min(times)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="experiments/results/probe_kv_cache_copies.json")
    args = ap.parse_args(argv)
    lm = jsteer.load(io.embedded_path("smollm2-135m"))
    out = {"generate": [], "layouts": []}
    for prompt in (16, 1000):
        for batch in (1, 2):
            out["generate"].append(generate_case(lm, batch, prompt, args.reps))
            print(out["generate"][-1], flush=True)
    for batch in (1, 2):
        for merged in (False, True):
            out["layouts"].append(layout_case(batch, merged))
            print(out["layouts"][-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
