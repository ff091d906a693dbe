"""Load time and peak host memory of a Llama-shaped bf16 checkpoint: jsteer vs transformers (issue #34).

Writes a ~``--params`` parameter Llama checkpoint (hidden 2048, 32 heads / 8 KV heads, FFN 5632,
vocab 32000, tied embeddings; layers chosen to reach the size; random bf16 values) as 4
safetensors shards + ``model.safetensors.index.json`` + ``config.json`` (no tokenizer) into a
temporary folder, deleted afterwards. Each load then runs in a fresh subprocess, the two sides
alternating, ``--reps`` times each:

- ``jsteer``: ``jsteer.load(dir, dtype="bfloat16")`` (params on the default JAX device, here the CPU);
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``
  (``dtype`` is transformers 5's name for ``torch_dtype``).

Each subprocess imports its library and the model code, runs a tiny warm-up, records its
resident memory (VmRSS), resets the kernel's high-water mark to it (``/proc/self/clear_refs``:
5), loads, and reports wall time, the process's CPU time over the same span (all threads;
steadier than wall time on a shared machine), and ``peak = VmHWM - baseline``: the memory the
load itself needed above the interpreter's. transformers 5 maps the safetensors files and its
params read the mapped pages on first use, so its load returns before any weight is in memory:
``touch_s`` is the time to then read one value of every page of every param (faulting the
weights in), and the peak is taken after it. jsteer's params are in memory when load returns
(``touch_s`` 0). jsteer hashes the weight files for provenance only when ``lm.identity`` is
first read, not in the load: ``jsteer_sha256_s`` is what that costs, once per process.

``--cache warm`` (default): the shards are read right before each load, so every load reads
from the page cache. ``--cache cold``: they are dropped from the page cache before each load
(``posix_fadvise(DONTNEED)``; the guest's cache only, the host may still hold them), so every
load (and transformers' touch) reads them from the disk. ``host.fresh_memory_s_per_gib`` is what
faulting in 1 GiB of new anonymous memory costs here (``MAP_POPULATE``, median of 3): a loader
that copies the weights pays it once per GB of params, one that maps the files (transformers)
does not. Targets: jsteer peak <= 1.25x checkpoint bytes, jsteer time <= transformers'
(compared as load + touch).

    python experiments/bench_load.py                 # ~1B params (2 GB), experiments/results/bench_load.json
    python experiments/bench_load.py --cache cold --out experiments/results/bench_load_cold.json
    python experiments/bench_load.py --params 0.2e9 --out experiments/results/bench_load_0.2b.json  # smaller
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=5632, vocab_size=32000)
N_SHARDS = 4
TARGET_PEAK_RATIO = 1.25
KINDS = ("jsteer", "transformers")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9, help="approximate parameter count (default 1e9)")
    ap.add_argument("--reps", type=int, default=3, help="loads per side, each in a fresh process (default 3)")
    ap.add_argument(
        "--cache", choices=("warm", "cold"), default="warm", help="shards in the page cache before each load or not"
    )
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_load.json"))
    ap.add_argument("--tmp", default=None, help="where to write the checkpoint (default: the system temp dir)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- the checkpoint


def llama_config(n_params: float) -> dict:
    s = SHAPE
    d, hd = s["hidden_size"], s["hidden_size"] // s["num_attention_heads"]
    per_layer = 2 * d * d + 2 * d * s["num_key_value_heads"] * hd + 3 * d * s["intermediate_size"] + 2 * d
    layers = max(1, round((n_params - s["vocab_size"] * d - d) / per_layer))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **s,
        "num_hidden_layers": layers,
        "head_dim": hd,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    shapes["model.norm.weight"] = (d,)
    return shapes


def write_checkpoint(folder: pathlib.Path, cfg: dict) -> dict:
    """bf16 safetensors shards written tensor by tensor from a 4 MiB pool of random values (the
    writer never holds more than the pool); -> {"params", "bytes", "files"}."""
    import ml_dtypes
    import numpy as np

    shapes = tensor_shapes(cfg)
    n = {k: int(np.prod(s)) for k, s in shapes.items()}
    total = sum(n.values())
    pool = (np.random.default_rng(0).standard_normal(1 << 21) * 0.02).astype(ml_dtypes.bfloat16).tobytes()
    groups, acc = [[] for _ in range(N_SHARDS)], 0
    for k in shapes:
        groups[min(N_SHARDS - 1, acc * N_SHARDS // total)].append(k)
        acc += n[k]
    weight_map, size = {}, 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{N_SHARDS:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for k in names:
            header[k] = {"dtype": "BF16", "shape": list(shapes[k]), "data_offsets": [off, off + 2 * n[k]]}
            off += 2 * n[k]
            weight_map[k] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for k in names:
                left = 2 * n[k]
                while left:
                    chunk = pool[: min(left, len(pool))]
                    f.write(chunk)
                    left -= len(chunk)
        size += (folder / fname).stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"params": total, "bytes": size, "files": N_SHARDS}


# ----------------------------------------------------------------------------- one load (subprocess)


def _status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(kind: str, folder: pathlib.Path) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # the checkpoint has no tokenizer files: jsteer warns once
    if kind == "transformers":
        import torch
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (model code imported)

        def load():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            assert next(model.parameters()).dtype == torch.bfloat16
            return model

        def touch(model):
            with torch.no_grad():
                return sum(int(p.view(torch.int16).reshape(-1)[::2048].sum()) for p in model.parameters())
    else:
        import jax
        import jax.numpy as jnp

        import jsteer
        import jsteer.io  # the load code, as transformers' model classes above
        from jsteer.backbones import families  # noqa: F401

        jax.block_until_ready(jnp.ones(4, jnp.bfloat16) * 2)  # backend up before the baseline

        def load():
            lm = jsteer.load(folder, dtype="bfloat16")
            jax.block_until_ready(lm.params)
            return lm

        def touch(lm):
            return None

    baseline = _status_kib("VmRSS")
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    c0, t0 = time.process_time(), time.perf_counter()
    model = load()
    dt = time.perf_counter() - t0
    touch(model)
    dt_touch = time.perf_counter() - t0 - dt
    cpu = time.process_time() - c0
    hwm = _status_kib("VmHWM")
    out = {
        "kind": kind,
        "time_s": dt,
        "touch_s": dt_touch,
        "cpu_s": cpu,
        "baseline_bytes": baseline * 1024,
        "peak_bytes": (hwm - baseline) * 1024,
        "rss_after_bytes": (_status_kib("VmRSS") - baseline) * 1024,
        "hwm_reset": hwm_reset,
    }
    if kind == "jsteer":
        from jsteer.convert.layout import load_threads

        out["jsteer_threads"] = load_threads()
        t0 = time.perf_counter()
        identity = model.identity  # the weight files' sha256, first computed here
        out["jsteer_sha256_s"] = time.perf_counter() - t0
        out["jsteer_path"] = jsteer.__file__
        assert identity.startswith("sha256:")
    del model
    return out


def run_worker(kind: str, folder: pathlib.Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", kind, "--dir", str(folder)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- driver


def set_cache(files, state: str) -> None:
    """Shards into the page cache (read them) or out of it (``posix_fadvise(DONTNEED)``)."""
    for f in files:
        if state == "warm":
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        else:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh_memory_s_per_gib(reps: int = 3) -> float:
    """Seconds to fault in 1 GiB of new anonymous memory (``MAP_POPULATE``), median of ``reps``."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = mmap.mmap(-1, 1 << 30, flags=flags)
        times.append(time.perf_counter() - t0)
        m.close()
    return statistics.median(times)


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "safetensors", "torch", "transformers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    mem = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem,
        "load_avg": os.getloadavg(),
        "fresh_memory_s_per_gib": fresh_memory_s_per_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "jsteer_commit": commit,
    }


