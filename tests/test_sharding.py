"""Methods and models on 8 host devices (conftest forces them): LM-Steer, KALA and KALM train
steps on a 2 x 4 (fsdp x tensor) mesh match one device; an LM loads into shards and checkpoints;
tensor parallelism splits the bytes; bad meshes are refused by name. Each backbone family on a
mesh: tests/test_sharding_families.py.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoder_families import FAMILIES, _tokenizer, hf_model, left_padded

import jsteer
from jsteer import sharding as S
from jsteer.backbones import bert, families
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_params import logical_axes
from jsteer.train import OptimizerConfig, Trainer, data_mesh

V = 96  # divisible by tensor=4 (vocabulary-parallel embedding and logits)
MESHES = {"2x4": dict(fsdp=2, tensor=4), "8x1": dict(fsdp=8, tensor=1)}


def _config(name):
    cls, _, kw = FAMILIES[name]
    kw = dict(kw, vocab_size=V)
    if "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = 4  # kv heads divisible by tensor=4
    import transformers

    return families.config_from_hf(getattr(transformers, cls)(**kw).to_dict())


def random_params(shapes, seed=0):
    """Params of the init's tree drawn on the host: norm scales 1 + N(0, 0.05), every other leaf
    N(0, 0.05) (biases and norm offsets non-zero, so a misplaced shard of any leaf shows). A jitted
    Flax init compiles one random fusion per leaf, ~5 s per family on XLA:CPU."""
    rng = np.random.default_rng(seed)

    def draw(path, s):
        x = 0.05 * rng.standard_normal(s.shape) + (jax.tree_util.keystr(path).endswith("['scale']"))
        return x.astype(s.dtype)  # on the host: placing it on a mesh slices it there, no program compiled

    return jax.tree_util.tree_map_with_path(draw, shapes)


def test_tensor_parallel_splits_the_parameter_bytes():
    cfg = _config("llama3.2-tied")
    params = random_params(
        jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    placed = S.shard(params, logical_axes(params), S.make_mesh(data=2, tensor=4), "tp")
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    norms = sum(x.nbytes for x in jax.tree.leaves(params) if x.ndim == 1)  # replicated, small
    per_device = S.bytes_per_device(placed)
    assert len(per_device) == 8
    assert max(per_device.values()) <= (total - norms) / 4 + norms, (per_device, total, norms)


def test_a_mesh_that_cannot_divide_a_weight_is_refused_by_name():
    cfg = dataclasses.replace(_config("llama3.2-tied"), num_heads=9, num_kv_heads=3, head_dim=8)
    shapes = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    with pytest.raises(
        ValueError,
        match=r"param layers_0/attn/[qo]/kernel \(shape .*\): its 'heads' "
        r"dimension \(9\) does not divide over mesh axis 'tensor' of size 4",
    ):
        S.shardings(shapes, logical_axes(shapes), S.make_mesh(fsdp=2, tensor=4), {"heads": "tensor"})
    with pytest.raises(ValueError, match="unknown sharding rules 'zero3'"):
        S.resolve_rules("zero3")
    with pytest.raises(ValueError, match="not a multiple"):
        S.make_mesh(fsdp=3)


def test_lm_loads_into_shards_and_checkpoints_round_trip(tmp_path):
    """jsteer.load(mesh=, rules=) places each tensor into its shard; forward / generate run on
    the mesh; a checkpoint saved from sharded arrays loads back (scanned or not)."""
    hf = hf_model(
        "LlamaConfig", "LlamaForCausalLM", dict(FAMILIES["llama3.2-tied"][2], vocab_size=100, num_key_value_heads=4)
    )
    hf.save_pretrained(tmp_path / "m")
    _tokenizer(tmp_path / "m")
    base = jsteer.load(tmp_path / "m")
    mesh = S.make_mesh(fsdp=2, tensor=4)
    ids, mask = left_padded(batch=3)
    ref = np.asarray(base.forward(ids, mask).logits)
    prompts = ["w3 w4 w5", "w9"]
    want = base.generate(prompts, max_new_tokens=6)
    for scan in (False, True):
        lm = jsteer.load(tmp_path / "m", mesh=mesh, rules="fsdp_tp", scan_layers=scan)
        emb = lm.params["embed"]["embedding"]
        assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
        assert lm.identity == base.identity and lm.mesh is mesh
        assert np.abs(np.asarray(lm.forward(ids, mask).logits) - ref)[mask > 0].max() <= 1e-5
        assert lm.generate(prompts, max_new_tokens=6) == want
        with pytest.raises(ValueError, match="sharded over its own mesh"):
            lm.forward(ids, mask, mesh=data_mesh())
        ck = jsteer.save(lm, tmp_path / f"ck{scan}")
        back = jsteer.load(ck, mesh=mesh, scan_layers=not scan)
        assert np.abs(np.asarray(back.forward(ids, mask).logits) - ref)[mask > 0].max() <= 1e-5


def _train_two_steps(loss_fn, params, batch, mesh, rules):
    opt = OptimizerConfig(
        learning_rate={"train": 1e-2, "frozen": None},
        labels=lambda path, leaf: "train" if path[0] in ("steer", "kala", "head") else "frozen",
        schedule="constant",
        clip_norm=1.0,
    )
    trainer = Trainer(loss_fn, params, opt, mesh=mesh, rules=rules, axes="auto" if rules else None, progress=False)
    losses = [float(trainer.train_step(batch, 2)["loss"]) for _ in range(2)]
    return losses, jax.tree.map(np.asarray, trainer.params)


def test_lm_steer_train_step_on_a_2x4_mesh_matches_one_device():
    from jsteer.steer import head, train

    cfg = _config("llama3.2-tied")
    module = Decoder(cfg)
    backbone = random_params(jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
    tc = train.TrainConfig(rank=4, batch_size=8)
    params = {
        "steer": train.init_params(tc, cfg.hidden_size, V),
        "embedding": backbone["embed"]["embedding"],
        "backbone": backbone,
    }
    loss_fn = train.forward_loss_fn(lambda p, i, m: module.apply({"params": p}, i, m).hidden, tc)
    rng = np.random.default_rng(0)
    batch = {
        "ids": rng.integers(3, V, (8, 10)).astype(np.int32),
        "mask": np.ones((8, 10), np.int32),
        "values": np.where(np.arange(8)[:, None] % 2, 1.0, -1.0).astype(np.float32),
    }
    one = _train_two_steps(loss_fn, params, batch, data_mesh(jax.devices()[:1]), None)
    two = _train_two_steps(loss_fn, params, batch, S.make_mesh(fsdp=2, tensor=4), "fsdp_tp")
    np.testing.assert_allclose(two[0], one[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(two[1]["steer"]), jax.tree.leaves(one[1]["steer"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert head.l2(two[1]["steer"]) > 0


def test_kala_train_step_on_a_2x4_mesh_matches_one_device():
    from test_kala_e2e import encoded_task

    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig, KalaModel, init_params

    task, vocab, rels, train_set, _ = encoded_task(0, 16, 4)
    cfg = bert.BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = KalaModel(
        cfg,
        KalaConfig(method="relational", num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
        num_labels=5,
    )
    params = init_params(model, jax.random.PRNGKey(0))
    tc = ktrain.TrainConfig(lr=1e-3, kala_lr=1e-3, batch_size=8, max_steps=2)
    rules = {**S.PRESETS["fsdp_tp"], "vocab": None}  # the task's vocabulary does not divide by 4
    one = ktrain.fit(model, params, train_set, tc)
    two = ktrain.fit(model, params, train_set, tc, mesh=S.make_mesh(fsdp=2, tensor=4), rules=rules)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_kalm_training_on_a_2x4_mesh_matches_one_device():
    from jsteer.kalm import train as ktrain
    from jsteer.kalm.head import TypedVocab

    vocab = TypedVocab.build(24, [[3, 4, 5], [5, 6], [9, 10]])
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 24, (16, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    model = ktrain.make_model("kalm", ktrain.tiny_llama(24, hidden=32, layers=2, heads=4, max_len=16), vocab, 8)
    params = random_params(jax.eval_shape(lambda r: ktrain.init_params(model, r, vocab), jax.random.PRNGKey(0)))
    cfg = ktrain.LMTrainConfig(batch_size=8, steps=3, warmup_steps=1)
    rules = {**S.PRESETS["fsdp_tp"], "vocab": None}  # 24 words: the vocabulary stays whole
    one, a = ktrain.train(model, params, ids, mask, vocab, cfg, mesh=data_mesh(jax.devices()[:1]))
    two, b = ktrain.train(model, params, ids, mask, vocab, cfg, mesh=S.make_mesh(fsdp=2, tensor=4), rules=rules)
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(two), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    sharded = [x for x in jax.tree.leaves(two) if not x.sharding.is_fully_replicated]
    assert sharded, "fsdp_tp left every KALM parameter replicated"


def test_plan_scale_runs_on_toy_shapes(tmp_path):
    """experiments/plan_scale.py (the 8B / 70B memory plans) on toy shapes, so it stays runnable."""
    import json
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    script = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "plan_scale.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--tiny", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans = json.loads(out.read_text())["plans"]
    assert set(plans) == {"tiny/tp8", "tiny/fsdp2_tp4"}
    for plan in plans.values():
        assert {"forward", "decode_step", "steer_step"} <= set(plan) and plan["argument_over_ideal"] < 1.2
        assert plan["decode_step"]["memory_per_device"]["argument_size_in_bytes"] > 0
