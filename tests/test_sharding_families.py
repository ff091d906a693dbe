"""Every decoder family (and BERT) sharded over 8 host devices (conftest forces them): on a 2 x 4
(fsdp x tensor) and an 8 x 1 mesh it gives one device's logits, and on 2 x 4 its greedy tokens.
Apart from tests/test_sharding.py (methods on meshes) so that pytest-xdist can run the two at once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decoder_families import FAMILIES, left_padded
from test_sharding import MESHES, V, _config, random_params

from jsteer import sharding as S
from jsteer.backbones import bert, bert_heads
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_params import logical_axes
from jsteer.decode import generate


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "neox-sequential"])
def test_every_decoder_family_shards_like_one_device(name):
    cfg = _config(name)
    module = Decoder(cfg)
    ids, mask = left_padded(batch=8, seed=3)
    ids = np.minimum(ids, V - 1)
    params = random_params(jax.eval_shape(module.init, jax.random.PRNGKey(0), jnp.asarray(ids[:1]))["params"])
    fwd = jax.jit(lambda p, i, m: module.apply({"params": p}, i, m).logits)
    ref = fwd(params, jnp.asarray(ids), jnp.asarray(mask))
    ref_tokens = generate(module, params, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=4).tokens
    for mesh_name, shape in MESHES.items():
        mesh = S.make_mesh(**shape)
        placed = S.shard(params, logical_axes(params), mesh, "fsdp_tp")
        rows = jax.sharding.NamedSharding(mesh, S.batch_spec(mesh))
        i, m = jax.device_put(jnp.asarray(ids), rows), jax.device_put(jnp.asarray(mask), rows)
        err = np.abs(np.asarray(fwd(placed, i, m)) - np.asarray(ref))[mask > 0].max()
        assert err <= 1e-5, (name, mesh_name, err)
        if mesh_name == "2x4":  # greedy decoding compiles slowly on 8 host devices: once per family
            tokens = generate(module, placed, i, m, max_new_tokens=4).tokens
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens), err_msg=f"{name} {mesh_name}")


def test_bert_shards_like_one_device():
    cfg = bert.BertConfig(
        vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=32
    )
    module = bert_heads.model_for_head(cfg, "mlm")
    ids = jnp.asarray(np.random.default_rng(0).integers(1, V, (8, 12)))
    params = random_params(jax.eval_shape(module.init, jax.random.PRNGKey(0), ids)["params"])
    fwd = jax.jit(lambda p, i: module.apply({"params": p}, i).logits)
    ref = fwd(params, ids)
    for shape in MESHES.values():
        mesh = S.make_mesh(**shape)
        placed = S.shard(params, bert.logical_axes(params), mesh, "fsdp_tp")
        out = fwd(placed, ids)
        assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 1e-5
