"""Training engine: optimizer math vs NumPy, param groups, frozen params, sharding, bf16,
checkpoint policy, logging, bounded compilations."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.data.batching import Batcher
from jsteer.train import OptimizerConfig, Trainer, data_mesh, make_schedule, optim

# ----------------------------------------------------------------------------- helpers


class Tagger(nn.Module):
    """Tiny token tagger: embed -> dense+gelu -> dropout -> dense."""

    vocab: int = 50
    labels: int = 4

    @nn.compact
    def __call__(self, ids, train=False):
        h = nn.Embed(self.vocab, 8, name="embed")(ids)
        h = nn.gelu(nn.Dense(16, name="body")(h))
        h = nn.Dropout(0.2, deterministic=not train)(h)
        return nn.Dense(self.labels, name="head")(h)


TAGGER = Tagger()


def tagger_params():
    return TAGGER.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]


def tagger_loss(p, b, rng):
    logits = TAGGER.apply({"params": p}, b["input_ids"], train=True, rngs={"dropout": rng}).astype(jnp.float32)
    w = (b["labels"] != -100).astype(jnp.float32)
    lab = jnp.maximum(b["labels"], 0)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), lab[..., None], -1)[..., 0]
    acc = ((logits.argmax(-1) == lab) * w).sum() / w.sum()
    return (nll * w).sum() / w.sum(), {"acc": acc}


def tagger_loss_nodrop(p, b, rng):
    """Same loss without dropout: smaller programs, quicker compiles."""
    logits = TAGGER.apply({"params": p}, b["input_ids"]).astype(jnp.float32)
    w = (b["labels"] != -100).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.maximum(b["labels"], 0)[..., None], -1)[..., 0]
    return (nll * w).sum() / w.sum(), {}


def tagger_examples(n=64, seed=0, max_len=30):
    rs = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rs.integers(1, 50, int(rs.integers(2, max_len + 1))).astype(np.int32)
        out.append({"input_ids": ids, "labels": (ids % 4).astype(np.int32)})
    return out


def tagger_batches(examples, batch=8, seed=3, buckets=(32,), **kw):
    return Batcher(
        examples,
        batch,
        buckets=buckets,
        pad_values={"input_ids": 0, "labels": -100},
        seed=seed,
        process_index=0,
        process_count=1,
        **kw,
    )


GROUPS = OptimizerConfig(
    learning_rate={"body": 1e-2, "head": 5e-2, "frozen": None},
    labels=lambda path, x: {"body": "body", "head": "head"}.get(path[0], "frozen"),
    warmup_steps=2,
    schedule="cosine",
    weight_decay=0.01,
)


def run(trainer, batches, n):
    losses = []
    trainer.fit(batches, n, on_step=lambda s, m: losses.append(float(m["loss"])))
    return np.asarray(losses)


def tree_equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


# ----------------------------------------------------------------------------- schedules and AdamW vs NumPy


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedule_matches_numpy(schedule):
    cfg = OptimizerConfig(learning_rate=0.3, schedule=schedule, warmup_steps=4, end_lr_ratio=0.1)
    total, peak, end = 20, 0.3, 0.03
    sched = make_schedule(peak, cfg, total)
    for s in range(total + 3):
        if s < 4:
            want = peak * s / 4
        else:
            frac = min((s - 4) / (total - 4), 1.0)
            if schedule == "constant":
                want = peak
            elif schedule == "linear":
                want = peak + (end - peak) * frac
            else:
                want = end + (peak - end) * 0.5 * (1 + np.cos(np.pi * frac))
        assert float(sched(s)) == pytest.approx(want, rel=1e-6, abs=1e-9), (schedule, s)


def _numpy_adamw(params, grads_fn, lrs, labels, steps, *, wd, clip, b1=0.9, b2=0.999, eps=1e-8, warm, total):
    """Reference: clip by global norm, Adam with bias correction, decoupled decay on ndim>=2."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    norms = []
    for t in range(steps):
        g = grads_fn(p)
        norm = np.sqrt(sum((x**2).sum() for x in g.values()))
        norms.append(norm)
        scale = min(1.0, clip / norm)
        for k in p:
            gk = g[k] * scale
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            mh = m[k] / (1 - b1 ** (t + 1))
            vh = v[k] / (1 - b2 ** (t + 1))
            peak = lrs[labels[k]]
            lr = peak * t / warm if t < warm else peak * (1 - (t - warm) / (total - warm))
            upd = mh / (np.sqrt(vh) + eps)
            if p[k].ndim >= 2:
                upd = upd + wd * p[k]
            p[k] = p[k] - lr * upd
    return p, norms