def summarise(runs: list[dict], size: int) -> dict:
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        rs = [r for r in runs if r["kind"] == kind]
        peak = max(r["peak_bytes"] for r in rs)
        out[kind] = {
            "time_s_median": statistics.median(r["time_s"] for r in rs),
            "time_s_min": min(r["time_s"] for r in rs),
            "time_with_touch_s_median": statistics.median(r["time_s"] + r["touch_s"] for r in rs),
            "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
            "peak_bytes_max": peak,
            "peak_over_checkpoint": peak / size,
        }
        if kind == "jsteer":  # the first lm.identity (not part of the load)
            out[kind]["sha256_s_median"] = statistics.median(r["jsteer_sha256_s"] for r in rs)
    if "jsteer" in out and "transformers" in out:
        j, t = out["jsteer"]["time_with_touch_s_median"], out["transformers"]["time_with_touch_s_median"]
        out["targets"] = {
            "peak_over_checkpoint_max": TARGET_PEAK_RATIO,
            "jsteer_peak_met": out["jsteer"]["peak_over_checkpoint"] <= TARGET_PEAK_RATIO,
            "jsteer_time_over_transformers": j / t,
            "jsteer_time_met": j <= t,
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, pathlib.Path(args.dir))))
        return 0
    kinds = list(KINDS)
    cfg = llama_config(args.params)
    host = environment()  # before the loads: its load average is the one they start under
    from jsteer import perf

    host["machine"] = perf.machine()
    with tempfile.TemporaryDirectory(prefix="bench_load_", dir=args.tmp) as tmp:
        folder = pathlib.Path(tmp)
        t0 = time.perf_counter()
        ckpt = write_checkpoint(folder, cfg)
        print(
            f"wrote {ckpt['params'] / 1e9:.3f}B params, {ckpt['bytes'] / 2**30:.2f} GiB in {N_SHARDS} shards "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        shards = sorted(folder.glob("*.safetensors"))
        runs = []
        for rep in range(args.reps):
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                set_cache(shards, args.cache)
                load_avg = os.getloadavg()[0]
                r = run_worker(kind, folder)
                runs.append({**r, "cache": args.cache, "load_avg_1min": load_avg})
                print(
                    f"  {kind:12s} {r['time_s']:6.2f}s + touch {r['touch_s']:5.2f}s (cpu {r['cpu_s']:5.2f}s)  peak "
                    f"{r['peak_bytes'] / 2**30:5.2f} GiB "
                    f"({r['peak_bytes'] / ckpt['bytes']:.2f}x checkpoint)",
                    flush=True,
                )
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "host": host,
        "checkpoint": {**ckpt, "config": cfg, "dtype": "bfloat16"},
        "cache": args.cache,
        "runs": runs,
        "summary": summarise(runs, ckpt["bytes"]),
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
