"""Exact resume: stop / crash / SIGTERM a run, resume, and get bit-identical params on CPU."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np

from jsteer.data.batching import Batcher
from jsteer.train import OptimizerConfig, Trainer, data_mesh

HERE = pathlib.Path(__file__).resolve().parent
N_STEPS = 16


def make_problem():
    """Model, params, loss, batch iterator factory and optimizer config shared with the child process."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids, train=False):
            h = nn.Embed(40, 8, name="embed")(ids)
            h = nn.Dropout(0.3, deterministic=not train)(nn.tanh(nn.Dense(12, name="body")(h)))
            return nn.Dense(3, name="head")(h)

    net = Net()
    params = net.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]

    def loss_fn(p, b, rng):
        logits = net.apply({"params": p}, b["input_ids"], train=True, rngs={"dropout": rng})
        w = b["attention_mask"].astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["labels"][..., None], -1)[..., 0]
        return (nll * w).sum() / w.sum(), {}

    rs = np.random.default_rng(7)
    examples = []
    for _ in range(37):
        ids = rs.integers(1, 40, int(rs.integers(2, 20))).astype(np.int32)
        examples.append({"input_ids": ids, "labels": (ids % 3).astype(np.int32)})

    def batches():
        return Batcher(
            examples,
            4,
            buckets=(32,),
            pad_values={"input_ids": 0, "labels": 0},
            seed=5,
            sort_window=2,
            process_index=0,
            process_count=1,
        )

    cfg = OptimizerConfig(
        learning_rate={"body": 3e-2, "head": 1e-1, "frozen": None},
        labels=lambda path, x: {"body": "body", "head": "head"}.get(path[0], "frozen"),
        warmup_steps=3,
        schedule="linear",
        weight_decay=0.05,
    )
    return params, loss_fn, batches, cfg


def trainer(ckpt=None, **kw):
    params, loss_fn, _, cfg = make_problem.cached
    return Trainer(loss_fn, params, cfg, mesh=data_mesh(jax.devices()[:2]), progress=False, checkpoint_dir=ckpt, **kw)


make_problem.cached = make_problem()


def reference():
    if not hasattr(reference, "result"):
        t = trainer()
        t.fit(make_problem.cached[2](), N_STEPS)
        reference.result = (jax.device_get(t.params), jax.device_get(t.state.opt_state))
    return reference.result


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_stop_and_resume_is_bit_exact(tmp_path):
    batches = make_problem.cached[2]
    t1 = trainer(tmp_path, save_every=4, exit_on_preempt=False)
    res = t1.fit(batches(), N_STEPS, on_step=lambda s, m: t1.request_stop() if s == 7 else None)
    assert res["preempted"] and res["step"] == 7
    assert t1.checkpointer.all_steps() == [4, 7]  # the stop itself saved step 7
    t2 = trainer(tmp_path, save_every=4)
    res2 = t2.fit(batches(), N_STEPS)
    assert res2["step"] == N_STEPS and not res2["preempted"]
    params, opt_state = reference()
    assert_bit_equal(t2.params, params)
    assert_bit_equal(t2.state.opt_state, opt_state)


def test_crash_without_final_save_resumes_from_last_checkpoint(tmp_path):
    batches = make_problem.cached[2]
    t1 = trainer(tmp_path, save_every=5)
    # "Crash" after step 9: train without the loop's final save, then drop the trainer.
    it = batches()
    for _ in range(9):
        t1.train_step(next(it), N_STEPS)
        if t1.step % 5 == 0:
            t1.save(it)
    t1.checkpointer.wait()
    del t1
    t2 = trainer(tmp_path, save_every=5)
    it2 = batches()
    t2.restore(it2)
    assert t2.step == 5 and it2.state()["index"] == 5 % it2.batches_per_epoch
    t2.fit(it2, N_STEPS, resume=False)
    assert_bit_equal(t2.params, reference()[0])


CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {here!r})
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import test_train_resume as T
    t = T.trainer({ckpt!r}, save_every=100)

    def on_step(step, metrics):
        print("step", step, flush=True)
        if step >= 2:
            time.sleep(0.3)

    t.fit(T.make_problem.cached[2](), T.N_STEPS, on_step=on_step)
    print("finished without SIGTERM", flush=True)
    """
)


def test_sigterm_saves_and_exits_then_resume_is_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    code = CHILD.format(here=str(HERE), ckpt=str(ckpt))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    seen = []
    for line in proc.stdout:
        seen.append(line.strip())
        if line.startswith("step 3"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    seen += out.splitlines()
    assert proc.returncode == 143, (proc.returncode, seen, err[-3000:])
    assert "finished without SIGTERM" not in seen
    t = trainer(ckpt)
    stopped_at = t.checkpointer.latest_step()
    assert 3 <= stopped_at < N_STEPS
    t.fit(make_problem.cached[2](), N_STEPS)
    assert t.step == N_STEPS
    assert_bit_equal(t.params, reference()[0])


def test_resume_without_a_data_position_warns_raises_or_is_allowed(tmp_path):
    """A plain generator (no state()) leaves no data position in its checkpoints: resuming
    restarts it, which warns by default, is refused with "raise" and is silent with "allow";
    a finished run or a Batcher-written checkpoint resumes without a word."""
    import warnings

    import jax.numpy as jnp
    import pytest

    def gen():
        i = 0
        while True:
            yield {"x": np.full((2, 3), i, np.float32)}
            i += 1

    def make(ckpt=tmp_path / "gen"):
        return Trainer(
            lambda p, b, r: (jnp.mean((b["x"] @ p["w"]) ** 2) * 1e-3, {}),
            {"w": jnp.ones((3, 1))},
            OptimizerConfig(learning_rate=1e-3),
            mesh=data_mesh(jax.devices()[:1]),
            progress=False,
            checkpoint_dir=ckpt,
            exit_on_preempt=False,
            log_path=tmp_path / "log.jsonl",
        )

    t = make()
    t.fit(gen(), 6, on_step=lambda s, m: t.request_stop() if s == 3 else None)
    assert t.checkpointer.all_steps() == [3]
    with pytest.raises(ValueError, match=r"checkpoint at step 3 .* holds no data position"):
        make().fit(gen(), 6, nonresumable_data="raise")
    assert make().checkpointer.all_steps() == [3]  # refused before any step
    with pytest.warns(RuntimeWarning, match="holds no data position.*replay"):
        assert make().fit(gen(), 6)["step"] == 6
    assert "holds no data position" in (tmp_path / "log.jsonl").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make().fit(gen(), 8, nonresumable_data="allow")
        assert make().fit(gen(), 8, nonresumable_data="raise")["step"] == 8  # finished: nothing replayed
        batches = make_problem.cached[2]
        t1 = trainer(tmp_path / "batcher", save_every=2)
        t1.fit(batches(), 2)
        trainer(tmp_path / "batcher").fit(batches(), 3, nonresumable_data="raise")
    with pytest.raises(ValueError, match="nonresumable_data must be one of"):
        make().fit(gen(), 8, nonresumable_data="ignore")
