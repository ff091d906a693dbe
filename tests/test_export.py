"""Every public jitted entry point lowers for GPUs and TPUs on this CPU-only machine
(``jax.export`` with platforms=("cuda", "tpu")), and no CPU-only custom call (the AVX-512 decode
kernel) reaches those programs: forward, generate, the LM-Steer, KALA and KALM train steps and the
type-vector probe batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones import cpu
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.decode import generate
from jsteer.train import OptimizerConfig, Trainer, data_mesh

PLATFORMS = ("cuda", "tpu")
CFG = DecoderConfig.llama(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # a multiple of 16: the CPU program's prefill has cpu.block_attention to refuse
    tie_word_embeddings=True,
)


def _spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=getattr(x, "sharding", None))


def export_text(fn, *args) -> str:
    """The StableHLO of ``fn`` exported for PLATFORMS; fails on an op those platforms lack."""
    exp = jax.export.export(fn if hasattr(fn, "lower") else jax.jit(fn), platforms=PLATFORMS)(
        *jax.tree.map(_spec, args)
    )
    assert exp.platforms == PLATFORMS
    text = exp.mlir_module()
    for target in cpu.TARGETS:
        assert target not in text, f"the CPU-only decode kernel {target} reached an accelerator program"
    assert "custom_call" not in text or all(
        "Sharding" in line or "SPMD" in line for line in text.splitlines() if "custom_call" in line
    ), [line for line in text.splitlines() if "custom_call" in line][:3]
    return text


@pytest.fixture(scope="module")
def decoder():
    module = Decoder(CFG)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    return module, params


def test_forward_and_generate_export(decoder):
    from jsteer import interventions as iv
    from jsteer.hooks import Hooks

    module, params = decoder
    ids = jnp.ones((2, 8), jnp.int32)
    hooks = Hooks(interventions={"resid_post.1": iv.Add(jnp.ones(32), 2.0)})
    export_text(lambda p, i, h: module.apply({"params": p}, i, hooks=h, capture=("resid_post.0",)), params, ids, hooks)
    if cpu.available():  # the kernel is in the CPU program (so the check above can fail)...
        text = (
            jax.jit(lambda p, i: generate(module, p, i, max_new_tokens=3, cpu_kernels=True).tokens)
            .lower(params, ids)
            .as_text()
        )
        assert all(target in text for target in cpu.DECODER_TARGETS)
    # ...and never in a traced generate, which is what export runs
    for k in (1, 2):  # steps_per_check=2: a fixed-count loop inside the while loop
        export_text(
            lambda p, i, h, k=k: (
                generate(module, p, i, max_new_tokens=3, hooks=h, temperature=0.7, steps_per_check=k).tokens
            ),
            params,
            ids,
            hooks,
        )


def test_scanned_bf16_decoder_exports(decoder):
    import dataclasses

    from jsteer.backbones.decoder_params import stack_layers

    module = Decoder(dataclasses.replace(CFG, scan_layers=True), dtype=jnp.bfloat16)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), stack_layers(decoder[1], CFG.num_layers))
    export_text(lambda p, i: generate(module, p, i, max_new_tokens=3).tokens, params, jnp.ones((2, 8), jnp.int32))


def _trainer_step(loss_fn, params, batch, labels=None):
    opt = OptimizerConfig(learning_rate=1e-3 if labels is None else {"train": 1e-3, "frozen": None}, labels=labels)
    trainer = Trainer(loss_fn, params, opt, mesh=data_mesh(jax.devices()[:1]), precision="bf16", progress=False)
    from jsteer.train import step as step_lib

    return trainer._get_step_fn(10), (trainer.state, trainer.frozen, step_lib.global_batch(batch, trainer.mesh))


def test_lm_steer_train_step_exports(decoder):
    from jsteer.steer import train

    module, backbone = decoder
    tc = train.TrainConfig(rank=4)
    params = {"steer": train.init_params(tc, 32, 64), "embedding": backbone["embed"]["embedding"], "backbone": backbone}
    loss = train.forward_loss_fn(lambda p, i, m: module.apply({"params": p}, i, m).hidden, tc)
    batch = {"ids": np.ones((2, 8), np.int32), "mask": np.ones((2, 8), np.int32), "values": np.ones((2, 1), np.float32)}
    fn, args = _trainer_step(loss, params, batch, labels=lambda path, leaf: "train" if path[0] == "steer" else "frozen")
    export_text(fn, *args)


def test_kala_train_step_exports():
    from test_kala_e2e import encoded_task

    from jsteer.backbones.bert import BertConfig
    from jsteer.kala import data as kdata
    from jsteer.kala import train as ktrain
    from jsteer.kala.model import KalaConfig, KalaModel, init_params

    task, vocab, rels, train_set, _ = encoded_task(0, 8, 2)
    bert = BertConfig(
        vocab_size=len(task.vocab),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = KalaModel(
        bert,
        KalaConfig(method="relational", num_entities=len(vocab), num_relations=len(rels), relation_dim=8),
        num_labels=5,
    )
    params = init_params(model, jax.random.PRNGKey(0))
    _, batch = next(kdata.batches(train_set, 4, keys=ktrain.task_keys("ner")))
    fn, args = _trainer_step(ktrain.ner_loss(model), params, kdata.device_batch(batch, True))
    export_text(fn, *args)


def test_kalm_train_step_exports():
    from jsteer.kalm import train as ktrain
    from jsteer.kalm.head import TypedVocab

    vocab = TypedVocab.build(40, [[3, 4], [5, 6, 7]], disjoint=True)
    model = ktrain.make_model("kalm", ktrain.tiny_llama(40, hidden=16, layers=1, heads=2, max_len=16), vocab)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32), vocab)[
        "params"
    ]
    fn, args = _trainer_step(
        ktrain.loss_fn(model, vocab), params, {"ids": np.ones((2, 8), np.int32), "mask": np.ones((2, 8), np.int32)}
    )
    export_text(fn, *args)


def test_typevec_probe_batch_exports(decoder):
    from jsteer.steer import toy
    from jsteer.typevec import probe

    lm = toy.lm(0)
    pm = probe.from_lm(lm)
    b, t, d = 2, 6, lm.config.hidden_size
    args = (
        pm.params,
        jnp.ones((b, t), jnp.int32),
        jnp.ones((b, t), jnp.int32),
        jnp.full((b,), t - 1),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b, d)),
        jnp.ones((b,)),
        jnp.zeros((3,)),
        jnp.zeros((lm.config.vocab_size,), bool),
    )
    export_text(lambda *a: pm.score_fn(*a, mode="pos"), *args)
