"""jsteer.backbones.cpu: the packed matmul (decode steps, prefills, forwards) and the decode-step
attention (XLA FFI) against NumPy, the layers that use them, and generate / LM.forward with them on / off.

It runs on CPUs with AVX-512F or AVX2 + FMA (CI's and the dev VMs'); elsewhere the kernel is not used, and these
tests skip with that reason. A missing compiler on such a machine fails them."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_io import make_tiny_decoder

from jsteer import decode
from jsteer.backbones import cpu
from jsteer.backbones.decoder import Decoder, Linear
from jsteer.backbones.decoder_config import DecoderConfig
from jsteer.backbones.families import config_from_hf

if not cpu._cpu_has_vector_isa():
    pytest.skip(f"{cpu.NO_VECTOR_ISA}: jsteer.backbones.cpu is not used here", allow_module_level=True)


def test_kernel_builds_and_registers():
    assert cpu.available(), cpu.unavailable_reason()


def test_pack_layout():
    w = np.arange(5 * 100, dtype=np.float32).reshape(5, 100)
    p = np.asarray(cpu.pack(jnp.asarray(w)))
    assert p.shape == (3, 5, 48)
    for n in (0, 47, 48, 99):
        np.testing.assert_array_equal(p[n // 48, :, n % 48], w[:, n])
    assert not p[2, :, 100 - 96 :].any()  # padding columns are zero


@pytest.mark.parametrize(
    "m,k,n",
    [  # every register block of 1-8 rows (13 = 8 + 5, 15 = 8 + 7), alone and after full blocks
        (2, 576, 1536),
        (3, 37, 50),
        (4, 40, 96),
        (6, 33, 60),
        (8, 64, 48),
        (13, 129, 200),
        (15, 64, 100),
        (32, 96, 1000),
        (1, 16, 7),
        # many rows: blocks of rows that fit in 512 KiB (K 1000: 128 rows), k in slices of 64
        (300, 1000, 100),
        (20, 1536, 96),  # k >= 1024: slices of 32
        (70, 129, 49),
        # empty operands
        (0, 16, 50),
        (3, 0, 50),
        (70, 0, 5),
    ],
)
def test_small_gemm_matches_numpy(m, k, n):
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(m * 1000 + n)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu.small_gemm(x, cpu.pack(w), n))(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64)
    # fp32 sums of k terms in slices of 32-64: error well under the plain fp32 dot's bound
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * k * np.abs(want).max(initial=0.0))
    np.testing.assert_allclose(got, np.asarray(jnp.dot(x, w)), rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=0.0))


def test_small_gemm_rejects_a_mismatched_packing():
    assert cpu.available(), cpu.unavailable_reason()
    with pytest.raises(ValueError, match="does not fit"):
        cpu.small_gemm(jnp.ones((4, 10)), cpu.pack(jnp.ones((10, 60))), 100)
    with pytest.raises(ValueError, match="want a \\[K, N\\] matrix"):
        cpu.pack(jnp.ones((2, 3, 4)))


@pytest.mark.parametrize("m,k,n", [(3, 37, 50), (8, 64, 48), (70, 129, 49), (300, 1000, 100), (70, 0, 5), (0, 16, 50)])
def test_the_kernels_bias_equals_adding_it_after(m, k, n):
    """The bias is added as the sums are written (last k slice; whole and partial panels): bit for
    bit the product then ``+ b``, which is what the packed layers gave before."""
    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(m + k + n)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) * 10
    fused = jax.jit(lambda x, w, b: cpu.packed_affine(x, w, cpu.pack(w), b))(x, w, b)
    after = jax.jit(lambda x, w, b: cpu.packed_matmul(x, w, cpu.pack(w)) + b)(x, w, b)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(after))
    with pytest.raises(ValueError, match="bias \\(3,\\) does not fit n="):
        cpu.small_gemm(jnp.asarray(x), cpu.pack(jnp.asarray(w)), n, jnp.ones(3))


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 300])
def test_packed_linear_equals_plain(rows):
    """Any row count: decode steps (1-64 rows), prefills and forwards (more; past cpu.kernel_rows(),
    on AVX2, through XLA's product)."""
    assert cpu.available(), cpu.unavailable_reason()
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1, 24)), jnp.float32)
    lin = Linear((70,), use_bias=True)
    params = lin.init(jax.random.PRNGKey(0), x)["params"]
    params = {"bias": params["bias"] + 0.5, "kernel": params["kernel"]}
    want = lin.apply({"params": params}, x)
    packed = {"kernel": cpu.pack(params["kernel"])}
    fn = jax.jit(lambda p, pk, x: lin.apply({"params": p, "packed": pk}, x))
    got = fn(params, packed, x)
    through_kernel = cpu.kernel_rows() is None or rows <= cpu.kernel_rows()
    assert ("jsteer_small_gemm" in fn.lower(params, packed, x).as_text()) == through_kernel
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_packed_linear_differentiates_like_plain():
    """Reverse and forward mode through the kernel's layer: the plain layer's derivatives, in x and
    in the weights (the packed copy itself gets none)."""
    assert cpu.available(), cpu.unavailable_reason()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((80, 24)), jnp.float32)
    lin = Linear((70,), use_bias=True)
    params = lin.init(jax.random.PRNGKey(0), x)["params"]
    packed = {"kernel": cpu.pack(params["kernel"])}

    def loss(p, x, pk=None):
        variables = {"params": p} if pk is None else {"params": p, "packed": pk}
        return jnp.sum(jnp.sin(lin.apply(variables, x)))

    for argnums in (0, 1):
        want = jax.grad(loss, argnums)(params, x)
        got = jax.jit(jax.grad(loss, argnums))(params, x, packed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    dx = jnp.ones_like(x)
    want = jax.jvp(lambda x: loss(params, x), (x,), (dx,))
    got = jax.jvp(lambda x: loss(params, x, packed), (x,), (dx,))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    ddx = jax.hessian(lambda x: loss(params, x[:2], packed))(x[:2])
    np.testing.assert_allclose(ddx, jax.hessian(lambda x: loss(params, x[:2]))(x[:2]), rtol=1e-4, atol=1e-5)


def test_lm_forward_multiplies_through_the_kernel_by_default(tmp_path):
    """LM.forward on CPU: the packed weights' products (packed once and kept, like generate's), the
    logits of XLA's products to fp32 rounding; cpu_kernels=False keeps XLA's; not with mesh=."""
    import jsteer
    from jsteer import lm as lm_module
    from jsteer.train import data_mesh

    assert cpu.available(), cpu.unavailable_reason()
    make_tiny_decoder(tmp_path, "llama")
    lm = jsteer.load(tmp_path)
    ids = jnp.asarray(np.random.default_rng(0).integers(5, 60, (3, 80)), jnp.int32)  # 240 rows
    seen, packs = [], []
    real, real_pack = lm_module._forward, decode._pack

    def spy(module, params, packed, *rest):
        seen.append(packed is not None)
        return real(module, params, packed, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_module, "_forward", spy)
        mp.setattr(decode, "_pack", lambda *a: packs.append(1) or real_pack(*a))
        fast, plain = lm.forward(ids).logits, lm.forward(ids, cpu_kernels=False).logits
        lm.forward(ids[:1])
        assert seen == [True, False, True] and len(packs) == 1  # packed once, kept
    np.testing.assert_allclose(np.asarray(fast), np.asarray(plain), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one device"):
        lm.forward(ids, mesh=data_mesh(), cpu_kernels=True)


def _attention_numpy(q, k, v, visible, bias, scale, softcap):
    """fp64: q [B,K,G,H], k [B,K,H,S], v [B,K,S,H], visible / bias [B,S] -> [B,K,G,H]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bkgh,bkhs->bkgs", q, k) * scale
    if softcap:
        scores = np.tanh(scores / softcap) * softcap
    scores = np.where(visible[:, None, None], scores + bias[:, None, None], -1e30)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bkgs,bksh->bkgh", w / w.sum(-1, keepdims=True), v)


@pytest.mark.parametrize(
    "b,kh,g,h,s,window,softcap,with_bias",
    [  # slots: all, a prefix, a window; 1-8 queries per kv head; tails of 16 lanes; work for 1 thread
        (8, 3, 3, 64, 80, (0, 17), None, False),
        (8, 3, 3, 64, 80, (5, 80), 30.0, True),
        (2, 2, 7, 96, 33, (3, 20), None, True),
        (3, 1, 8, 256, 1000, (0, 1000), None, False),
        (1, 4, 1, 80, 5, (0, 5), 3.0, False),
        (4, 2, 2, 8, 16, (15, 16), None, True),
        # few heads, long spans: cut into pieces (empty ones too) and combined
        (1, 3, 3, 64, 2000, (10, 300), None, True),
        (1, 2, 2, 32, 1024, (1000, 1010), None, False),
        (2, 1, 4, 64, 1024, (0, 500), 5.0, False),
    ],
)
def test_decode_attention_matches_numpy(b, kh, g, h, s, window, softcap, with_bias):
    from jsteer.backbones.attention import dot_product_attention

    assert cpu.available(), cpu.unavailable_reason()
    rng = np.random.default_rng(s * 10 + g)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, kh, g, h), (b, kh, h, s), (b, kh, s, h)))
    visible = np.zeros((b, s), bool)
    visible[:, window[0] : window[1]] = True
    visible[0, window[0] + (window[1] - window[0]) // 2] = window[1] - window[0] < 3  # a hole inside the window
    if b > 1:
        visible[1] = False  # a row that sees nothing: equal weights, as the hand-written path gives
    bias = rng.standard_normal((b, s)).astype(np.float32) if with_bias else np.zeros((b, s), np.float32)
    scale = h**-0.5
    got = jax.jit(lambda *a: cpu.decode_attention(*a, scale=scale, softcap=softcap))(
        q, k, v, visible, bias if with_bias else None
    )
    np.testing.assert_allclose(np.asarray(got), _attention_numpy(q, k, v, visible, bias, scale, softcap), atol=2e-6)
    hand = dot_product_attention(
        jnp.asarray(q)[:, None],
        k,
        v,
        scale=scale,
        visible=visible[:, None, None, None],
        bias=bias[:, None, None, None] if with_bias else None,
        cache_layout=True,
        softcap=softcap,
    )[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(hand), atol=2e-6)


def test_decode_attention_rejects_mismatched_shapes():
    q, k, v = jnp.ones((2, 3, 4, 8)), jnp.ones((2, 3, 8, 10)), jnp.ones((2, 3, 10, 8))
    with pytest.raises(ValueError, match=r"needs k \[B,K,H,S\]"):
        cpu.decode_attention(q, k.transpose(0, 1, 3, 2), v, jnp.ones((2, 10), bool), None, 1.0, None)
    with pytest.raises(ValueError, match="bias"):
        cpu.decode_attention(q, k, v, jnp.ones((2, 10), bool), jnp.ones((1, 10)), 1.0, None)


def _models():
    llama_tied = DecoderConfig.llama(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    llama_untied = DecoderConfig.llama(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=True,
    )
    gpt2 = config_from_hf(
        dict(model_type="gpt2", vocab_size=97, n_positions=64, n_embd=48, n_layer=2, n_head=4, n_inner=96)
    )
    gemma2 = config_from_hf(  # soft-capped attention logits, sliding-window and global layers
        dict(
            model_type="gemma2",
            vocab_size=97,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=4,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        )
    )
    return [Decoder(llama_tied), Decoder(llama_untied), Decoder(gpt2), Decoder(gemma2)]


@pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["llama_tied", "llama_untied_bias", "gpt2", "gemma2"])
def test_generate_with_kernel_equals_without(index):
    assert cpu.available(), cpu.unavailable_reason()
    module = _models()[index]
    rng = np.random.default_rng(index)
    ids = jnp.asarray(rng.integers(3, 97, size=(5, 6)), jnp.int32)
    mask = jnp.asarray(np.array([[0, 0, 1, 1, 1, 1]] * 2 + [[1] * 6] * 3), jnp.int32)
    params = jax.jit(module.init)(jax.random.PRNGKey(index), ids, mask)["params"]
    params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 2 else a, params)  # peaked logits: no near-ties

    # the step's logits through the packed weights == through XLA's dot
    step_ids = ids[:, -1:]
    plain = module.apply({"params": params}, step_ids)
    packed = module.decode_pack(params)
    fast = module.apply({"params": params, "packed": packed}, step_ids)
    np.testing.assert_allclose(np.asarray(fast.logits), np.asarray(plain.logits), rtol=1e-5, atol=1e-4)
    # a decode step over a filled cache (left-padded rows): attention through the kernel too
    pre = module.apply({"params": params}, ids, mask, cache=module.config.init_cache(5, 9))

    def step(variables):
        return module.apply(variables, step_ids, jnp.ones((5, 1), jnp.int32), cache=pre.cache, step=True).logits

    with_kernels = jax.jit(step).lower({"params": params, "packed": packed})
    assert cpu.ATTENTION_TARGET in with_kernels.as_text()
    np.testing.assert_allclose(
        np.asarray(with_kernels.compile()({"params": params, "packed": packed})),
        np.asarray(step({"params": params})),
        rtol=1e-5,
        atol=1e-4,
    )

    outs = {}
    for on in (True, False):
        outs[on] = decode.generate(module, params, ids, mask, max_new_tokens=12, cpu_kernels=on)
    np.testing.assert_array_equal(np.asarray(outs[True].tokens), np.asarray(outs[False].tokens))
    np.testing.assert_array_equal(np.asarray(outs[True].lengths), np.asarray(outs[False].lengths))
    # the default picks the kernel for this batch (5 rows) and gives the same tokens
    assert decode._use_cpu_kernels(None, module, ids)
    auto = decode.generate(module, params, ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(auto.tokens), np.asarray(outs[True].tokens))


def test_packed_copy_is_kept_per_param_set_and_dropped_with_it():
    assert cpu.available(), cpu.unavailable_reason()
    module = _models()[0]
    ids = jnp.ones((4, 3), jnp.int32)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), ids)["params"]
    first = decode._packed_params(module, params)
    assert decode._packed_params(module, params) is first  # reused, not packed again
    key = next(k for k in decode._PACK_CACHE if k[0] == module and decode._PACK_CACHE[k] is first)
    del params
    import gc

    gc.collect()
    assert key not in decode._PACK_CACHE  # freed params take their packed copy with them


def test_under_jit_only_on_request():
    assert cpu.available(), cpu.unavailable_reason()
    module = _models()[3]  # head size 16: the prefill's attention through the kernel too
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 97, size=(4, 5)), jnp.int32)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), ids)["params"]
    params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 2 else a, params)

    def run(p, on):
        assert decode._use_cpu_kernels(None, module, ids, p) is False  # tracers: not by default
        return decode.generate(module, p, ids, max_new_tokens=6, cpu_kernels=on).tokens

    on = jax.jit(lambda p: run(p, True))
    assert all(target in on.lower(params).as_text() for target in cpu.DECODER_TARGETS)
    np.testing.assert_array_equal(np.asarray(on(params)), np.asarray(jax.jit(lambda p: run(p, None))(params)))


def test_default_policy():
    assert cpu.available(), cpu.unavailable_reason()
    module = _models()[0]
    for rows in (1, 8, cpu.MAX_ROWS):  # one row too: XLA's GEMV pays a fixed cost per product
        assert decode._use_cpu_kernels(None, module, jnp.zeros((rows, 4), jnp.int32))
    assert not decode._use_cpu_kernels(None, module, jnp.zeros((cpu.MAX_ROWS + 1, 4), jnp.int32))
    # LM.forward's products: any batch size, fp32 modules only
    assert decode._use_cpu_kernels(None, module, jnp.zeros((cpu.MAX_ROWS + 1, 4), jnp.int32), any_rows=True)
    bf16 = Decoder(module.config, dtype=jnp.bfloat16)
    assert not decode._use_cpu_kernels(None, bf16, jnp.zeros((8, 4), jnp.int32), any_rows=True)
    assert not decode._use_cpu_kernels(False, module, jnp.zeros((8, 4), jnp.int32))
    with pytest.raises(ValueError, match="has no decode_pack"):
        decode._use_cpu_kernels(True, nn.Dense(3), jnp.zeros((8, 4), jnp.int32))


def test_build_is_cached_atomic_and_reports_compiler_errors(tmp_path, monkeypatch):
    # a one-line stand-in source: the real one takes ~30 s to compile here, and its build in a fresh
    # cache is test_cpu_kernel_cache.py's test_the_real_kernel_builds_in_a_fresh_cache_...
    src = tmp_path / "stand_in.cc"
    src.write_text('extern "C" int jsteer_stand_in() { return 1; }\n')
    monkeypatch.setattr(cpu, "_SOURCE", src)
    monkeypatch.setenv("JSTEER_CACHE", str(tmp_path))
    built = cpu._build()
    assert built.parent == tmp_path / "kernels" and built.exists()
    stamp = built.stat().st_mtime_ns
    assert cpu._build() == built and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    # the library and its sha256 record; no temp files left
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + ".sha256"]
    built.unlink()
    built.with_name(built.name + ".sha256").unlink()
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="compiling stand_in.cc failed"):
        cpu._build()
    assert not any(built.parent.iterdir())  # nothing half-written


def test_kernel_rows_follow_the_measured_cpu_types_and_the_env(monkeypatch):
    """Many rows through the kernel only on AMD's AVX-512 (where it was measured to beat XLA); the
    environment variable overrides that, and the limit decides what a traced product runs."""
    monkeypatch.delenv(cpu.ROWS_ENV, raising=False)
    try:
        for vendor, avx512, want in [
            ("AuthenticAMD", True, None),
            ("AuthenticAMD", False, cpu.MAX_ROWS),
            ("GenuineIntel", True, cpu.MAX_ROWS),
            ("GenuineIntel", False, cpu.MAX_ROWS),
        ]:
            monkeypatch.setattr(cpu, "_cpuinfo", lambda v=vendor: {"vendor_id": v, "cpu family": "26"})
            monkeypatch.setattr(cpu, "_cpu_has_avx512f", lambda a=avx512: a)
            cpu._many_rows_win.cache_clear()
            assert cpu.kernel_rows() == want, (vendor, avx512)
    finally:
        cpu._many_rows_win.cache_clear()  # recomputed from this CPU once the patches are undone
    w = jnp.ones((16, 48), jnp.float32)
    wp, x = cpu.pack(w), jnp.ones((100, 16), jnp.float32)
    for env, limit, through_kernel in [("any", None, True), ("100", 100, True), ("99", 99, False)]:
        monkeypatch.setenv(cpu.ROWS_ENV, env)
        assert cpu.kernel_rows() == limit
        text = jax.jit(lambda x: cpu.packed_matmul(x, w, wp)).lower(x).as_text()
        assert (cpu.TARGET in text) == through_kernel, env
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(cpu.ROWS_ENV, bad)
        with pytest.raises(ValueError, match=f"JSTEER_CPU_KERNEL_ROWS={bad!r}"):
            cpu.kernel_rows()


def test_describe_names_the_cpu_and_its_vector_isa():
    d = cpu.describe()
    assert d["model"] and d["model"] != "unknown"
    assert re.fullmatch(r"\w+ family \d+ model \d+", d["family"]), d["family"]  # e.g. AuthenticAMD family 26 model 2
    assert set(d["simd"]) <= set(cpu._SIMD)
    assert cpu._cpu_has_vector_isa() == ("avx512f" in d["simd"] or {"avx2", "fma"} <= set(d["simd"]))
    assert "avx2" in d["simd"]  # every x86 machine this suite runs on
    assert d["dots"] == "precise"  # the suite imports jsteer before any JAX computation
    assert d["kernel_rows"] == cpu.kernel_rows()


def test_a_packed_forward_in_a_fresh_process_registers_the_kernels():
    """No caller asks cpu.available() before a packed param tree reaches the kernels (decode_pack, then
    apply): the kernel wrappers register the targets themselves (XLA said "No FFI handler registered")."""
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "from test_cpu_attention import _tiny_decoder\n"
        "m = _tiny_decoder(); ids = jnp.ones((2, 8), jnp.int32)\n"
        "p = m.init(jax.random.PRNGKey(0), ids)['params']\n"
        "print(m.apply({'params': p, 'packed': m.decode_pack(p)}, ids).logits.shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("(2, 8, 97)")