def test_adamw_groups_clipping_frozen_match_numpy():
    rs = np.random.default_rng(0)
    x = rs.normal(size=(16, 3)).astype(np.float32)
    y = rs.normal(size=(16, 2)).astype(np.float32)
    params = {
        "w": rs.normal(size=(3, 2)).astype(np.float32),
        "b": rs.normal(size=(2,)).astype(np.float32),
        "scale": np.float32([1.5, -0.5]),  # frozen
    }

    def loss_fn(p, batch, rng):
        pred = p["scale"] * (batch["x"] @ p["w"]) + p["b"]
        return jnp.mean((pred - batch["y"]) ** 2), {}

    def np_grads(p):
        pred = params["scale"] * (x @ p["w"]) + p["b"]
        r = 2 * (pred - y) / pred.size
        return {"w": x.T @ (r * params["scale"]), "b": r.sum(0)}

    cfg = OptimizerConfig(
        learning_rate={"w": 0.1, "b": 0.02, "frozen": None},
        labels={"w": "w", "b": "b", "scale": "frozen"},
        schedule="linear",
        warmup_steps=1,
        total_steps=5,
        weight_decay=0.1,
        clip_norm=0.5,
    )
    tr = Trainer(loss_fn, params, cfg, mesh=data_mesh(jax.devices()[:1]), progress=False, log_every=1)
    norms = []
    batch = {"x": x, "y": y}
    tr.fit(iter([batch] * 4), 4, on_step=lambda s, m: norms.append(float(m["grad_norm"])))
    want, want_norms = _numpy_adamw(
        {"w": params["w"], "b": params["b"]},
        np_grads,
        {"w": 0.1, "b": 0.02},
        {"w": "w", "b": "b"},
        4,
        wd=0.1,
        clip=0.5,
        warm=1,
        total=5,
    )
    got = tr.params
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["b"], want["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    assert max(want_norms) > 0.5  # clipping was active
    np.testing.assert_array_equal(got["scale"], params["scale"])  # frozen: untouched
    # Frozen leaves carry no optimizer state: Adam moments only for w and b.
    sizes = sorted(int(np.size(l)) for l in jax.tree.leaves(tr.state.opt_state) if np.ndim(l) > 0)
    assert sizes == [2, 2, 6, 6]


def test_frozen_params_are_not_differentiated():
    @jax.custom_vjp
    def guard(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        raise AssertionError("a frozen parameter was differentiated")

    guard.defvjp(fwd, bwd)

    def loss_fn(p, b, rng):
        h = TAGGER.apply({"params": {**p, "embed": {"embedding": guard(p["embed"]["embedding"])}}}, b["input_ids"])
        return jnp.mean(h**2), {}

    params = tagger_params()
    tr = Trainer(loss_fn, params, GROUPS, mesh=data_mesh(jax.devices()[:1]), progress=False)
    tr.fit(tagger_batches(tagger_examples(16)), 2)
    assert tr.step == 2
    np.testing.assert_array_equal(tr.params["embed"]["embedding"], params["embed"]["embedding"])
    assert not tree_equal(tr.params["body"], params["body"])
    assert tr.num_trainable() == sum(np.size(x) for k in ("body", "head") for x in jax.tree.leaves(params[k]))


def test_group_label_errors_name_the_param():
    params = tagger_params()
    cfg = OptimizerConfig(learning_rate={"body": 1e-3}, labels=lambda path, x: path[0])
    with pytest.raises(ValueError, match=r"embed/embedding has group 'embed'"):
        Trainer(tagger_loss, params, cfg, mesh=data_mesh(jax.devices()[:1]), progress=False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        Trainer(
            tagger_loss,
            params,
            OptimizerConfig(learning_rate={"all": None}, labels=lambda p, x: "all"),
            mesh=data_mesh(jax.devices()[:1]),
            progress=False,
        )
    with pytest.raises(ValueError, match="precision"):
        Trainer(tagger_loss, params, GROUPS, precision="fp8", progress=False)


# ----------------------------------------------------------------------------- sharding and precision


def test_eight_devices_match_one_device():
    devices = jax.devices()
    assert len(devices) == 8, f"conftest forces 8 host devices, found {len(devices)}"
    ex = tagger_examples(64)
    n = 12
    one = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(devices[:1]), progress=False)
    eight = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(devices), progress=False)
    zero = Trainer(tagger_loss, tagger_params(), GROUPS, mesh=data_mesh(devices), progress=False, shard_opt_state=True)
    l1 = run(one, tagger_batches(ex), n)
    l8 = run(eight, tagger_batches(ex), n)
    lz = run(zero, tagger_batches(ex), n)
    assert len(l1) == n and l1[-1] < l1[0]
    np.testing.assert_allclose(l8, l1, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(lz, l1, rtol=2e-6, atol=1e-7)
    for p in (eight.params, zero.params):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, one.params)
    # The batch really is split over 8 devices and the ZeRO state over the data axis.
    assert len(eight.state.params["body"]["kernel"].sharding.device_set) == 8
    mu = zero.state.opt_state[1].inner_states["body"].inner_state[0].mu["body"]["kernel"]
    assert mu.sharding.spec[0] == "data" or mu.sharding.spec[-1] == "data"
    assert mu.addressable_shards[0].data.size == mu.size // 8


def test_bf16_compute_with_fp32_masters():
    seen = []

    def loss_fn(p, b, rng):
        seen.append((p["body"]["kernel"].dtype, p["embed"]["embedding"].dtype))
        return tagger_loss_nodrop(p, b, rng)

    ex = tagger_examples(32)
    mesh = data_mesh(jax.devices()[:1])
    f32 = Trainer(tagger_loss_nodrop, tagger_params(), GROUPS, mesh=mesh, progress=False)
    bf16 = Trainer(loss_fn, tagger_params(), GROUPS, mesh=mesh, precision="bf16", progress=False)
    l32 = run(f32, tagger_batches(ex), 8)
    l16 = run(bf16, tagger_batches(ex), 8)
    assert seen and all(d == (jnp.bfloat16, jnp.bfloat16) for d in seen)
    assert bf16.state.params["body"]["kernel"].dtype == jnp.float32  # masters stay fp32
    assert bf16.frozen["embed"]["embedding"].dtype == jnp.bfloat16  # frozen stored once in bf16
    np.testing.assert_allclose(l16, l32, rtol=3e-2)
    assert not np.array_equal(l16, l32)


# ----------------------------------------------------------------------------- compilations, logging, checkpoints


def test_compilations_bounded_over_an_epoch():
    ex = tagger_examples(120, seed=1, max_len=30)
    batches = tagger_batches(ex, batch=8, buckets=(8, 16, 32), num_epochs=1, sort_window=5)
    shapes = batches.shapes()

    def own_loss(p, b, rng):  # a fresh jitted step (no shared cache); no dropout: quick compiles
        logits = TAGGER.apply({"params": p}, b["input_ids"])
        return jnp.mean(logits**2 * b["attention_mask"][..., None]), {}

    simple = OptimizerConfig(learning_rate=1e-2, schedule="constant", clip_norm=None)
    tr = Trainer(own_loss, tagger_params(), simple, mesh=data_mesh(jax.devices()[:1]), progress=False)
    res = tr.fit(batches, 10_000)
    assert res["step"] == batches.batches_per_epoch == 15  # one full epoch, then the iterator ends
    assert tr.num_compilations == len(shapes)
    assert tr.num_compilations == 3  # every bucket used, no other shape compiled


def test_jsonl_log_eval_and_keep_last_plus_best(tmp_path):
    scores = iter([0.1, 0.9, 0.3, 0.2, 0.4, 0.5])  # best at the 2nd evaluation (step 4)

    def eval_fn(params):
        return {"score": next(scores), "norm": float(jnp.sum(params["head"]["kernel"] ** 2))}

    log = tmp_path / "log.jsonl"
    tr = Trainer(
        tagger_loss,
        tagger_params(),
        GROUPS,
        mesh=data_mesh(jax.devices()[:1]),
        progress=True,
        checkpoint_dir=tmp_path / "ckpt",
        keep=2,
        best_metric="eval/score",
        best_mode="max",
        eval_fn=eval_fn,
        eval_every=2,
        log_every=3,
        log_path=log,
    )
    res = tr.fit(tagger_batches(tagger_examples(40)), 12)
    assert res["step"] == 12 and res["eval"]["eval/score"] == 0.5
    assert tr.checkpointer.all_steps() == [4, 10, 12]
    assert tr.checkpointer.best_step() == 4
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval/score" in r]
    assert [r["step"] for r in train] == [3, 6, 9, 12]
    for r in train:
        assert {"loss", "lr", "lr/body", "lr/head", "grad_norm", "acc", "examples_per_s", "tokens_per_s"} <= set(r)
        assert r["examples_per_s"] > 0 and r["tokens_per_s"] > r["examples_per_s"]
    assert [r["step"] for r in evals] == [2, 4, 6, 8, 10, 12]
    assert train[-1]["lr/head"] == pytest.approx(float(make_schedule(5e-2, GROUPS, 12)(11)), rel=1e-5)


def test_optimizer_labels_pytree_and_partition_roundtrip():
    params = tagger_params()
    labels = jax.tree.map(lambda _: "body", params)
    labels["embed"]["embedding"] = "frozen"
    cfg = OptimizerConfig(learning_rate={"body": 1e-3, "frozen": None}, labels=labels)
    got = optim.resolve_labels(params, cfg)
    mask = optim.trainable_mask(got, cfg)
    tr, fr = optim.partition(params, mask)
    assert tr["embed"]["embedding"] is None and fr["body"]["kernel"] is None
    assert tree_equal(optim.combine(mask, tr, fr), params)


# ----------------------------------------------------------------------------- NaN guard, keep-best, tokens/s


def poisoned_batches(bad_step, n=40):
    """Plain iterator: batch ``i`` (step i + 1) is flagged ``bad`` when step == bad_step."""
    for i in range(n):
        yield {"x": np.ones((2, 3), np.float32), "bad": np.full((2,), i + 1 == bad_step)}


def nan_loss(p, b, rng):
    """Loss (and so gradient) NaN on a flagged batch."""
    loss = jnp.mean((b["x"] @ p["w"]) ** 2)
    return loss * jnp.where(b["bad"].any(), jnp.nan, 1.0), {}


@jax.custom_vjp
def poison_grad(w, bad):
    """Identity on ``w``; its gradient is NaN where ``bad``."""
    return w


poison_grad.defvjp(lambda w, bad: (w, bad), lambda bad, g: (g * jnp.where(bad, jnp.nan, 1.0), None))


def nan_grad_loss(p, b, rng):
    """Finite loss but a NaN gradient on a flagged batch."""
    return jnp.mean((b["x"] @ poison_grad(p["w"], b["bad"].any())) ** 2), {}


@pytest.mark.parametrize("loss_fn", [nan_loss, nan_grad_loss])
def test_non_finite_step_stops_before_any_checkpoint_holds_it(tmp_path, loss_fn):
    """Non-finite from step 6, logged every 10, saved every 2: the save at step 6 raises, naming
    step 6; only the finite steps 2 and 4 are on disk, and resuming gets finite params."""
    params = {"w": jnp.ones((3, 2))}
    cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant", clip_norm=None)
    kw = dict(mesh=data_mesh(jax.devices()[:1]), checkpoint_dir=tmp_path / "ckpt", progress=False)
    tr = Trainer(loss_fn, params, cfg, save_every=2, log_every=10, keep=3, **kw)
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient norm at step 6\b"):
        tr.fit(poisoned_batches(bad_step=6), 20)
    assert tr.checkpointer.all_steps() == [2, 4]
    again = Trainer(loss_fn, params, cfg, **kw)
    assert again.restore() and again.step == 4
    assert np.isfinite(np.asarray(again.state.params["w"])).all()


@pytest.mark.parametrize("fold, where", [(256, r"at step 3\b"), (4, r"at one of steps 1\.\.4\b")])
def test_non_finite_step_between_log_lines_is_caught_at_the_next_log_line(monkeypatch, fold, where):
    """No checkpoints: the step-3 NaN is found at the step-5 log line, named by its own step (or
    by the range of steps whose flags were folded into one after ``fold`` unchecked steps)."""
    monkeypatch.setattr("jsteer.train.loop._FINITE_FOLD", fold)
    tr = Trainer(
        nan_grad_loss,
        {"w": jnp.ones((3, 2))},
        OptimizerConfig(learning_rate=1e-2),
        mesh=data_mesh(jax.devices()[:1]),
        log_every=5,
        progress=False,
    )
    steps = []
    with pytest.raises(FloatingPointError, match=where):
        tr.fit(poisoned_batches(bad_step=3), 20, on_step=lambda s, m: steps.append(s))
    assert steps[-1] == 5


def test_keep_best_saves_every_evaluation_step(tmp_path):
    """eval_every=3 and save_every=2 never line up before the end: the best evaluation (step 3)
    is still checkpointed and kept beside the latest."""
    scores = iter([0.9, 0.1, 0.2, 0.3])

    def batches():
        while True:
            yield {"x": np.ones((2, 3), np.float32)}

    tr = Trainer(
        lambda p, b, r: (jnp.mean((b["x"] @ p["w"]) ** 2), {}),
        {"w": jnp.ones((3, 1))},
        OptimizerConfig(learning_rate=1e-3),
        mesh=data_mesh(jax.devices()[:1]),
        progress=False,
        checkpoint_dir=tmp_path / "ckpt",
        keep=1,
        best_metric="eval/s",
        best_mode="max",
        eval_fn=lambda p: {"s": next(scores)},
        eval_every=3,
        save_every=2,
    )
    tr.fit(batches(), 12)
    assert tr.checkpointer.all_steps() == [3, 12]
    assert tr.checkpointer.best_step() == 3
    assert tr.checkpointer.metrics(3)["eval/s"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    "fields, aux_tokens, want",
    [
        ({"ids", "mask"}, True, 2 * 4),  # KALM: aux["tokens"] = the predicted positions mask[:, 1:]
        ({"ids", "mask"}, False, 2 * 5),  # sum of "mask"
        ({"ids"}, False, 2 * 6),  # size of "ids"
        ({"input_ids", "attention_mask"}, False, 2 * 5),
    ],
)
def test_tokens_per_s_counts_aux_tokens_or_known_fields(tmp_path, fields, aux_tokens, want):
    """Rows of 6 ids with 5 real positions; tokens_per_s * interval_s is the step's token count."""
    mask = np.array([[1, 1, 1, 1, 1, 0]] * 2, np.int32)
    batch = {
        "ids": np.ones((2, 6), np.int32),
        "mask": mask,
        "input_ids": np.ones((2, 6), np.int32),
        "attention_mask": mask,
    }
    batch = {k: v for k, v in batch.items() if k in fields}

    def loss_fn(p, b, rng):
        loss = jnp.sum(p["w"] ** 2)
        if not aux_tokens:
            return loss, {}
        return loss, {"tokens": b["mask"][:, 1:].astype(jnp.float32).sum()}

    log = tmp_path / "log.jsonl"
    tr = Trainer(
        loss_fn,
        {"w": jnp.ones((2,))},
        OptimizerConfig(learning_rate=1e-3),
        mesh=data_mesh(jax.devices()[:1]),
        progress=False,
        log_path=log,
        log_every=1,
    )
    tr.fit(iter([batch] * 3), 3)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 3
    for r in recs:
        assert r["tokens_per_s"] * r["interval_s"] == pytest.approx(want, rel=1e-6)
