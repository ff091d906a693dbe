"""Training across processes (the multi-host path), joined by jax.distributed: two processes
with two host devices each train data-parallel to the single-device loss curve and params; two
with four devices each run a decoder sharded FSDP-style over all eight (a forward and one train
step) and match one process."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from test_train import GROUPS, run, tagger_batches, tagger_examples, tagger_loss, tagger_params

from jsteer.train import Trainer, data_mesh

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path, mode: str) -> list:
    port = _free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    env = {**os.environ, "STEPS": str(STEPS), "JAX_PLATFORMS": "cpu", "MODE": mode}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), "2", str(port), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired as e:
            for q in procs:
                q.kill()
            raise AssertionError("multi-process training timed out") from e
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, f"worker failed:\n{log[-3000:]}"
    return [json.loads(o.read_text()) for o in outs]


def test_two_processes_match_one_device(tmp_path):
    got = _run_workers(tmp_path, "data")
    assert [g["devices"] for g in got] == [4, 4]

    one = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(jax.devices()[:1]), progress=False)
    ref = run(one, tagger_batches(tagger_examples(64)), STEPS)
    assert ref[-1] < ref[0]
    for g in got:  # every process sees the global loss
        np.testing.assert_allclose(g["losses"], ref, rtol=2e-6, atol=1e-7)
    ref_params = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(one.params)[0]
    }
    assert set(got[0]["params"]) == set(ref_params)
    for name, want in ref_params.items():
        for g in got:
            np.testing.assert_allclose(np.asarray(g["params"][name]), want, rtol=1e-5, atol=1e-6, err_msg=name)


def fsdp_model():
    """A small decoder whose every weight splits 8 ways on its embed axis (the worker imports it)."""
    from jsteer.backbones.decoder import Decoder
    from jsteer.backbones.decoder_config import DecoderConfig

    module = Decoder(
        DecoderConfig.llama(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=4
        )
    )
    import jax.numpy as jnp

    return module, jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]


# Adam's first step is lr * g / (|g| + eps): with the default eps (1e-8) a gradient near zero turns
# the sharded reduction's fp32 rounding into an update difference of order lr (a Zen 5 VM: 1.5e-5 at
# one of 2048 elements); eps 1e-3 keeps the update a smooth function of the gradient.
FSDP_OPTIMIZER = dict(learning_rate=1e-2, eps=1e-3)


def fsdp_batch() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 64, (8, 12)).astype(np.int32)


def fsdp_loss(module):
    import jax.numpy as jnp

    def loss(p, b, rng):
        logits = module.apply({"params": p}, b["ids"]).logits[:, :-1]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["ids"][:, 1:, None], -1)
        return nll.mean(), {}

    return loss


def test_two_processes_shard_a_decoder_fsdp_like_one_process(tmp_path):
    from jsteer.train import OptimizerConfig

    got = _run_workers(tmp_path, "fsdp")
    assert [g["devices"] for g in got] == [8, 8]
    module, params = fsdp_model()
    ids = fsdp_batch()
    ref_logits = np.asarray(module.apply({"params": params}, ids).logits)
    one = Trainer(
        fsdp_loss(module),
        params,
        OptimizerConfig(**FSDP_OPTIMIZER),
        mesh=data_mesh(jax.devices()[:1]),
        progress=False,
    )
    ref_loss = float(one.train_step({"ids": ids}, 1)["loss"])
    ref_params = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(one.params)[0]
    }
    for g in got:
        np.testing.assert_allclose(np.asarray(g["logits"]), ref_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g["loss"], ref_loss, rtol=1e-6)
        for name, want in ref_params.items():  # each moved by up to lr, smoothly in g (FSDP_OPTIMIZER)
            np.testing.assert_allclose(np.asarray(g["params"][name]), want, rtol=1e-5, atol=1e-5, err_msg=name)
