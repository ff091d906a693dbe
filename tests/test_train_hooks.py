"""Trainer hooks: every N steps and at the end, early stopping with its checkpoint, step times,
the ahead-of-time compiled step, and the logistic probe."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.train import EarlyStopping, Hook, OptimizerConfig, Trainer, data_mesh
from jsteer.train.probe import fit_logistic

ONE = data_mesh(jax.devices()[:1])


def quadratic(p, b, rng):
    return jnp.mean((b["x"] @ p["w"] - 1.0) ** 2), {}


def batches():
    while True:
        yield {"x": np.ones((2, 3), np.float32)}


def make(**kw):
    kw = {"mesh": ONE, "progress": False, **kw}
    return Trainer(quadratic, {"w": jnp.zeros((3, 1))}, OptimizerConfig(learning_rate=1e-2), **kw)


def test_hooks_fire_every_n_and_once_at_the_end():
    tr = make()
    seen = {"every3": [], "every5": [], "no_end": [], "decorated": [], "every1": []}
    tr.add_hook(lambda info: seen["every3"].append(info.step), every=3)
    tr.add_hook(lambda info: seen["every5"].append(info.step), every=5)  # 10 divides by 5: still once at 10
    tr.add_hook(lambda info: seen["no_end"].append(info.step), every=4, at_end=False)
    tr.add_hook(lambda info: seen["every1"].append((info.step, info.final, round(info.loss, 6))))

    @tr.add_hook(every=None)
    def only_at_end(info):
        seen["decorated"].append((info.step, info.final, info.num_steps))

    assert only_at_end is not None  # the decorator returns the function
    res = tr.fit(batches(), 10)
    assert res["step"] == 10 and not res["preempted"]
    assert seen["every3"] == [3, 6, 9, 10]
    assert seen["every5"] == [5, 10]
    assert seen["no_end"] == [4, 8]
    assert seen["decorated"] == [(10, True, 10)]
    assert [s for s, _, _ in seen["every1"]] == list(range(1, 11))
    assert [f for _, f, _ in seen["every1"]] == [False] * 9 + [True]
    assert seen["every1"][-1][2] < seen["every1"][0][2]  # info.loss: it trained
    with pytest.raises(ValueError, match="every must be >= 1"):
        tr.add_hook(lambda info: None, every=0)


def test_a_stop_is_the_end_and_is_checkpointed(tmp_path):
    """request_stop() in a hook at step 7: the end hooks fire at 7, the stop saves step 7."""
    tr = make(checkpoint_dir=tmp_path / "ckpt", save_every=4)
    ends = []
    tr.add_hook(lambda info: info.trainer.request_stop("test") if info.step == 7 else None)
    tr.add_hook(lambda info: ends.append((info.step, info.stopping)), every=None)
    res = tr.fit(batches(), 20)
    assert res["step"] == 7 and res["preempted"] and not res["early_stopped"]
    assert ends == [(7, True)]
    assert tr.checkpointer.all_steps() == [4, 7]


def test_early_stopping_stops_at_the_patience_step_and_keeps_best(tmp_path):
    """Scores at steps 2, 4, 6, ...: best 0.9 at step 4, then 2 evaluations without a better
    one (patience 2): the run stops at step 8, saving it, and keeps step 4 as the best."""
    scores = iter([0.5, 0.9, 0.8, 0.85, 0.95, 0.99])
    log = tmp_path / "log.jsonl"
    tr = make(
        checkpoint_dir=tmp_path / "ckpt",
        keep=1,
        eval_fn=lambda p: {"acc": next(scores)},
        eval_every=2,
        best_metric="eval/acc",
        best_mode="max",
        patience=2,
        log_path=log,
    )
    res = tr.fit(batches(), 20)
    assert res["step"] == 8 and res["early_stopped"] and not res["preempted"]
    assert res["eval"] == {"eval/acc": 0.85}
    assert tr.step == 8
    assert tr.checkpointer.latest_step() == 8 and tr.checkpointer.best_step() == 4
    assert tr.checkpointer.all_steps() == [4, 8]
    events = [r["event"] for r in map(json.loads, log.read_text().splitlines()) if "event" in r]
    assert events[0].startswith("early stop: eval/acc not improved for 2 evaluations (best 0.9 at step 4)")
    assert "stopped (early stop); checkpoint saved" in events[1]
    with pytest.raises(ValueError, match="needs a best_metric"):
        make(patience=2)


def test_early_stopping_hook_min_delta_and_min_mode():
    stop = EarlyStopping("eval/loss", patience=1, mode="min", min_delta=0.1)
    losses = iter([1.0, 0.95, 0.5])  # 0.95 is no improvement by more than 0.1: stop at the 2nd evaluation
    tr = make(eval_fn=lambda p: {"loss": next(losses)}, eval_every=3)
    tr.add_hook(stop)
    res = tr.fit(batches(), 30)
    assert res["step"] == 6 and res["early_stopped"]
    assert (stop.best, stop.best_step) == (1.0, 3)


def test_step_times_are_recorded():
    tr = make(sync_steps=True)
    durations = []
    tr.add_hook(lambda info: durations.append(info.step_duration))
    tr.fit(batches(), 6)
    assert len(tr.step_times) == 6 and tr.step_times == durations
    assert all(t > 0 for t in tr.step_times)
    tr.fit(batches(), 9)  # a second fit records its own steps
    assert len(tr.step_times) == 3


def test_custom_hook_class_chooses_its_steps():
    class OddSteps(Hook):
        def __init__(self):
            self.steps = []

        def fires(self, info):
            return info.step % 2 == 1

        def __call__(self, info):
            self.steps.append(info.step)

    tr = make()
    odd = tr.add_hook(OddSteps())
    tr.fit(batches(), 6)
    assert odd.steps == [1, 3, 5]


def test_compiled_step_is_the_trainers_step():
    tr = make()
    batch = {"x": np.ones((2, 3), np.float32)}
    compiled = tr.compile_step(batch, 10)
    assert tr.step_memory_bytes(batch, 10) > 0
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.argument_size_in_bytes > 0
    state, metrics = compiled(tr.state, tr.frozen, {"x": jnp.ones((2, 3))})
    ref = make()
    want = ref.train_step(batch, 10)
    np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(want["loss"]))
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(ref.state.params["w"]))


def test_logistic_probe_separates_and_vmaps():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype(np.float32) * np.array([3, 1, 1, 1, 1], np.float32) + 2.0
    y = (x[:, 0] - 2.0 > 0).astype(np.int32)
    probe = fit_logistic(x, y)
    assert float(np.mean((np.asarray(probe.prob(x)) > 0.5) == y)) > 0.95
    w, b = probe.direction()
    np.testing.assert_allclose(np.asarray(x @ w + b), np.asarray(probe.logits(x)), rtol=1e-4, atol=1e-4)
    assert abs(float(w[0])) > 5 * float(np.max(np.abs(np.asarray(w[1:]))))
    stacked = jax.vmap(lambda xx: fit_logistic(xx, y))(jnp.stack([x, -x]))
    np.testing.assert_allclose(np.asarray(stacked.w[0]), np.asarray(probe.w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stacked.w[1]), -np.asarray(probe.w), rtol=1e-5, atol=1e-6)
