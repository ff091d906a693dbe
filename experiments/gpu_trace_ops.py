"""A profiled call's device time per model op (:mod:`jsteer.train.trace_ops`).

    python experiments/gpu_trace_ops.py TRACE.json.gz HLO [--steps N] [--top 30] [--out F.json]

TRACE: the trace ``jax.profiler`` wrote (``gpu_decode_trace.py``'s trace.json.gz); HLO: the program
as XLA optimised it (``XLA_FLAGS=--xla_dump_to=DIR``: the ``*after_optimizations.txt`` file, a folder
holding them, or a .tgz of it, as ``device_check.sh`` returns; of several programs, the one naming the most
of the trace's kernel time). Session 48 read the H200 decode trace
this way by hand: the output projection's multiply + reduce (15.7 us a layer against q's 3.8 us) and
the token lookup's whole-table convert.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib

from jsteer.train.trace_ops import hlo_text, summarise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("hlo")
    ap.add_argument("--steps", type=int, default=1, help="divide times by this (the traced call's decode steps)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    trace = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
    res = summarise(trace, hlo_text(pathlib.Path(a.hlo), trace), a.steps, a.top)
    print(f"busy {res['busy_us_per_step']:.1f} us a step")
    for r in res["ops"]:
        print(f"{r['us_per_step']:9.1f} us {100 * r['share']:5.1f}% {r['events_per_step']:7.1f}/step  {r['op']}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
