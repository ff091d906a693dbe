"""The shared hook contract: FiLM, steer and composition against NumPy re-derivations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsteer.hooks import (
    FiLM,
    Hooks,
    Steer,
    apply_embed,
    apply_film,
    apply_steer,
    apply_step_embed,
    check_encoder_hooks,
    check_film_layers,
    compose,
    steer_delta,
)

B, T, D, S, R = 2, 3, 8, 2, 4


def _rand(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_none_hooks_are_identity_bitwise():
    h = jnp.asarray(_rand(0, B, T, D))
    for hooks in (None, Hooks()):
        assert np.array_equal(apply_embed(h, hooks), h)
        assert np.array_equal(apply_film(h, hooks, 0, "in"), h)
        assert np.array_equal(apply_steer(h, hooks), h)
    zero = Hooks(film={0: FiLM(gamma_in=jnp.zeros((B, T, D)), beta_in=jnp.zeros((B, T, D)))})
    assert np.array_equal(apply_film(h, zero, 0, "in"), h)


def test_film_matches_numpy_and_only_named_layer():
    h, g, b = _rand(1, B, T, D), _rand(2, B, T, D), _rand(3, B, T, D)
    hooks = Hooks(film={1: FiLM(gamma_out=jnp.asarray(g), beta_out=jnp.asarray(b))})
    np.testing.assert_allclose(apply_film(jnp.asarray(h), hooks, 1, "out"), (1 + g) * h + b, rtol=1e-6)
    assert np.array_equal(apply_film(jnp.asarray(h), hooks, 1, "in"), h)
    assert np.array_equal(apply_film(jnp.asarray(h), hooks, 0, "out"), h)
    with pytest.raises(ValueError, match="where"):
        apply_film(jnp.asarray(h), hooks, 1, "middle")


@pytest.mark.parametrize("per_row", [False, True])
def test_low_rank_steer_matches_numpy(per_row):
    h, p1, p2 = _rand(4, B, T, D), _rand(5, S, D, R), _rand(6, S, D, R)
    eps = _rand(7, B, S) if per_row else _rand(7, S)
    out = apply_steer(jnp.asarray(h), Hooks(steer=Steer(eps=jnp.asarray(eps), p1=jnp.asarray(p1), p2=jnp.asarray(p2))))
    ref = h.copy()
    for b in range(B):
        for s in range(S):
            w = p1[s] @ p2[s].T
            e = eps[b, s] if per_row else eps[s]
            ref[b] += e * (h[b] @ w.T)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_full_rank_equals_low_rank():
    h, p1, p2, eps = _rand(8, B, T, D), _rand(9, S, D, R), _rand(10, S, D, R), _rand(11, S)
    w = np.einsum("sdr,ser->sde", p1, p2)
    a = steer_delta(jnp.asarray(h), Steer(eps=jnp.asarray(eps), p1=jnp.asarray(p1), p2=jnp.asarray(p2)))
    b = steer_delta(jnp.asarray(h), Steer(eps=jnp.asarray(eps), w=jnp.asarray(w)))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_steer_eps_shape_errors():
    h = jnp.zeros((B, T, D))
    st = Steer(eps=jnp.zeros((S + 1,)), p1=jnp.zeros((S, D, R)), p2=jnp.zeros((S, D, R)))
    with pytest.raises(ValueError, match="eps"):
        steer_delta(h, st)
    st = Steer(eps=jnp.zeros((B + 1, S)), p1=jnp.zeros((S, D, R)), p2=jnp.zeros((S, D, R)))
    with pytest.raises(ValueError, match="eps"):
        steer_delta(h, st)
    with pytest.raises(ValueError, match="p1"):
        steer_delta(h, Steer(eps=jnp.zeros((S,))))


def test_embed_offset_shape_error():
    with pytest.raises(ValueError, match="embed_offset"):
        apply_embed(jnp.zeros((B, T, D)), Hooks(embed_offset=jnp.zeros((B, T + 1, D))))


def test_step_offset_shape_errors_and_broadcast():
    x = jnp.zeros((B, 1, D))
    for bad in (jnp.zeros((D,)), jnp.zeros((B, T, D)), jnp.zeros((B, D + 1)), jnp.zeros((B + 1, D))):
        with pytest.raises(ValueError, match=r"step_offset must be \[B=2, D=8\]"):
            apply_step_embed(x, Hooks(step_offset=bad))
    off = _rand(3, 1, D)  # one offset for every row
    np.testing.assert_array_equal(
        apply_step_embed(x, Hooks(step_offset=jnp.asarray(off))), np.broadcast_to(off, (B, D))[:, None]
    )


def test_encoders_refuse_decoder_only_hooks():
    check_encoder_hooks(Hooks(embed_offset=jnp.zeros((B, T, D))))  # fine
    with pytest.raises(ValueError, match="hooks.steer acts on a decoder"):
        check_encoder_hooks(Hooks(steer=Steer(eps=jnp.zeros((S,)), w=jnp.zeros((S, D, D)))))
    with pytest.raises(ValueError, match="hooks.step_offset acts on a decoder"):
        check_encoder_hooks(Hooks(step_offset=jnp.zeros((B, D))))


def test_compose_chains_film_and_adds_offsets_and_stacks_steers():
    h = _rand(12, B, T, D)
    g1, b1, g2, b2 = (_rand(13 + i, B, T, D) for i in range(4))
    o1, o2 = _rand(20, B, T, D), _rand(21, B, T, D)
    p1, p2 = _rand(22, 1, D, R), _rand(23, 1, D, R)
    q1, q2 = _rand(24, 1, D, R), _rand(25, 1, D, R)
    ha = Hooks(
        embed_offset=jnp.asarray(o1),
        film={0: FiLM(gamma_in=jnp.asarray(g1), beta_in=jnp.asarray(b1))},
        steer=Steer(eps=jnp.asarray([0.5]), p1=jnp.asarray(p1), p2=jnp.asarray(p2)),
    )
    hb = Hooks(
        embed_offset=jnp.asarray(o2),
        film={0: FiLM(gamma_in=jnp.asarray(g2), beta_in=jnp.asarray(b2))},
        steer=Steer(eps=jnp.asarray([-2.0]), p1=jnp.asarray(q1), p2=jnp.asarray(q2)),
    )
    c = compose(ha, None, hb)
    np.testing.assert_allclose(c.embed_offset, o1 + o2, rtol=1e-6)
    chained = (1 + g2) * ((1 + g1) * h + b1) + b2
    np.testing.assert_allclose(apply_film(jnp.asarray(h), c, 0, "in"), chained, rtol=1e-5, atol=1e-5)
    sequential = apply_steer(jnp.asarray(h), ha) + apply_steer(jnp.asarray(h), hb) - h
    np.testing.assert_allclose(apply_steer(jnp.asarray(h), c), sequential, rtol=1e-5, atol=1e-5)
    assert compose(None, None) is None


def test_hooks_are_pytrees_and_jit_without_recompiling_on_values():
    traces = []

    @jax.jit
    def f(h, hooks):
        traces.append(1)
        return apply_steer(apply_film(apply_embed(h, hooks), hooks, 0, "in"), hooks)

    h = jnp.ones((B, T, D))
    for scale in (0.0, 1.0, 3.0):
        hooks = Hooks(
            embed_offset=scale * jnp.ones((B, T, D)),
            film={0: FiLM(gamma_in=scale * jnp.ones((B, T, D)))},
            steer=Steer(eps=scale * jnp.ones((S,)), p1=jnp.ones((S, D, R)), p2=jnp.ones((S, D, R))),
        )
        f(h, hooks).block_until_ready()
    assert len(traces) == 1


def test_check_film_layers_accepts_layer_indices_only():
    z = FiLM(beta_out=jnp.zeros((B, T, D)))
    check_film_layers(None, 2)
    check_film_layers(Hooks(), 2)
    check_film_layers(Hooks(film={0: z, np.int64(1): z}), 2)  # NumPy ints index layers too
    for key in (2, 99, "1", 1.0, True):
        with pytest.raises(ValueError, match=rf"hooks.film has key {key!r}: .*range\(2\)"):
            check_film_layers(Hooks(film={key: z}), 2)
    with pytest.raises(ValueError, match="negative indices are not supported: write 1 for layer -1"):
        check_film_layers(Hooks(film={-1: z}), 2)
    with pytest.raises(ValueError, match=r"key -3: .*range\(2\)\ \(this model has 2 layers\)$"):
        check_film_layers(Hooks(film={-3: z}), 2)


def test_steer_field_rank_and_compose_batch_errors():
    """A 1-D blacklist bias / offset vec names the field (not eps); composing per-row eps of two
    batch sizes names eps."""
    from jsteer.hooks import apply_steer_logits

    with pytest.raises(ValueError, match=r"Steer.bias must be \[S, V\]"):
        apply_steer_logits(jnp.zeros((B, T, 64)), Hooks(steer=Steer(eps=jnp.ones((1,)), bias=jnp.ones((64,)))))
    with pytest.raises(ValueError, match=r"Steer.vec must be \[S, D\]"):
        steer_delta(jnp.zeros((B, T, D)), Steer(eps=jnp.ones((1,)), vec=jnp.ones((D,))))
    a = Hooks(steer=Steer(eps=jnp.ones((2, 1)), vec=jnp.ones((1, D))))
    b = Hooks(steer=Steer(eps=jnp.ones((3, 1)), vec=jnp.ones((1, D))))
    with pytest.raises(ValueError, match="per-row eps of different batch sizes"):
        compose(a, b)
