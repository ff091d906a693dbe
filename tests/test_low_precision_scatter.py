"""bf16 training never scatter-adds in bf16.

Gathers (embedding tables, KALA's entity memory and graph nodes) have scatter-add gradients,
and KALA's graph pools with segment sums (forward scatter-adds). On a GPU XLA emits a bf16 /
fp16 scatter-add as a compare-and-swap loop that serialises wherever ids repeat -- position and
token-type rows, padding, the null entity. Measured on an H100 (experiments/gpu_step_anatomy.py,
session 29): MiniLM's bf16 gradient at batch 256 x 32 took 47 ms against 6 ms in fp32. These
tests read the jitted program (before XLA's passes; lowered from the params' shapes and dtypes, so
no program is compiled) and fail on any accumulating scatter
(add / max / min / mul) whose result is bf16 / fp16; a scatter that sets rows is left alone.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.backbones import bert, bert_heads
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.backbones.families import config_from_hf
from jsteer.train.step import cast_floating

LOW_SCATTER = re.compile(r"scatter-(add|max|min|mul)[.\w]*\s*=\s*(bf16|f16)\[")


def hlo_lines(pattern: re.Pattern, fn, *args) -> list[str]:
    """The lines of fn's jitted program (HLO before XLA's passes) that ``pattern`` matches."""
    hlo = jax.jit(fn).lower(*args).as_text(dialect="hlo")
    return [line.strip()[:200] for line in hlo.splitlines() if pattern.search(line)]


def low_precision_scatters(fn, *args) -> list[str]:
    return hlo_lines(LOW_SCATTER, fn, *args)


def abstract_init(module, *inputs):
    """The params' shapes and dtypes only: lowering reads nothing else (no init is run)."""
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs)["params"])


def abstract_cast(params, dtype):
    return jax.eval_shape(lambda p: cast_floating(p, dtype), params)


def grad_of_logits(module, *inputs):
    def loss(p):
        return jnp.sum(module.apply({"params": p}, *inputs).logits.astype(jnp.float32) ** 2)

    return jax.grad(loss)


def test_the_check_finds_a_bf16_scatter():
    table = jnp.ones((10, 4), jnp.bfloat16)
    ids = jnp.zeros((6,), jnp.int32)
    found = low_precision_scatters(jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0).astype(jnp.float32))), table)
    assert found and "bf16" in found[0]
    assert (
        low_precision_scatters(jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0))), table.astype(jnp.float32)) == []
    )


@pytest.mark.parametrize("way", ["params cast", "module dtype"])
def test_bert_bf16_gradient_has_no_low_precision_scatter(way):
    cfg = bert.BertConfig(
        vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_position_embeddings=16
    )
    ids = jnp.asarray(np.arange(16).reshape(2, 8) % 50)
    mask = jnp.ones_like(ids)
    init = abstract_init(bert_heads.BertForTokenClassification(cfg, 3), ids, mask)
    if way == "params cast":  # the Trainer's mixed precision: fp32 masters cast to bf16 inside the step
        module, p = bert_heads.BertForTokenClassification(cfg, 3), abstract_cast(init, jnp.bfloat16)
    else:
        module, p = bert_heads.BertForTokenClassification(cfg, 3, dtype=jnp.bfloat16), init
    assert low_precision_scatters(grad_of_logits(module, ids, mask), p) == []


def test_decoder_bf16_gradients_have_no_low_precision_scatter():
    ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])  # repeated (padding) ids too
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1] * 6])
    lcfg = DecoderConfig.llama(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8
    )
    m = Decoder(lcfg, dtype=jnp.bfloat16)
    p = abstract_init(m, ids, mask)
    for params in (p, abstract_cast(p, jnp.bfloat16)):
        assert low_precision_scatters(grad_of_logits(m, ids, mask), params) == []
    gm = Decoder(
        config_from_hf(
            dict(model_type="gpt2", vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=32)
        ),
        dtype=jnp.bfloat16,
    )
    p = abstract_init(gm, ids, mask)
    assert low_precision_scatters(grad_of_logits(gm, ids, mask), p) == []


@pytest.mark.parametrize(
    "method", ["finetune", "more_params", "pointwise", "relational", "ernie", "eae", "adapter", "kbert"]
)
def test_kala_bf16_gradient_has_no_low_precision_scatter(method):
    """Every method of the KALA harness (KALA's own and the variants): entity-memory, graph-node
    and embedding gathers in bf16 all accumulate their gradients in fp32."""
    from test_kala import tiny_bert, tiny_inputs

    from jsteer.kala.variants import registry

    ids, mask, graph, tok = tiny_inputs()
    opts = dict(num_relations=5, relation_dim=8, kfm_zero_init=False) if method in ("pointwise", "relational") else {}
    if method == "ernie":
        opts = dict(entity_heads=2)
    model = registry.build_model(method, tiny_bert(), num_labels=3, num_entities=4, **opts)
    p = jax.eval_shape(lambda: cast_floating(registry.init_params(model, jax.random.PRNGKey(0)), jnp.bfloat16))
    kw = {}
    if method in registry.VARIANTS:
        kw["extras"] = {k: jnp.zeros_like(ids) for k in registry.extra_keys(model)} or None

    def loss(p):
        out = model.apply(
            {"params": p}, ids, mask, None, graph, tok, False, rngs={"dropout": jax.random.PRNGKey(1)}, **kw
        )
        aux = getattr(out, "aux_loss", None)
        return jnp.sum(out.logits.astype(jnp.float32) ** 2) + (0.0 if aux is None else aux.astype(jnp.float32))

    assert low_precision_scatters(jax.grad(loss), p) == []


def test_a_bf16_decoders_lookups_never_view_the_whole_table_as_float32():
    """The fp32 accumulation lives in the gradient alone: a forward (and generate's decode loop)
    gathers the bf16 table itself. Viewing it as fp32 there converted a 1B model's tied 128k x 2048
    table inside the loop every step (0.38 ms of a 1.8 ms H200 step, session 48)."""
    from jsteer.decode import generate

    vocab, d = 40, 16
    cfg = DecoderConfig.llama(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    m = Decoder(cfg, dtype=jnp.bfloat16)
    ids = jnp.asarray([[1, 2, 3, 4]])
    p = abstract_cast(abstract_init(m, ids), jnp.bfloat16)
    table_f32 = re.compile(rf"f32\[{vocab},{d}\]")
    assert hlo_lines(table_f32, lambda p: m.apply({"params": p}, ids).logits, p) == []

    def gen(p):
        return generate(m, p, ids, max_new_tokens=3, cpu_kernels=False).tokens

    assert hlo_lines(table_f32, gen, p) == []
    # the gradient still accumulates in fp32: its scatter-add is f32[V, D]
    assert hlo_lines(table_f32, grad_of_logits(m, ids), p) != []
