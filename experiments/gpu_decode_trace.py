"""Where a greedy decode step's time goes: one ``generate`` call of the ~1B Llama-shaped decoder
(random bf16 weights, batch 1, 128-token prompt) under ``jax.profiler``, summarised per trace
process (on a GPU: the host threads and each device stream) as event counts and busy time, per
call and per decode step, with the longest-running event names.

Issue #36: on the H200 a step takes 1.79 ms at batch 1 and at batch 64 alike against a 0.84 ms
bandwidth bound (sessions 37, 41), a fixed cost per step; this counts the kernels a step launches
and how much of the step the device is busy.

    python experiments/gpu_decode_trace.py --out DIR [--tiny] [--new 32] [--batch 1]

writes DIR/decode_trace.json (the summary) and DIR/trace.json.gz (the Perfetto trace).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys

import numpy as np


def summarise(trace: dict, steps: int, top: int = 25) -> dict:
    """Per trace process: complete events ("X"), their summed duration (us) and the top names."""
    from jsteer.train.trace_ops import process_names

    names = process_names(trace)
    per = collections.defaultdict(
        lambda: {"events": 0, "busy_us": 0.0, "by_name": collections.Counter(), "first": float("inf"), "last": 0.0}
    )
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        p, dur = per[names.get(e["pid"], str(e["pid"]))], e.get("dur", 0)
        p["events"] += 1
        p["busy_us"] += dur
        p["by_name"][e["name"]] += dur
        p["first"], p["last"] = min(p["first"], e["ts"]), max(p["last"], e["ts"] + dur)
    out = {}
    for name, p in per.items():
        out[name] = {
            "events": p["events"],
            "events_per_step": p["events"] / steps,
            "busy_ms": p["busy_us"] / 1e3,
            "busy_ms_per_step": p["busy_us"] / 1e3 / steps,
            "span_ms": (p["last"] - p["first"]) / 1e3,
            "top": [{"name": k[:160], "ms": v / 1e3} for k, v in p["by_name"].most_common(top)],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the toy config (a smoke run on any backend)")
    ap.add_argument("--new", type=int, default=32, help="new tokens in the traced call")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jsteer.decode import generate
    from jsteer.train.gpu_bench import LLAMA_1B, LLAMA_TINY, jax_sync, jsteer_llama, median_time
    from jsteer.train.trace_ops import record

    c = LLAMA_TINY if a.tiny else LLAMA_1B
    module, params = jsteer_llama(c, jnp.bfloat16)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    prompt = 16 if a.tiny else 128
    ids = jnp.asarray(np.random.default_rng(0).integers(1, c["vocab_size"], (a.batch, prompt)).astype(np.int32))

    def call():
        return generate(module, params, ids, max_new_tokens=a.new).tokens

    compile_s, untraced_s = median_time(call, jax_sync, 1, 1)
    out = pathlib.Path(a.out)
    traced_s = record(call, out)
    with gzip.open(out / "trace.json.gz") as f:
        trace = json.load(f)
    summary = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "config": c,
        "batch": a.batch,
        "prompt": prompt,
        "new_tokens": a.new,
        "compile_first_call_s": compile_s,
        "untraced_call_s": untraced_s,
        "traced_call_s": traced_s,
        "untraced_ms_per_step": untraced_s / a.new * 1e3,
        "note": "per-step figures divide the whole call (prefill included) by the new tokens",
        "processes": summarise(trace, a.new),
    }
    (out / "decode_trace.json").write_text(json.dumps(summary, indent=1) + "\n")
    for name, p in summary["processes"].items():
        print(f"{name[:60]:60s} {p['events_per_step']:8.1f} events/step  busy {p['busy_ms_per_step']:7.3f} ms/step")
    print(f"untraced {summary['untraced_ms_per_step']:.3f} ms/step; wrote {out / 'decode_trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
