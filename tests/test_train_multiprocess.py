"""Data-parallel training across processes (the multi-host path): two processes with two
host devices each, joined by jax.distributed, give the single-device loss curve and params."""

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


def test_two_processes_match_one_device(tmp_path):
    port = _free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    env = {**os.environ, "STEPS": str(STEPS), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port), str(outs[i])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("multi-process training timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed:\n{log[-3000:]}"
    got = [json.loads(o.read_text()) for o in outs]
    assert [g["devices"] for g in got] == [4, 4]

    one = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(jax.devices()[:1]), progress=False)
    ref = run(one, tagger_batches(tagger_examples(64)), STEPS)
    assert ref[-1] < ref[0]
    for g in got:  # every process sees the global loss
        np.testing.assert_allclose(g["losses"], ref, rtol=2e-6, atol=1e-7)
    ref_params = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
                  for path, x in jax.tree_util.tree_flatten_with_path(one.params)[0]}
    assert set(got[0]["params"]) == set(ref_params)
    for name, want in ref_params.items():
        for g in got:
            np.testing.assert_allclose(np.asarray(g["params"][name]), want, rtol=1e-5, atol=1e-6, err_msg=name)
