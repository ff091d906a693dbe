"""Memory plans for Llama-3-8B and -70B on 8 devices, without the hardware or the weights.

    python experiments/plan_scale.py [--out experiments/results/plan_scale.json] [--tiny]

On 8 forced host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here) each
program is lowered and compiled ahead of time from ``jax.ShapeDtypeStruct`` params that carry
their shardings (:mod:`jsteer.sharding`), bf16, the layer stack scanned (``scan_layers``):

* ``forward``: batch 8 x 2048 tokens, last-position logits;
* ``decode_step``: one greedy decode step at batch 8 with a 4096-slot KV cache (heads on
  ``tensor``), the cache donated;
* ``steer_step`` (8B): an LM-Steer training step through the frozen backbone (the original's
  full-forward path), batch 32 x 256, rank-1000 steer, Adam.

For each it records ``compiled.memory_analysis()`` per device (arguments, outputs, temporaries,
aliased) and the collectives in the optimized HLO. Targets (issue #35): the 70B decode program fits
80 GiB per device; the 8B LM-Steer step fits 16 GiB per device; per-device argument bytes within
1.2x of (param bytes / shards that hold them). ``--tiny`` runs the same programs on toy shapes (the
test suite does, so the script stays runnable).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jsteer import sharding as S  # noqa: E402
from jsteer.backbones.base import KVCache  # noqa: E402
from jsteer.backbones.decoder import Decoder  # noqa: E402
from jsteer.backbones.decoder_config import DecoderConfig  # noqa: E402
from jsteer.backbones.decoder_params import logical_axes  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30
LLAMA3 = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8),
}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def config(name: str) -> DecoderConfig:
    kw = LLAMA3[name]
    return DecoderConfig.llama(
        vocab_size=128256 if name != "tiny" else 256,
        num_kv_heads=8,
        head_dim=kw["hidden_size"] // kw["num_heads"],
        rope_theta=500000.0,
        max_position_embeddings=8192,
        scan_layers=True,
        **kw,
    )


def param_specs(cfg: DecoderConfig, mesh, rules, dtype=jnp.bfloat16):
    shapes = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    shard = S.shardings(shapes, logical_axes(shapes), mesh, rules)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), shapes, shard)


def rows(mesh, shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, S.batch_spec(mesh, len(shape))))


def report(compiled, seconds: float) -> dict:
    m = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    mem = {f: int(getattr(m, f)) for f in fields}
    peak = (
        mem["argument_size_in_bytes"]
        + mem["output_size_in_bytes"]
        + mem["temp_size_in_bytes"]
        - mem["alias_size_in_bytes"]
    )
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES}
    return {
        "memory_per_device": mem,
        "peak_per_device_gib": peak / GIB,
        "argument_per_device_gib": mem["argument_size_in_bytes"] / GIB,
        "collectives": counts,
        "compile_s": seconds,
    }


def compile_timed(fn, *args, donate=()):
    t = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return compiled, time.perf_counter() - t


def forward_plan(cfg, mesh, rules, batch, length) -> dict:
    module, params = Decoder(cfg, dtype=jnp.bfloat16), param_specs(cfg, mesh, rules)
    compiled, s = compile_timed(
        lambda p, i: module.apply({"params": p}, i, last_logits_only=True).logits, params, rows(mesh, (batch, length))
    )
    return report(compiled, s)


def decode_plan(cfg, mesh, rules, batch, slots) -> dict:
    module, params = Decoder(cfg, dtype=jnp.bfloat16), param_specs(cfg, mesh, rules)
    batch_axes = S.batch_spec(mesh)[0]
    heads = "tensor" if S.resolve_rules(rules).get("kv_heads") == "tensor" else None
    kv = lambda shape: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(None, batch_axes, heads, None, None))
    )
    cache = KVCache(
        k=kv((cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, slots)),
        v=kv((cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim)),
        mask=rows(mesh, (batch, slots)),
        index=jax.ShapeDtypeStruct((), jnp.int32),
        pos=rows(mesh, (batch,)),
    )

    def step(p, tok, c):
        out = module.apply({"params": p}, tok, jnp.ones_like(tok), cache=c, step=True)
        return jnp.argmax(out.logits[:, -1], -1), out.cache

    compiled, s = compile_timed(step, params, rows(mesh, (batch, 1)), cache, donate=(2,))
    out = report(compiled, s)
    out["kv_cache_gib_total"] = 2 * math.prod(cache.k.shape) * 2 / GIB
    return out


def steer_plan(cfg, mesh, rules, batch, length, rank) -> dict:
    import optax

    from jsteer.steer import train

    module, backbone = Decoder(cfg, dtype=jnp.bfloat16), param_specs(cfg, mesh, rules)
    tc = train.TrainConfig(rank=rank)
    rep = NamedSharding(mesh, P())
    steer = jax.eval_shape(lambda: train.init_params(tc, cfg.hidden_size, cfg.vocab_size))
    steer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=rep), steer)
    opt = optax.adam(tc.lr)
    opt_state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), jax.eval_shape(opt.init, steer)
    )
    loss = train.forward_loss_fn(lambda p, i, m: module.apply({"params": p}, i, m).hidden, tc)
    frozen = {"embedding": backbone["embed"]["embedding"], "backbone": backbone}
    data = {
        "ids": rows(mesh, (batch, length)),
        "mask": rows(mesh, (batch, length)),
        "values": rows(mesh, (batch, 1), jnp.float32),
    }

    def step(tr, st, fr, b):
        (value, _), grads = jax.value_and_grad(lambda t: loss({**fr, "steer": t}, b), has_aux=True)(tr)
        updates, st = opt.update(grads, st, tr)
        return optax.apply_updates(tr, updates), st, value

    compiled, s = compile_timed(step, steer, opt_state, frozen, data, donate=(0, 1))
    return report(compiled, s)


def param_bytes(cfg) -> int:
    shapes = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    return sum(2 * math.prod(x.shape) for x in jax.tree.leaves(shapes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "plan_scale.json"))
    ap.add_argument("--tiny", action="store_true", help="toy shapes (the test suite's smoke run)")
    a = ap.parse_args(argv)
    assert len(jax.devices()) == 8, f"needs 8 devices, got {jax.devices()}"
    names = ["tiny"] if a.tiny else ["llama3-8b", "llama3-70b"]
    length, slots, steer_batch, steer_len, rank = (16, 32, 8, 16, 8) if a.tiny else (2048, 4096, 32, 256, 1000)
    meshes = {"tp8": (S.make_mesh(tensor=8), "tp"), "fsdp2_tp4": (S.make_mesh(fsdp=2, tensor=4), "fsdp_tp")}
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "host": platform.processor() or platform.machine(),
        "devices": 8,
        "dtype": "bfloat16",
        "scan_layers": True,
        "plans": {},
    }
    for name in names:
        cfg = config(name)
        total = param_bytes(cfg)
        for mesh_name, (mesh, rules) in meshes.items():
            key = f"{name}/{mesh_name}"
            plan = {"param_gib_total": total / GIB, "rules": rules, "mesh": dict(mesh.shape)}
            plan["forward"] = forward_plan(cfg, mesh, rules, 8, length)
            plan["decode_step"] = decode_plan(cfg, mesh, rules, 8, slots)
            if name != "llama3-70b":
                plan["steer_step"] = steer_plan(cfg, mesh, rules, steer_batch, steer_len, rank)
            ideal = total / 8  # every weight split 8 ways (norms, a tiny share, replicated)
            plan["argument_over_ideal"] = plan["decode_step"]["memory_per_device"]["argument_size_in_bytes"] / (
                ideal + plan["decode_step"]["kv_cache_gib_total"] * GIB / 8
            )
            out["plans"][key] = plan
            print(
                key,
                json.dumps(
                    {
                        k: (v["peak_per_device_gib"] if isinstance(v, dict) and "peak_per_device_gib" in v else v)
                        for k, v in plan.items()
                    }
                ),
                flush=True,
            )
    if not a.tiny:
        d70 = out["plans"]["llama3-70b/tp8"]["decode_step"]["peak_per_device_gib"]
        s8 = min(out["plans"][f"llama3-8b/{m}"]["steer_step"]["peak_per_device_gib"] for m in meshes)
        out["targets"] = {
            "decode_70b_gib": d70,
            "decode_70b_fits_80gib": d70 <= 80,
            "steer_8b_gib": s8,
            "steer_8b_fits_16gib": s8 <= 16,
            "argument_over_ideal_max": max(p["argument_over_ideal"] for p in out["plans"].values()),
            "argument_within_1_2x": all(p["argument_over_ideal"] <= 1.2 for p in out["plans"].values()),
        }
        print(json.dumps(out["targets"]), flush=True)
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
