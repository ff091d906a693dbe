"""Forward-mode autodiff through a bf16 decoder on the device's attention (issue #36).

    python experiments/gpu_jvp_check.py --out F.json

On a GPU, bf16 attention runs cuDNN's kernel (a custom VJP) under ``jax.grad``; ``jax.jvp`` must
take the portable path by itself, and around an already-jitted call inside ``jsteer.forward_mode()``.
Records whether each program holds cuDNN calls and the jvp's tangent against grad . direction.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jsteer
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.hooks import Hooks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg = DecoderConfig.llama(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2
    )
    module = Decoder(cfg, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 128)), jnp.int32)
    params = jax.jit(module.init)(jax.random.key(0), ids)["params"]
    d = jnp.asarray(np.random.default_rng(1).normal(size=(2, 128, 128)), jnp.float32)

    def logit(o, apply=module.apply):
        return apply({"params": params}, ids, hooks=Hooks(embed_offset=o)).logits[:, -1, 3].sum()

    def kernels(fn, *args):
        return str(jax.make_jaxpr(fn)(*args)).count("dot_product_attention_fwd")

    zero = jnp.zeros_like(d)
    res = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    res["cudnn_calls"] = {"forward": kernels(logit, zero), "grad": kernels(jax.grad(logit), zero)}
    grad = jax.jit(jax.grad(logit))(zero)
    want = float(jnp.vdot(grad, d))
    jitted = jax.jit(module.apply)
    runs = {
        "jvp": lambda o: jax.jvp(logit, (o,), (d,))[1],
        "jvp_of_jitted_in_forward_mode": lambda o: jax.jvp(lambda o: logit(o, jitted), (o,), (d,))[1],
    }
    for name, fn in runs.items():
        try:
            with jsteer.forward_mode() if "forward_mode" in name else contextlib.nullcontext():
                res["cudnn_calls"][name] = kernels(fn, zero)
                got = float(jax.jit(fn)(zero))
            res[name] = {"tangent": got, "grad_dot_direction": want, "rel_err": abs(got - want) / max(abs(want), 1e-9)}
        except Exception as e:  # noqa: BLE001 - recorded: the point of the check
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, res[name], flush=True)
    print(json.dumps(res["cudnn_calls"]))
    pathlib.Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
